"""What ``ps`` and ``/proc`` show of a process forked from a preloaded one: its own command line and
environment, not those of the process it was forked from.

A process forked from a server that has imported everything (``launch.torchrun``'s ranks,
``engine.rollout.sglang_forkserver``'s SGLang servers) keeps the server's ``/proc/<pid>/cmdline``
and ``/proc/<pid>/environ``: the kernel reads them from the memory where the server's arguments and
environment were placed when it was executed (``arg_start``..``arg_end`` and
``env_start``..``env_end``, fields 48-51 of ``/proc/self/stat``). Changing ``sys.argv`` or
``os.environ`` changes neither. These functions overwrite that memory, cut to its length and padded
with NULs, which is what setproctitle does for the command line; a process that will need more room
than its own arguments or environment take is started with padding (``ROOM_ENV``).
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Mapping

PR_SET_NAME = 15  # prctl(2)
# An environment variable of blanks that a preloaded server is started with, so that the
# environments of the processes forked from it fit where its own was (the kernel caps one
# variable at 128 KiB).
ROOM_ENV = "TRIDENT_ENVIRONMENT_ROOM"
ROOM_BYTES = 64 * 1024


def _memory_fields() -> list[str]:
    # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'; field N
    # (1-based, proc(5)) is then at index N - 3.
    return Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()


def _overwrite(start: int, end: int, text: bytes) -> bool:
    """Write ``text`` (cut to fit, NUL-padded) over [start, end); whether all of it fitted."""
    room = end - start
    fitted = text[: room - 1]
    ctypes.memmove(start, fitted + b"\0" * (room - len(fitted)), room)
    return len(text) < room


def set_title(title: str) -> None:
    """``ps``/``top`` show ``title`` as this process's command line, and its first 15 bytes as its
    name (``comm``); Python keeps its own copy of argv. setproctitle does the same, but its search
    for that memory walks back from the environment, which a forked process may have moved."""
    fields = _memory_fields()
    text = title.encode()
    _overwrite(int(fields[45]), int(fields[46]), text)
    ctypes.CDLL(None).prctl(PR_SET_NAME, text[:15], 0, 0, 0)


def show_environment(environment: Mapping[str, str]) -> bool:
    """``/proc/<pid>/environ`` shows ``environment`` (what tools that find a job's processes by a
    variable read); whether all of it fitted in the room this process was started with."""
    fields = _memory_fields()
    text = b"".join(f"{name}={value}".encode() + b"\0" for name, value in environment.items() if name != ROOM_ENV)
    return _overwrite(int(fields[47]), int(fields[48]), text)
