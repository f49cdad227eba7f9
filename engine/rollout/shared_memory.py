"""CPU tensors handed to another process as shared-memory files (torch's ``file_system`` strategy).

The default ``file_descriptor`` strategy passes descriptors over the receiving process's
multiprocessing connection, which an SGLang scheduler does not have (its authentication handshake
fails), so CPU weight pushes use files. ``file_system`` needs torch's ``torch_shm_manager``, which
torch starts on the first tensor shared by file: libshm forks and execs it, replacing only its
stdout (torch/lib/libshm/core.cpp, ``start_manager``), so it inherits every other inheritable
descriptor, among them the rank's stderr, which is the job's output pipe, and the agent's
resource-tracker pipe (whose tracker holds that output too). The manager outlives its last client by
``SHUTDOWN_TIMEOUT`` = 2 s (torch/lib/libshm/manager.cpp), so whoever read the job's output (a
pipe, ``| tee``, a test's capture, the rehearsal) waited 2 s past the job's end on every CPU run that
pushed weights this way. Here the manager starts with stderr on /dev/null and no descriptor of ours.
"""
from __future__ import annotations

import os

import torch

_MANAGER_STARTED_IN: int | None = None  # the pid that started it (a forked child starts its own)


def use_file_system_sharing() -> None:
    """From now on this process shares CPU tensors as shared-memory files; torch's manager for them
    is running, detached from this process's output (see the module docstring)."""
    global _MANAGER_STARTED_IN
    torch.multiprocessing.set_sharing_strategy("file_system")
    if _MANAGER_STARTED_IN == os.getpid():
        return
    inherited = [fd for fd in _open_descriptors() if fd > 2 and _inheritable(fd)]
    saved_stderr, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        for fd in inherited:
            os.set_inheritable(fd, False)
        torch.empty(1).share_memory_()  # the first file-shared storage starts the manager (libshm)
    finally:
        os.dup2(saved_stderr, 2)
        for fd in inherited:
            os.set_inheritable(fd, True)
        os.close(saved_stderr)
        os.close(devnull)
    _MANAGER_STARTED_IN = os.getpid()


def _open_descriptors() -> list[int]:
    return [int(name) for name in os.listdir("/proc/self/fd")]


def _inheritable(fd: int) -> bool:
    try:
        return os.get_inheritable(fd)
    except OSError:  # the listing's own descriptor, closed since
        return False
