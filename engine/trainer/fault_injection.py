"""Faults the failure tests inject into a real run, each named by an environment variable that no
production launch sets: they make a rank fail the way ranks fail in the field, at a chosen point.

- ``TRIDENT_TEST_STALL=<rank>:<phase>``: that rank stops for good before entering that phase (a
  rank stuck in a collective; see ``engine.trainer.watchdog``).
- ``TRIDENT_TEST_KILL=<rank>:<step>``: that rank SIGKILLs itself as step ``<step>`` begins, in the
  job's first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0, set by torchrun and the Ray launcher),
  so a restarted job runs through (a lost rank under ``--max-restarts``).
"""
from __future__ import annotations

import logging
import os
import signal
import time

logger = logging.getLogger(__name__)

STALL_ENV = "TRIDENT_TEST_STALL"
KILL_ENV = "TRIDENT_TEST_KILL"
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"  # torchrun's name; the Ray launcher sets it too


def _asked(variable: str, rank: int, point: str) -> bool:
    asked_rank, _, asked_point = os.environ.get(variable, "").partition(":")
    return asked_rank == str(rank) and asked_point == point


def stall_if_asked(rank: int, phase: str) -> None:
    if _asked(STALL_ENV, rank, phase):
        logger.warning("%s=%s: rank %d stops before '%s'", STALL_ENV, os.environ[STALL_ENV], rank, phase)
        while True:
            time.sleep(60)


def kill_if_asked(rank: int, step: int) -> None:
    if _asked(KILL_ENV, rank, str(step)) and int(os.environ.get(RESTART_COUNT_ENV, "0")) == 0:
        logger.warning("%s=%s: rank %d kills itself as step %d begins", KILL_ENV, os.environ[KILL_ENV], rank, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
