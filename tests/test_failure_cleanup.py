"""A rank that dies leaves nothing behind, and the job says which rank died.

A 2-rank job through the ``trident`` command with everything a rank starts: SGLang servers (in
sessions of their own), a Ray reward pool, dist-checkpointing's writer Manager and resource
tracker (a checkpoint every step). Rank 1 is SIGKILLed mid-run, so it runs no exit code at all:
its reaper (``engine.lifecycle``) must clean up after it, and rank 0, stopped by torchrun, after
itself. Every process of the job carries a marker in its environment, so a leftover is found
wherever it was reparented.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from engine.rollout.sglang_server import SERVER_MODULE
from tests.distributed import REPO_ROOT, processes_left, processes_with
from tests.rollout_support import SGLANG_MARKS

pytestmark = [pytest.mark.dist, *SGLANG_MARKS]


def parent_pid(pid: int) -> int | None:
    try:  # "pid (comm) state ppid ...": comm may contain spaces, so split after the ')'
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def rank_processes(marker: str) -> dict[int, int]:
    """pid -> rank of the job's ranks: the processes ``launch.torchrun`` forked and titled
    ``rank R/W: ... launch.main ...`` (not the processes a rank forks, such as dist-checkpointing's
    results Manager on CPU, which inherit the title)."""
    processes = processes_with(marker)

    def rank_of(command: str) -> int | None:
        title = re.match(r"rank (\d+)/\d+: .*launch\.main", command)
        return int(title.group(1)) if title else None

    return {pid: rank_of(command) for pid, command in processes.items()
            if rank_of(command) is not None and rank_of(processes.get(parent_pid(pid), "")) is None}


def rank_pid(marker: str, rank: int) -> int | None:
    return next((pid for pid, number in rank_processes(marker).items() if number == rank), None)


def test_a_killed_rank_leaves_no_process_behind(demo_model, tmp_path):
    marker = f"TRIDENT_TEST_JOB={uuid.uuid4().hex}"
    run_dir = tmp_path / "run"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1], "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "yaml/demo_cpu.yaml", f"trainer.default_local_dir={run_dir}",
         "trainer.total_training_steps=50", "trainer.save_freq=1", "trainer.test_freq=-1",
         "trainer.val_before_train=false", "actor_rollout_ref.rollout.name=sglang",
         "actor_rollout_ref.rollout.gpu_memory_utilization=0.05", "reward_model.num_workers=1"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step_2").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-4000:]
            time.sleep(1)
        started = processes_with(marker)
        commands = " ".join(started.values())
        # What a rank starts is there: SGLang servers, Ray, the checkpoint writer, the reapers.
        assert SERVER_MODULE in commands and "ray" in commands, commands
        assert "engine.lifecycle" in commands, commands
        # dist-checkpointing's results Manager: spawned on GPUs, forked from its rank on CPU
        # (parallel/cpu_compat.py, item 9), so it runs the rank's command line under the rank.
        ranks = rank_processes(marker)
        managers = [pid for pid, command in started.items() if parent_pid(pid) in ranks and "launch.main" in command]
        assert len(ranks) == 2 and len(managers) == 2, (ranks, started)
        os.kill(rank_pid(marker, 1), signal.SIGKILL)
        output = job.communicate(timeout=300)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "[trident] rank 1 killed by signal 9" in output, output[-4000:]
    assert "Traceback" not in output.split("killed by signal 9")[-1]
    left = processes_left(marker)
    assert not left, left
