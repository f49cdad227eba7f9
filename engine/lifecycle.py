"""Nothing a rank started outlives it: a reaper process per rank, and graceful SIGTERM.

A training rank starts processes of its own: dist-checkpointing's writer Manager and
multiprocessing's resource tracker (in the rank's process group), SGLang servers (in sessions of
their own, so a job signal does not reach them half-way), Ray's local cluster. When the rank ends
normally its ``finally`` blocks and ``atexit`` hooks stop them; a rank that is killed (SIGKILL,
the OOM killer) runs no code at all. So each rank starts a reaper first::

    reaper = start_reaper()          # launch.main, before anything else is started
    watch_process_group(pgid)        # whoever starts a process in a session of its own

The reaper (``python -m engine.lifecycle``) runs in a session of its own and reads a pipe from the
rank. When the rank's end closes, however the rank ended, it SIGKILLs the rank's process group (if
the rank leads one: torchrun starts every worker in a session of its own) and every process group
it was told to watch, then exits.
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import time
from typing import NoReturn

_REAPER: subprocess.Popen | None = None


def start_reaper() -> subprocess.Popen:
    """Start this process's reaper (once); see the module docstring."""
    global _REAPER
    if _REAPER is None:
        # Our own process group only when we lead it: otherwise it is the launching shell's.
        own_group = os.getpgid(0) if os.getpgid(0) == os.getpid() else 0
        _REAPER = subprocess.Popen([sys.executable, "-m", "engine.lifecycle", str(os.getpid()), str(own_group)],
                                   stdin=subprocess.PIPE, text=True, start_new_session=True)
        os.register_at_fork(after_in_child=_let_go_of_the_reaper)
    return _REAPER


def exit_now(code: int) -> NoReturn:
    """End a launcher process whose job is done with ``code``: its ``atexit`` hooks run (logging's,
    the reaper's pipe, every stop we registered) and its standard streams are flushed, but the
    interpreter's own teardown is skipped. In a process that imported torch that teardown is one
    last garbage collection of the whole module graph (py-spy: ``gc_collect_main``), ~2 s of CPU
    after the job ended, on every ``launch.torchrun`` and ``trident`` run."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing left to keep
            pass
    os._exit(code)


def _let_go_of_the_reaper() -> None:
    """In a process forked from the rank (dist-checkpointing's writers, its results Manager on CPU):
    close the child's copy of the reaper's pipe, or the pipe would stay open after the rank died and
    the reaper would wait for that child instead of killing it with the rank's group."""
    global _REAPER
    if _REAPER is not None and _REAPER.stdin is not None:
        _REAPER.stdin.close()
    _REAPER = None


def watch_process_group(pgid: int) -> None:
    """Have the reaper kill process group ``pgid`` if this process dies first (no-op without a reaper)."""
    _tell("watch", pgid)


def forget_process_group(pgid: int) -> None:
    """The group ended normally: the reaper must not signal its (reusable) id any more."""
    _tell("forget", pgid)


def _tell(verb: str, pgid: int) -> None:
    if _REAPER is not None and _REAPER.poll() is None:
        _REAPER.stdin.write(f"{verb} {pgid}\n")
        _REAPER.stdin.flush()


def stop_gracefully_on_sigterm() -> None:
    """SIGTERM (what torchrun, Slurm and kill send) raises SystemExit, so ``finally`` blocks and
    ``atexit`` hooks stop this process's children before it goes."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _reap(rank_pid: int, own_group: int, wait_s: float = 120.0) -> None:
    """The reaper's loop: remember the groups it is told about; once stdin has closed and the rank
    is gone (the pipe closes while the rank still runs its exit hooks: its exit status must stay
    its own), kill them all."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the job must not end the reaper first
    groups = {own_group} if own_group else set()
    for line in sys.stdin:
        verb, _, pgid = line.partition(" ")
        if verb == "watch":
            groups.add(int(pgid))
        elif verb == "forget":
            groups.discard(int(pgid))
    deadline = time.monotonic() + wait_s
    while _alive(rank_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


if __name__ == "__main__":
    _reap(int(sys.argv[1]), int(sys.argv[2]))
