"""A hang explains itself and ends: rank 1 of the demo stops for good before its 'adv' phase
(``TRIDENT_TEST_STALL``), so rank 0 waits in a collective. Within ``trainer.hang_timeout_minutes``
every rank has written its stacks, rank 0's terminal names the phase and the rank that did not
arrive, the job has ended, and no process of it is left."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from engine.config import ConfigError, load_config
from engine.trainer.fault_injection import STALL_ENV
from engine.trainer.watchdog import HANG_EXIT_STATUS, timeout_minutes
from tests.distributed import REPO_ROOT, processes_left


def test_the_timeout_defaults_below_the_collective_timeout_and_must_stay_there():
    assert timeout_minutes(None, 60) == 48 and timeout_minutes(0, 60) == 0 and timeout_minutes(5, 60) == 5
    base = ["trainer.n_gpus_per_node=1", "trainer.collective_timeout_minutes=10"]
    assert load_config("yaml/demo_cpu.yaml", [*base, "trainer.hang_timeout_minutes=9.5"], world_size=1)
    with pytest.raises(ConfigError, match="hang_timeout_minutes=10 must be 0 .* below trainer.collective_timeout_minutes=10"):
        load_config("yaml/demo_cpu.yaml", [*base, "trainer.hang_timeout_minutes=10"], world_size=1)


RESUMED_AFTER_A_HANG = r"""
import sys, time
from pathlib import Path
from engine.trainer import watchdog
stacks = Path(sys.argv[1])
stacks.mkdir(parents=True)
(stacks / watchdog.REQUEST_FILE).write_text("rank 1: in 'gen' of step 4, for 99 s\n")
(stacks / "rank_00000.txt").write_text("rank 0: in 'gen' of step 4, for 99 s\n")
with watchdog.watching(1.0, stacks, rank=0, world_size=1):
    time.sleep(3 * watchdog.POLL_S)  # the thread has looked at the folder several times
print("RAN-ON")
"""


def test_a_run_resumed_after_a_hang_keeps_the_old_stacks_and_runs_on(tmp_path):
    stacks = tmp_path / "logs" / "stacks"
    result = subprocess.run([sys.executable, "-c", RESUMED_AFTER_A_HANG, str(stacks)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "RAN-ON" in result.stdout, (result.returncode, result.stderr[-3000:])
    earlier = [path for path in (tmp_path / "logs").iterdir() if path.name.startswith("stacks-")]
    assert len(earlier) == 1 and (earlier[0] / "rank_00000.txt").read_text().startswith("rank 0: in 'gen' of step 4")
    assert not (stacks / "REQUESTED").exists()


@pytest.mark.dist
def test_a_stalled_rank_is_named_with_every_ranks_stacks_and_the_job_ends(demo_model, tmp_path):
    marker = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", STALL_ENV: "1:adv", "TRIDENT_TEST_JOB": marker}
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "yaml/demo_cpu.yaml", f"trainer.default_local_dir={run_dir}",
         "trainer.total_training_steps=3", "trainer.val_before_train=false", "trainer.test_freq=-1",
         "trainer.save_freq=-1", "trainer.hang_timeout_minutes=0.2"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - started
    assert result.returncode == HANG_EXIT_STATUS, result.stderr[-4000:]
    hang = next(line for line in result.stderr.splitlines() if line.startswith("[trident] error: a hang:"))
    assert "> trainer.hang_timeout_minutes=0.2" in hang, hang
    assert "did not arrive: rank 1 is after 'reward' of step 1" in hang, hang
    assert f"every rank's stacks: {run_dir / 'logs' / 'stacks'}" in hang, hang
    stacks = {rank: (run_dir / "logs" / "stacks" / f"rank_{rank:05d}.txt").read_text() for rank in (0, 1)}
    # Each rank wrote its own: rank 1 from inside the stall, rank 0 from a later phase of step 1.
    assert stacks[1].startswith("rank 1: after 'reward' of step 1") and "stall_if_asked" in stacks[1]
    assert stacks[0].startswith("rank 0: in '") and "of step 1" in stacks[0].splitlines()[0]
    assert "stall_if_asked" not in stacks[0] and "ppo_iteration" in stacks[0]
    assert took < 180, took  # the timeout, not the 60-minute collective timeout, ended it
    left = processes_left(marker)
    assert not left, left
