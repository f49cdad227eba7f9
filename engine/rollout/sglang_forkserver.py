"""SGLang servers forked from a process that has already imported SGLang's server modules.

    python -m engine.rollout.sglang_forkserver SOCKET OWNER_PID     (started by ``start_forkserver``)

Every SGLang server imports sglang's HTTP server, tokenizer manager, scheduler and model runner
before it reads its model (~6,800 modules; 8-10 s of CPU on the 2-core test machine, most of a CPU
server's start). A forkserver imports them once and forks each server from itself, as
``launch.torchrun`` forks ranks. Which one a server is forked from:

- ``TRIDENT_SGLANG_FORKSERVER=<socket>``: that one, shared by every process with the variable (a
  test session starts one per pytest worker; a user may start one per node); ``=off``: none;
- otherwise this process's own, started in the background once its first servers answer
  (``prepare_own_forkserver``, so the import does not compete with their start): a server
  restarted after a crash (``rollout.max_server_restarts``) then comes back without the import.

A forked server is the program ``python -m engine.rollout.sglang_launch ARGS`` with the requested
environment and working directory: it leads a session of its own (the caller watches and kills its
process group, ``engine.rollout.sglang_server``), writes to its log, shows its own command line and
environment in ``ps`` and ``/proc`` (``engine.process_view``), and its exit status comes back.

Forking it is safe because (``engine.preload``): the import never initialises CUDA (it is watched;
a forkserver whose import did declines, and servers start as plain processes, as they do where a
GPU's SGLang spawns its scheduler and detokenizer anyway: ``sglang/srt/entrypoints/engine.py``,
``mp.set_start_method("spawn", force=True)``); it leaves no thread running; and a server whose
environment differs in a variable the import read is not forked (its log says which).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from engine.preload import ImportRecord

# Set to a forkserver's socket path: every server this process (and its children) starts is forked
# from that one (a test session's, or one a user started per node); "off": none is.
FORKSERVER_ENV = "TRIDENT_SGLANG_FORKSERVER"
SERVER_MODULE = "engine.rollout.sglang_launch"
# What a server process imports before it reads a model (the scheduler and detokenizer are forked
# from it on CPU, so theirs too); the model classes are Trident's package of them.
PRELOAD_MODULES = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.models.registry",
    "engine.rollout.sglang_launch",
    "engine.rollout.sglang_presharded",
)
READY_TIMEOUT_S = 300.0
TITLE_ROOM = 4096  # bytes of command line a forked server's title may take

logger = logging.getLogger(__name__)


class ForkserverUnavailable(RuntimeError):
    """No server can be forked from this forkserver (it declined, died, or never answered)."""


# ----------------------------------------------------------------------------- the forkserver


def preload(modules: Sequence[str] = PRELOAD_MODULES) -> "ImportRecord":
    """Import ``modules``; returns what the import depends on (``engine.preload``).
    Raises ``ForkserverUnavailable`` where forking after it would be unsafe."""
    from engine.preload import fork_safety_problem, import_modules, watched_import

    record = watched_import(import_modules(modules))
    problem = fork_safety_problem(record)
    if problem is not None:
        raise ForkserverUnavailable(problem)
    return record


class _Forkserver:
    """The serving loop: one request per connection, answered with the pid and, later, the exit status."""

    def __init__(self, listener: socket.socket, imported: "ImportRecord", owner_pid: int) -> None:
        self.listener, self.imported = listener, imported
        self.children: dict[int, socket.socket] = {}  # server pid -> its requester's connection
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ)
        self.owner = os.pidfd_open(owner_pid)
        self.selector.register(self.owner, selectors.EVENT_READ)
        self.wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
        self.selector.register(self.wakeup_r, selectors.EVENT_READ)

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    self._answer(self.listener.accept()[0])
                elif key.fileobj == self.owner:
                    return  # the process that started us is gone: servers still running keep running
                elif key.fileobj == self.wakeup_r:
                    os.read(self.wakeup_r, 4096)
            self._reap()

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            connection = self.children.pop(pid, None)
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                connection.close()

    def _answer(self, connection: socket.socket) -> None:
        connection.settimeout(30)
        try:
            request = json.loads(_read_line(connection))
            refusal = self._refusal(request)
            if refusal is not None:
                connection.sendall(json.dumps({"refused": refusal}).encode() + b"\n")
                connection.close()
                return
            request["imported_pythonpath"] = self.imported.environment.get("PYTHONPATH")
            request["set_by_import"] = self.imported.set_by_import
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                self._become_server(request)  # never returns
            self.children[pid] = connection
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except (OSError, ValueError) as error:
            logger.warning("sglang forkserver: a request failed: %s", error)
            connection.close()

    def _refusal(self, request: dict[str, Any]) -> str | None:
        if request.get("python") != sys.executable:
            return f"the server runs {request.get('python')}, the forkserver {sys.executable}"
        from engine.preload import describe_difference, environment_difference

        differing = environment_difference(self.imported.environment, request["env"], self.imported.set_by_import)
        if differing:
            return ("the server's environment differs from the one SGLang was imported with in "
                    + describe_difference(self.imported.environment, request["env"], differing))
        return None

    def _become_server(self, request: dict[str, Any]) -> None:
        """In the forked child: become ``python -m engine.rollout.sglang_launch ARGS`` as requested."""
        code = 1
        try:
            os.setsid()
            signal.set_wakeup_fd(-1)
            for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                signal.signal(signum, signal.SIG_DFL)
            self.selector.close()
            for fd in (self.listener.fileno(), self.owner, self.wakeup_r, *(c.fileno() for c in self.children.values())):
                with contextlib.suppress(OSError):
                    os.close(fd)
            log = os.open(request["log_path"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(log)
            os.close(null)
            code = _run_server(request)
        except SystemExit as end:
            code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        except BaseException:  # noqa: BLE001 - the child must never return into the serving loop
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _run_server(request: dict[str, Any]) -> int:
    """The server program, as a fresh ``python -m SERVER_MODULE`` with the request's arguments,
    environment and working directory would run it; its ``atexit`` hooks run when it ends."""
    import atexit as exit_hooks
    import random

    from engine.preload import search_path_after_fork
    from engine.process_view import set_title, show_environment
    from engine.rollout import sglang_launch

    environment = request["env"]
    os.environ.clear()
    # What the import set where the environment had nothing, as the server's own import would have.
    os.environ.update({**request["set_by_import"], **environment})
    os.chdir(request["cwd"])
    sys.path[:] = search_path_after_fork(sys.path, request["cwd"], request["imported_pythonpath"],
                                         environment.get("PYTHONPATH"))
    if environment.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    title = [sys.executable, "-m", SERVER_MODULE, *request["args"]]
    set_title(" ".join(title))
    if not show_environment(environment):
        print("[trident forkserver] this server's environment is longer than the forkserver's room for it: "
              "/proc/<pid>/environ shows it cut", file=sys.stderr)
    print(f"[trident forkserver] forked from the SGLang forkserver {os.getppid()}, which had imported SGLang",
          file=sys.stderr)
    # A fresh interpreter seeds these from the OS; a forked one would share the forkserver's state.
    random.seed()
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed()
    sys.argv = [SERVER_MODULE, *request["args"]]
    try:
        sglang_launch.main()
        return 0
    except SystemExit as end:
        return end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    finally:
        exit_hooks._run_exitfuncs()


def _read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(65536)
        if not chunk:
            raise ConnectionError("the connection closed mid-message")
        data += chunk
    return data.decode()


def main(argv: Sequence[str] | None = None) -> None:
    socket_path, owner_pid = (argv or sys.argv[1:])[:2]
    from engine.process_view import ROOM_ENV, set_title

    os.environ.pop(ROOM_ENV, None)  # the room stays in this process's memory, for its children's environments
    set_title(f"trident sglang forkserver {socket_path}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        imported = preload()
    except ForkserverUnavailable as error:
        print(f"[trident] sglang forkserver declines: {error}", file=sys.stderr, flush=True)
        _announce(socket_path, {"declined": str(error)})
        sys.exit(0)
    listener.bind(socket_path + ".bind")
    listener.listen(64)
    os.replace(socket_path + ".bind", socket_path)  # the path appears only once it is served
    _Forkserver(listener, imported, int(owner_pid)).serve()


def _announce(socket_path: str, message: dict[str, str]) -> None:
    """A forkserver that will not serve leaves its reason where the socket would be."""
    Path(socket_path + ".declined").write_text(json.dumps(message))


# ----------------------------------------------------------------------------- the client


class ForkedServerProcess:
    """A server forked by the forkserver, watched like ``subprocess.Popen``: ``pid``, ``poll``, ``wait``,
    ``returncode``. The exit status comes from the forkserver (its parent); if the forkserver is gone,
    the process is watched by a pidfd and its status is reported as -1."""

    def __init__(self, connection: socket.socket, pid: int, args: list[str]) -> None:
        self.pid, self.args, self.returncode = pid, args, None
        self._connection, self._buffer = connection, b""
        # An engine polls its servers from several threads (as Popen allows): one reads at a time, or
        # a second could find the connection closed under it and take that for the forkserver's end.
        self._reading = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # already reaped (it exited at once), or pidfds unsupported
            self._pidfd = None

    def poll(self) -> int | None:
        self._read(timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read(timeout=1.0 if left is None else min(left, 1.0))
        return self.returncode

    def _read(self, timeout: float) -> None:
        # A waiter holds the lock for at most its 1 s slice; a poll waits that long at worst.
        with self._reading:
            if self.returncode is None:
                self._read_once(timeout)

    def _read_once(self, timeout: float) -> None:
        import select

        watched = [self._connection] if self._connection is not None else []
        if not watched and self._pidfd is not None:
            watched = [self._pidfd]
        if not watched:
            self._finish(-1)
            return
        readable, _, _ = select.select(watched, [], [], timeout)
        if not readable:
            return
        if readable[0] is self._connection:
            chunk = self._connection.recv(4096)
            if not chunk:  # the forkserver went away: the pidfd tells when the server ends
                self._connection.close()
                self._connection = None
                return
            self._buffer += chunk
            if b"\n" in self._buffer:
                self._finish(int(json.loads(self._buffer.split(b"\n", 1)[0])["exit"]))
        else:
            self._finish(-1)

    def _finish(self, code: int) -> None:
        self.returncode = code
        if self._connection is not None:
            self._connection.close()
            self._connection = None
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._pidfd is not None:
                os.close(self._pidfd)


def fork_server(socket_path: str, args: Sequence[str], env: Mapping[str, str], log_path: Path) -> ForkedServerProcess:
    """Ask the forkserver at ``socket_path`` for a server ``python -m SERVER_MODULE args`` (args[0:3]
    are that prefix) with ``env``, in this working directory, logging to ``log_path``."""
    if list(args[1:3]) != ["-m", SERVER_MODULE]:
        raise ValueError(f"the forkserver starts {SERVER_MODULE} only, not {args[:3]}")
    request = {"python": args[0], "args": list(args[3:]), "env": dict(env), "cwd": os.getcwd(),
               "log_path": str(log_path)}
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(60)
        connection.connect(socket_path)
        connection.sendall(json.dumps(request).encode() + b"\n")
        answer = json.loads(_read_line(connection))
    except (OSError, ValueError) as error:
        connection.close()
        raise ForkserverUnavailable(f"the SGLang forkserver at {socket_path} did not answer: {error}") from None
    if "refused" in answer:
        connection.close()
        raise ForkserverUnavailable(answer["refused"])
    connection.settimeout(None)
    return ForkedServerProcess(connection, int(answer["pid"]), list(args))


def start_forkserver(socket_path: str | Path, env: Mapping[str, str], owner_pid: int | None = None,
                     log_path: Path | None = None) -> subprocess.Popen:
    """Start a forkserver that imports SGLang in ``env`` (a server's environment) and serves at
    ``socket_path`` once ready (``wait_for_forkserver``); it ends with process ``owner_pid`` (this
    one by default). It runs in a session of its own, with room in its command line and environment
    for those of the servers forked from it."""
    from engine.process_view import ROOM_BYTES, ROOM_ENV

    socket_path = str(socket_path)
    for stale in (socket_path, socket_path + ".bind", socket_path + ".declined"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
    command = [sys.executable, "-m", __name__, socket_path, str(owner_pid or os.getpid()), " " * TITLE_ROOM]
    environment = {**env, ROOM_ENV: " " * ROOM_BYTES}
    log = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(command, env=environment, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
    finally:
        if log_path is not None:
            log.close()


def forkserver_state(socket_path: str | Path, process: subprocess.Popen | None = None) -> str | None:
    """None while the forkserver at ``socket_path`` is still importing; "ready" once it serves;
    otherwise why it never will (it declined, or exited)."""
    socket_path = str(socket_path)
    if os.path.exists(socket_path):
        return "ready"
    declined = Path(socket_path + ".declined")
    if declined.exists():
        return json.loads(declined.read_text())["declined"]
    if process is not None and process.poll() is not None:
        return f"the SGLang forkserver exited with status {process.returncode} before serving"
    return None


def wait_for_forkserver(socket_path: str | Path, process: subprocess.Popen | None = None,
                        timeout_s: float = READY_TIMEOUT_S) -> str:
    """Wait up to ``timeout_s`` for the forkserver at ``socket_path`` to serve: "ready", or why not."""
    deadline = time.monotonic() + timeout_s
    while (state := forkserver_state(socket_path, process)) is None:
        if time.monotonic() > deadline:
            return f"the SGLang forkserver at {socket_path} was not ready after {timeout_s:.0f} s"
        time.sleep(0.1)
    return state


# ----------------------------------------------------------------------------- which process starts a server


class _OwnForkserver:
    """This process's forkserver, started once its first servers are up (``prepare_own_forkserver``)."""

    process: subprocess.Popen | None = None
    socket_path: str | None = None


def configured_forkserver() -> str | None:
    """The shared forkserver's socket path from ``FORKSERVER_ENV`` (None: none, or "off")."""
    setting = os.environ.get(FORKSERVER_ENV, "")
    return setting if setting not in ("", "off") else None


def prepare_own_forkserver(env: Mapping[str, str]) -> None:
    """Start this process's forkserver, importing SGLang in ``env`` (a server's environment, without
    its API key), for the servers it starts later: a server restarted after a crash comes back
    without importing SGLang again. Called once this process's first servers answer, so the import
    does not compete with their start; a no-op where ``FORKSERVER_ENV`` names one or is "off"."""
    from engine.lifecycle import watch_process_group

    if FORKSERVER_ENV in os.environ or _OwnForkserver.process is not None:
        return
    from engine.rollout.sglang_launch import API_KEY_ENV

    folder = Path(tempfile.mkdtemp(prefix="trident-sglang-forkserver-"))
    _OwnForkserver.socket_path = str(folder / "socket")
    environment = {name: value for name, value in env.items() if name != API_KEY_ENV}
    _OwnForkserver.process = start_forkserver(_OwnForkserver.socket_path, environment, log_path=folder / "log")
    watch_process_group(_OwnForkserver.process.pid)  # this process's reaper ends it if this process is killed
    atexit.register(_stop_own_forkserver)


def _stop_own_forkserver() -> None:
    if _OwnForkserver.process is not None and _OwnForkserver.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(_OwnForkserver.process.pid, signal.SIGKILL)
        _OwnForkserver.process.wait()


def _forkserver_now() -> tuple[str | None, str]:
    """The forkserver to ask for the next server, or why there is none."""
    shared = configured_forkserver()
    if shared is not None:
        # A test session's may still be importing: waiting beats importing SGLang once more.
        state = wait_for_forkserver(shared)
        return (shared, "") if state == "ready" else (None, state)
    if os.environ.get(FORKSERVER_ENV) == "off":
        return None, f"{FORKSERVER_ENV}=off"
    own = _OwnForkserver
    if own.process is None:
        return None, "this process's forkserver starts once its first servers answer"
    state = forkserver_state(own.socket_path, own.process)
    if state == "ready":
        return own.socket_path, ""
    return None, state or "this process's forkserver is still importing SGLang"


def start_server_process(args: Sequence[str], env: Mapping[str, str], log) -> "subprocess.Popen | ForkedServerProcess":
    """The server process for the command ``args`` with ``env``, writing to the open file ``log``:
    forked from a forkserver where one serves and accepts this environment, otherwise started as a
    plain process in a session of its own (the log says why it was not forked)."""
    socket_path, why_not = _forkserver_now()
    if socket_path is not None:
        try:
            return fork_server(socket_path, args, env, Path(log.name))
        except ForkserverUnavailable as error:
            why_not = str(error)
    if why_not:
        log.write(f"[trident forkserver] started as a plain process: {why_not}\n".encode())
        log.flush()
    return subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env),
                            start_new_session=True)


if __name__ == "__main__":
    main()
