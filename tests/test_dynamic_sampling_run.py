"""DAPO's dynamic sampling through ``launch.main`` on the demo (2 CPU ranks): every step trains on
exactly ``data.train_batch_size`` prompt groups whose responses differ, learns sooner than plain
GRPO, and a step that cannot fill its batch stops the run with a message.

Measured (GRPO, n=4, 16 prompts, lr 1e-4, 40 steps, validation every 5; ``python -m launch.torchrun
... algorithm.filter_groups.enable=...``), greedy validation accuracy per 5 steps:

    seed 1 plain     0.405 0.40  0.375 0.41  0.485 0.475 0.45  0.48  0.505
    seed 1 filtered  0.405 0.425 0.475 0.485 0.50  0.49  0.505 0.51  0.53   (114 rounds for 40 steps)
    seed 2 plain     0.405 0.41  0.45  0.48  0.465 0.49  0.51  0.53  0.51
    seed 2 filtered  0.405 0.475 0.47  0.495 0.455 0.505 0.515 0.525 0.515  (112 rounds)
    seed 3 plain     0.405 0.375 0.47  0.515 0.47  0.445 0.405 0.44  0.475
    seed 3 filtered  0.405 0.495 0.515 0.515 0.49  0.51  0.53  0.54  0.535  (116 rounds)

The filtered run reached the plain run's final accuracy after 30, 30 and 5 steps of 40 (the
same 64 trained responses per step), at the cost of ~2.8x the generation. The test runs 20 steps
(under a minute each run): by the table, the plain runs end at 0.485, 0.465 and 0.47, which the
filtered ones reached after 15, 5 and 5 steps.
"""
from __future__ import annotations

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.distributed import REPO_ROOT, read_metrics, run_main_job

pytestmark = [pytest.mark.dist, pytest.mark.slow]

DEMO = "yaml/demo_cpu.yaml"
GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "algorithm.use_kl_in_reward=false", "trainer.save_freq=-1",
        "trainer.export_hf_at_end=false", "trainer.seed=1"]


def test_dynamic_sampling_trains_full_batches_of_groups_with_a_spread_and_learns_sooner(demo_model, tmp_path):
    runs = {}
    for name, enable in (("plain", "false"), ("filtered", "true")):
        run_main_job(DEMO, [*GRPO, f"algorithm.filter_groups.enable={enable}", "trainer.total_training_steps=20",
                            "trainer.test_freq=5", f"trainer.default_local_dir={tmp_path / name}"])
        runs[name] = [row for row in read_metrics(tmp_path / name)]
    steps = {name: [row for row in rows if "timing_s/step" in row] for name, rows in runs.items()}
    filtered, plain = steps["filtered"], steps["plain"]
    assert len(filtered) == len(plain) == 20
    # Every filtered step trained on exactly 16 groups, each with a reward spread; plain GRPO wasted some.
    assert all(row["critic/groups/count"] == 16 and row["critic/groups_with_spread/fraction"] == 1.0 for row in filtered)
    assert all(row["critic/groups/count"] == 16 for row in plain)
    assert min(row["critic/groups_with_spread/fraction"] for row in plain) < 0.9
    rounds = [row["rollout/num_gen_batches"] for row in filtered]
    assert min(rounds) >= 1 and max(rounds) >= 2 and "rollout/num_gen_batches" not in plain[0]
    assert all(0 < row["rollout/filtered_groups/fraction"] < 1 for row in filtered if row["rollout/num_gen_batches"] > 1)
    # Learning: the filtered run reaches the plain run's final accuracy in fewer steps (trained samples).
    accuracy = {name: [(row["step"], row["val/accuracy"]) for row in rows if "val/accuracy" in row]
                for name, rows in runs.items()}
    target = accuracy["plain"][-1][1]
    reached = next(step for step, value in accuracy["filtered"] + [(10**9, 1.0)] if value >= target)
    assert reached < 20, (accuracy, target)


def test_dynamic_sampling_that_cannot_fill_the_batch_stops_with_the_message(demo_model, tmp_path):
    """No answer can be right (the expected answers are negative): every group's responses all
    score 0, so one round (max_num_gen_batches=1) cannot fill the batch."""
    table = pq.read_table(demo_model.train_file).slice(0, 64).to_pylist()
    for row in table:
        entry = row["extra_info"]["reasoning_gym_entry"]
        row["extra_info"]["reasoning_gym_entry"] = entry.replace(f'"answer": "{row["reward_model"]["ground_truth"]}"',
                                                                 '"answer": "-1"')
        row["reward_model"]["ground_truth"] = "-1"
    data = tmp_path / "impossible.parquet"
    pq.write_table(pa.Table.from_pylist(table), data)
    result = subprocess.run([sys.executable, "-m", "launch.cli", DEMO, *GRPO, f"data.train_files={data}",
                             "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
                             "trainer.val_before_train=false", "trainer.total_training_steps=2",
                             f"trainer.default_local_dir={tmp_path / 'run'}"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("[trident] error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors[0].startswith("[trident] error (ranks 0, 1): dynamic sampling found 0 of the 16 prompt groups it "
                                "needs (data.train_batch_size) in 1 round(s)"), errors[0]
    assert "algorithm.filter_groups.max_num_gen_batches (now 1" in errors[0]
