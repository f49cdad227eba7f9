"""What the terminal shows: Trident's own lines from rank 0; everything else goes to the rank's log.

A rank's file descriptors 1 and 2 (Python, the C++ libraries, every child process it starts) are
pointed at ``logs/rank_<r>.log`` before megatron, SGLang or Ray are imported, so their warnings and
INFO dumps (DDP bucket lists, "Apex is not installed" ...) land there once per rank instead of on
the terminal. The original terminal stays reachable through ``say`` (rank 0: progress, run
summary) and ``say_error`` (any rank: the one message of a failure). Without ``capture_output``
(a test calling the trainer in-process) both simply print.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TextIO

RANK_LOG_FORMAT = "%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"

_terminal_out: TextIO | None = None  # rank 0's stdout before capture; None on other ranks
_terminal_err: TextIO | None = None
_captured = False
log_file: Path | None = None  # this rank's log, once captured


def capture_output(rank_log: Path, rank: int) -> None:
    """Send this process's stdout/stderr and Python logging (INFO and up) to ``rank_log``."""
    global _terminal_out, _terminal_err, _captured, log_file
    sys.stdout.flush()
    sys.stderr.flush()
    _terminal_err = os.fdopen(os.dup(2), "w", buffering=1)
    _terminal_out = os.fdopen(os.dup(1), "w", buffering=1) if rank == 0 else None
    rank_log.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(rank_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    # Line-buffered, so a rank's log is current when it dies.
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    logging.basicConfig(level=logging.INFO, format=RANK_LOG_FORMAT.format(rank=rank), stream=sys.stderr, force=True)
    logging.captureWarnings(True)
    _captured, log_file = True, rank_log


def say(message: str) -> None:
    """A line for the user, on rank 0's terminal (and in every rank's log)."""
    if _captured:
        print(message, flush=True)  # the log
        if _terminal_out is not None:
            print(message, file=_terminal_out, flush=True)
    elif int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


def say_error(message: str) -> None:
    """A failure's message, on this rank's terminal stderr (and in its log)."""
    if _captured:
        print(message, file=sys.stderr, flush=True)
    print(message, file=_terminal_err or sys.stderr, flush=True)
