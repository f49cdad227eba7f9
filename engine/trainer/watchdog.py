"""A hang that explains itself: a watchdog thread on every rank (``trainer.hang_timeout_minutes``).

A rank stuck in a collective (NCCL, gloo) waits there until the collective's own timeout, with
nothing on the screen, and even then the error names no phase and no culprit. Each rank here
records what it is doing: the phase of the PPO step it is in (``engine.trainer.tracking.phase``
reports entries and exits) or, between phases, the last one it left. A thread checks every second:

1. when this rank has been in one activity longer than the timeout, it asks every rank for its
   stacks by creating ``<run>/logs/stacks/REQUESTED`` (all ranks share the run directory's file
   system, as for checkpoints);
2. every rank's thread that sees the request writes ``stacks/rank_<r>.txt``: its activity and the
   Python stacks of all its threads (``faulthandler``, which needs no GIL held by the stuck thread);
3. each rank waits a few seconds for every rank's file; rank 0 then says on its terminal which
   phase hung, on which ranks, and which ranks did not arrive (they are elsewhere: an earlier
   phase, or no file at all: a rank that is gone or hung below Python);
4. rank 0 exits (``HANG_EXIT_STATUS``), the others once it has reported (torchrun stops every rank
   as soon as one exits: rank 0 must have spoken by then); each rank's reaper
   (``engine.lifecycle``) stops what the rank started.

A run resumed in the same run directory moves an earlier hang's ``stacks/`` to ``stacks-<time>``
before its watchdogs start. Stands apart from the trainer's math: a thread, a clock and files; the test hook
``TRIDENT_TEST_STALL=<rank>:<phase>`` (``engine.trainer.fault_injection``) makes that rank stop for good before
entering that phase.
"""
from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from engine.trainer.console import say_error
from engine.trainer.fault_injection import stall_if_asked
from parallel.state import control_group

logger = logging.getLogger(__name__)

HANG_EXIT_STATUS = 3
REQUEST_FILE = "REQUESTED"
REPORTED_FILE = "REPORTED"
POLL_S = 1.0
GATHER_S = 15.0  # how long each rank waits for every rank's stacks
REPORT_WAIT_S = 10.0  # then how long the others wait for rank 0's report before they exit


@dataclass
class Activity:
    """What a rank is doing: ``phase`` of ``step``, inside it or (``inside=False``) after it."""

    phase: str = "start-up"
    step: int = 0
    inside: bool = False
    since: float = 0.0

    def describe(self, now: float) -> str:
        where = f"in '{self.phase}'" if self.inside else f"after '{self.phase}'"
        return f"{where} of step {self.step}, for {now - self.since:.0f} s"


class HangWatchdog:
    """The watchdog of one rank; ``start()`` it once the loop begins, ``stop()`` it at the end."""

    def __init__(self, timeout_s: float, stacks_dir: Path, rank: int, world_size: int) -> None:
        self.timeout_s, self.stacks_dir, self.rank, self.world_size = timeout_s, Path(stacks_dir), rank, world_size
        self.activity = Activity(since=time.monotonic())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trident-hang-watchdog", daemon=True)

    # ---- what the rank reports --------------------------------------------------------------
    def at_step(self, step: int) -> None:
        self.activity = Activity(self.activity.phase, step, self.activity.inside, self.activity.since)

    def entered(self, phase: str) -> None:
        stall_if_asked(self.rank, phase)
        self.activity = Activity(phase, self.activity.step, True, time.monotonic())

    def left(self, phase: str) -> None:
        self.activity = Activity(phase, self.activity.step, False, time.monotonic())

    # ---- the thread -------------------------------------------------------------------------
    def start(self) -> None:
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        request = self.stacks_dir / REQUEST_FILE
        while not self._stop.wait(POLL_S):
            activity, now = self.activity, time.monotonic()
            if now - activity.since > self.timeout_s and not request.exists():
                try:  # the first rank to ask names the hang; the others find the file there
                    descriptor = os.open(request, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                    os.write(descriptor, f"rank {self.rank}: {activity.describe(now)}\n".encode())
                    os.close(descriptor)
                except FileExistsError:
                    pass
            if request.exists():
                self._dump_and_exit(request)

    def _dump_and_exit(self, request: Path) -> None:
        """Write this rank's stacks; wait for every rank's; rank 0 reports, then all exit. No rank
        exits before rank 0 has reported: torchrun stops the other ranks as soon as one exits, and
        a rank whose main thread is running Python then ends at once (SIGTERM), unreported."""
        now = time.monotonic()
        stacks = self._stacks_file(self.rank)
        with open(stacks.with_suffix(".tmp"), "w") as out:
            out.write(f"rank {self.rank}: {self.activity.describe(now)}\n\n")
            out.flush()
            faulthandler.dump_traceback(out, all_threads=True)
        stacks.with_suffix(".tmp").rename(stacks)  # whole, for rank 0 to read
        self._wait_for(lambda: all(self._stacks_file(rank).exists() for rank in range(self.world_size)), GATHER_S)
        reported = self.stacks_dir / REPORTED_FILE
        if self.rank == 0:
            say_error(self._summary(request))
            reported.touch()
        elif not self._wait_for(reported.exists, REPORT_WAIT_S) and request.read_text().startswith(f"rank {self.rank}:"):
            say_error(f"{self._headline(request)}; rank 0 did not report (gone, or stuck below Python); "
                      f"every rank's stacks: {self.stacks_dir}")
        logging.shutdown()
        os._exit(HANG_EXIT_STATUS)

    def _stacks_file(self, rank: int) -> Path:
        return self.stacks_dir / f"rank_{rank:05d}.txt"

    @staticmethod
    def _wait_for(condition, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def _headline(self, request: Path) -> str:
        """Who asked for the stacks, and the limit it passed."""
        first = (request.read_text().splitlines() or ["a rank"])[0]
        return f"[trident] error: a hang: {first} > trainer.hang_timeout_minutes={self.timeout_s / 60:g}"

    def _summary(self, request: Path) -> str:
        """Rank 0's line: the hung phase, where each rank is, where the stacks are."""
        files = {rank: self._stacks_file(rank) for rank in range(self.world_size)}
        where = {rank: path.read_text().splitlines()[0].split(": ", 1)[1] for rank, path in files.items()
                 if path.exists()}
        mine = self.activity
        arrived = [rank for rank, text in where.items() if text.startswith(f"in '{mine.phase}' of step {mine.step},")]
        elsewhere = [f"rank {rank} is {text}" for rank, text in where.items() if rank not in arrived]
        silent = [rank for rank in range(self.world_size) if rank not in where]
        parts = [f"{self._headline(request)}; phase '{mine.phase}' of step {mine.step} holds rank(s) "
                 f"{', '.join(map(str, arrived)) or 'none'}"]
        if elsewhere:
            parts.append("did not arrive: " + "; ".join(elsewhere))
        if silent:
            parts.append(f"no stacks from rank(s) {', '.join(map(str, silent))} (gone, or stuck below Python)")
        parts.append(f"every rank's stacks: {self.stacks_dir}")
        return "; ".join(parts)


_WATCHDOG: HangWatchdog | None = None


def timeout_minutes(hang_timeout_minutes: float | None, collective_timeout_minutes: float) -> float:
    """``trainer.hang_timeout_minutes``, null meaning 80% of the collective timeout (so the watchdog
    explains a hang before the collective's own timeout ends it with less to say); 0 = off."""
    return 0.8 * collective_timeout_minutes if hang_timeout_minutes is None else hang_timeout_minutes


@contextlib.contextmanager
def watching(minutes: float, stacks_dir: Path, rank: int, world_size: int) -> Iterator[None]:
    """A watchdog on this rank for the duration of the block (none for ``minutes`` 0)."""
    global _WATCHDOG
    if minutes <= 0:
        yield
        return
    _set_aside_an_earlier_hang(Path(stacks_dir), rank)
    _WATCHDOG = HangWatchdog(minutes * 60, stacks_dir, rank, world_size)
    _WATCHDOG.start()
    try:
        yield
    finally:
        _WATCHDOG.stop()
        _WATCHDOG = None


def _set_aside_an_earlier_hang(stacks_dir: Path, rank: int) -> None:
    """A run resumed in the run directory of one that hung finds its REQUESTED file and stacks:
    rank 0 moves them to ``stacks-<time>`` (kept for reading) before any rank's watchdog starts,
    or every rank would take the old request for a new one and end at once (collective)."""
    if rank == 0 and stacks_dir.exists():
        stacks_dir.rename(stacks_dir.with_name(f"{stacks_dir.name}-{time.strftime('%Y%m%d-%H%M%S')}"))
    if dist.is_initialized():
        dist.barrier(group=control_group())


def at_step(step: int) -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.at_step(step)


def entered(phase: str) -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.entered(phase)


def left(phase: str) -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.left(phase)
