"""Tracker sinks (real TensorBoard event files, JSONL, console), timers, ETA and the run directory."""

import io
import json
import math
import mmap
from dataclasses import dataclass

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from engine.trainer.loggers import ConsoleSink
from engine.trainer.run_dir import RunDirectory
from engine.trainer.tracking import Tracker, phase, step_peak_memory

STEP_METRICS = {
    "actor/pg_loss": -0.0123, "actor/ppo_kl": 1.5e-4, "actor/pg_clipfrac": 0.02, "actor/entropy": 1.9,
    "actor/grad_norm": 0.8, "critic/vf_loss": 0.31, "critic/vf_explained_var": 0.12, "critic/score/mean": 0.41,
    "response_length/mean": 123.0, "timing_s/gen": 4.0, "timing_s/step": 9.5, "perf/throughput": 1234.5,
    "perf/mfu/actor": None,  # unknown peak (CPU): skipped, not written as a number
}


def _scalars(tensorboard_dir):
    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tracker_writes_tensorboard_jsonl_and_console(tmp_path):
    run = RunDirectory.create(tmp_path / "run")
    console = io.StringIO()
    with Tracker(("console", "tensorboard", "jsonl"), run=run, total_steps=10, console_stream=console,
                 rank=0) as tracker:
        for step in (1, 2, 3):
            tracker.log({**STEP_METRICS, "actor/pg_loss": -0.01 * step, "critic/vf_loss": float("nan") if step == 3 else 0.3},
                        step=step)
    scalars = _scalars(run.tensorboard_dir)
    assert scalars["actor/pg_loss"] == [(1, pytest.approx(-0.01)), (2, pytest.approx(-0.02)), (3, pytest.approx(-0.03))]
    assert scalars["timing_s/gen"][0] == (1, 4.0)
    assert "perf/mfu/actor" not in scalars
    assert math.isnan(scalars["critic/vf_loss"][2][1])

    rows = _rows(run.metrics_file)
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[1]["actor/pg_loss"] == pytest.approx(-0.02)
    assert rows[0]["perf/throughput"] == 1234.5 and "perf/mfu/actor" not in rows[0]
    assert rows[2]["critic/vf_loss"] is None  # NaN has no JSON spelling

    lines = console.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 1/10 [00:00<00:00, ") and "step/s]" in lines[0]  # fast steps: a rate
    for shown in ("critic/score/mean 0.41", "actor/pg_loss -0.01", "actor/ppo_kl 0.00015", "response_length/mean 123",
                  "timing_s/step 9.5", "perf/throughput 1234"):
        assert shown in lines[0]
    assert "timing_s/gen" not in lines[0]  # the console line keeps to the key numbers


def test_only_rank_zero_writes(tmp_path):
    console = io.StringIO()
    run = RunDirectory.create(tmp_path / "run")
    tracker = Tracker(("console", "jsonl", "tensorboard"), run=run, console_stream=console, rank=1)
    tracker.log({"actor/pg_loss": 1.0}, step=1)
    tracker.close()
    assert console.getvalue() == "" and not run.metrics_file.exists() and not list(run.tensorboard_dir.iterdir())


def test_resumed_tracker_drops_steps_after_the_checkpoint(tmp_path):
    run = RunDirectory.create(tmp_path / "run")
    metrics_file, tensorboard_dir = run.metrics_file, run.tensorboard_dir
    with Tracker(("jsonl", "tensorboard"), run=run, rank=0) as tracker:
        for step in (1, 2, 3, 4):
            tracker.log({"actor/pg_loss": float(step)}, step=step)
    with open(metrics_file, "a") as handle:
        handle.write('{"step": 5, "actor/pg')  # a row cut off by the crash
    # The run crashed after step 4 but its last checkpoint is step 2: steps 3, 4 are redone.
    with Tracker(("jsonl", "tensorboard"), run=run, start_step=2, rank=0) as tracker:
        for step in (3, 4):
            tracker.log({"actor/pg_loss": 10.0 * step}, step=step)
    assert [(r["step"], r["actor/pg_loss"]) for r in _rows(metrics_file)] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert _scalars(tensorboard_dir)["actor/pg_loss"] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_tracker_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"trainer.logger has unknown entries \['neptune'\]"):
        Tracker(("console", "neptune"))
    with pytest.raises(ValueError, match=r"the loggers \['tensorboard'\] need the run directory"):
        Tracker(("tensorboard",))
    tracker = Tracker(("console",), console_stream=io.StringIO(), rank=0)
    with pytest.raises(ValueError, match="'actor/pg_loss' has a non-numeric value 'abc'"):
        tracker.log({"actor/pg_loss": "abc"}, step=1)


def test_phase_accumulates_time():
    ticks = iter([10.0, 11.5, 20.0, 20.25])
    metrics = {}
    import engine.trainer.tracking as tracking

    original = tracking.time.perf_counter
    tracking.time.perf_counter = lambda: next(ticks)
    try:
        with phase("gen", metrics):
            pass
        with phase("gen", metrics):
            pass
    finally:
        tracking.time.perf_counter = original
    assert metrics["timing_s/gen"] == 1.75


def test_phase_peak_memory_is_per_phase():
    """Each phase reports the peak of its own window (the process-wide peak is reset on entry)."""
    metrics = {}
    with phase("update_actor", metrics):  # the big one
        # A fresh anonymous mapping, so the pages are new to the process whatever the heap already holds
        # (a calloc may reuse resident heap memory late in a long test session); every page is written.
        block = mmap.mmap(-1, 300 * 1024**2)
        for offset in range(0, len(block), 4096):
            block[offset] = 1
        block.close()
    with phase("old_log_prob", metrics):  # the small one
        pass
    big, small = metrics["perf/max_rss_gb/update_actor"], metrics["perf/max_rss_gb/old_log_prob"]
    assert big - small > 0.25, metrics  # 300 MiB = 0.29 GiB
    assert step_peak_memory(metrics)["perf/max_rss_gb"] == big
    import torch

    assert ("perf/max_memory_allocated_gb/update_actor" in metrics) == torch.cuda.is_available()


def test_console_progress_eta_and_line():
    clock_values = iter([100.0, 160.0, 160.0])
    console = ConsoleSink(total_steps=10, start_step=4, clock=lambda: next(clock_values))
    # 2 steps (5, 6) in 60 s since this process started -> 30 s/step, 4 steps left: 2 minutes.
    assert console.progress(6) == "step 6/10 [01:00<02:00, 30.00s/step]"
    line = console.line({"actor/pg_loss": 0.123456, "x": 1.0, "val/accuracy": 0.5}, 7)
    assert line.endswith("| actor/pg_loss 0.1235 | val/accuracy 0.5") and "x 1" not in line
    assert ConsoleSink(None, 0, clock=lambda: 0.0).progress(3).startswith("step 3 [")


@dataclass
class _Trainer:
    project_name: str = "p"
    experiment_name: str = "e"


def test_run_directory_layout_config_and_rank_logs(tmp_path):
    run = RunDirectory.create(tmp_path / "runs" / "p" / "e")
    for folder in (run.logs_dir, run.tensorboard_dir, run.checkpoints_dir, run.rollout_dir):
        assert folder.is_dir()
    assert run.metrics_file == run.root / "metrics.jsonl"
    from omegaconf import OmegaConf

    config = OmegaConf.create({"trainer": {"project_name": "p", "default_local_dir": "runs/${trainer.project_name}"}})
    run.write_config(config)
    assert "default_local_dir: runs/p" in run.config_file.read_text()  # resolved
    run.write_config({"trainer": _Trainer().__dict__})
    assert [p.name for p in run.root.glob("config.*.yaml")]  # the previous, different config kept
    summary = run.summary()
    assert f"logs: {run.logs_dir}" in summary and f"checkpoints: {run.checkpoints_dir}" in summary

    assert run.rank_log_file(3).name == "rank_00003.log"
    assert RunDirectory.create(tmp_path / "t", timestamped=True).root.parent == (tmp_path / "t").absolute()
