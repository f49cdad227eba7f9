"""What a user sees of a run: the terminal, every logger, Prometheus, profiler traces, the report.

One short demo job through the ``trident`` command with every sink on (console, TensorBoard,
JSONL, wandb offline, MLflow's local store, Prometheus, a torch profile of step 2 on both ranks);
Prometheus is scraped while the job runs. The tests then read each sink back with its own
library or file format and compare metric names with metrics.jsonl.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from parallel.state import find_free_port
from tests.distributed import REPO_ROOT

STEPS = 4
GPU_ONLY = {"perf/mfu/actor"}  # absent on CPU, where no peak FLOP/s is known


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return response.read().decode()
    except OSError:
        return None


@pytest.fixture(scope="module")
def job(demo_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("observed") / "run"
    port = find_free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith(("WANDB_", "MLFLOW_"))}
    process = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "yaml/demo_cpu.yaml", f"trainer.default_local_dir={run_dir}",
         f"trainer.total_training_steps={STEPS}", "trainer.test_freq=2", "trainer.save_freq=-1",
         "trainer.logger=[console,tensorboard,jsonl,wandb,mlflow]", f"trainer.prometheus_port={port}",
         "trainer.profile.steps=[2]", "trainer.profile.ranks=[0,1]"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    scraped = None  # the last page that showed a trained step
    while process.poll() is None:
        page = scrape(port)
        if page and "trident_step" in page and "trident_step 0.0" not in page:
            scraped = page
        time.sleep(0.2)
    stdout, stderr = process.communicate()
    assert process.returncode == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return SimpleNamespace(run_dir=run_dir, port=port, stdout=stdout, stderr=stderr, scraped=scraped, rows=rows,
                           names={key for row in rows for key in row if key != "step"})


def test_the_terminal_shows_progress_and_a_summary_and_nothing_else(job):
    lines = job.stdout.splitlines()
    assert job.stderr == ""
    # Megatron's and the libraries' output went to the rank logs, once per rank.
    for noise in ("Params for bucket", "Warning", "Apex", "megatron", "INFO", "cpp_extension", "wandb:"):
        assert noise not in job.stdout, noise
    logs = [(job.run_dir / "logs" / f"rank_0000{rank}.log").read_text() for rank in (0, 1)]
    assert "Params for bucket" in logs[0] and all("Apex is not installed" in log for log in logs)
    assert len(lines) == len(set(lines)), [line for line in lines if lines.count(line) > 1]
    assert lines[0].startswith("[trident] trident_demo/arith_ppo: run dir: ") and f"logs: {job.run_dir}/logs" in lines[0]
    # decided once, at start; the demo's rows are padded
    assert lines[1] == "[trident] device: cpu, gloo (no NVIDIA GPU on this machine); attention: torch SDPA, causal"
    progress = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in progress] == [f"{step}/{STEPS}" for step in range(STEPS + 1)]
    assert "<" in progress[2] and "s/step]" in progress[2] and "actor/pg_loss" in progress[2]
    assert "val/accuracy" in progress[2] and "val/accuracy" not in progress[1]  # validation when it comes
    done = next(line for line in lines if line.startswith(f"[trident] done after {STEPS} steps"))
    assert "in total" in done and "val/accuracy final" in done and "best" in done
    assert lines[-1] == f"[trident] run dir: {job.run_dir} | logs: {job.run_dir}/logs | tensorboard: " \
                        f"{job.run_dir}/tensorboard | metrics: {job.run_dir}/metrics.jsonl | checkpoints: " \
                        f"{job.run_dir}/checkpoints"
    assert f"wandb sync {job.run_dir}/wandb/offline-run-" in job.stdout


def test_every_logger_has_the_same_metric_names(job):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert {"actor/pg_loss", "critic/vf_loss", "timing_s/gen", "perf/max_rss_gb/gen", "val/accuracy"} <= job.names
    events = EventAccumulator(str(job.run_dir / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == job.names
    assert set(wandb_history(job.run_dir)) == job.names
    assert [float(v) for v in wandb_history(job.run_dir)["actor/pg_loss"]] == pytest.approx(
        [row["actor/pg_loss"] for row in job.rows if "actor/pg_loss" in row])

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{job.run_dir / 'mlflow.db'}")
    run = client.get_run((job.run_dir / "mlflow_run_id").read_text())
    assert set(run.data.metrics) == job.names
    assert run.data.params["trainer.experiment_name"] == "arith_ppo" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    logged = [row for row in job.rows if "critic/score/mean" in row]
    assert [m.step for m in history] == [row["step"] for row in logged]
    assert [m.value for m in history] == pytest.approx([row["critic/score/mean"] for row in logged])


def wandb_history(run_dir: Path) -> dict[str, list[str]]:
    """The history rows of the offline run's transaction log (LevelDB log framing: 32 KiB blocks of
    records with a 7-byte header; wandb's own 7-byte file header first)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb"))[0]).read_bytes()
    assert data.startswith(b":W&B")
    history: dict[str, list[str]] = {}
    position, pending, block = 7, b"", 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        history.setdefault(key, []).append(item.value_json)
    return history


def test_prometheus_served_the_step_metrics_during_the_run(job):
    assert job.scraped is not None, "the endpoint never showed a trained step"
    served = {line.split('name="')[1].split('"')[0] for line in job.scraped.splitlines()
              if line.startswith("trident_metric{")}
    assert {"actor/pg_loss", "timing_s/update_actor", "perf/max_rss_gb/update_actor"} <= served <= job.names
    targets = json.loads((job.run_dir / "prometheus" / "trainer.json").read_text())
    assert targets[0]["targets"][0].endswith(f":{job.port}")
    assert targets[0]["labels"] == {"job": "trident", "project": "trident_demo", "experiment": "arith_ppo"}


def test_a_profiled_step_leaves_a_trace_per_rank(job):
    for rank in (0, 1):
        trace = json.loads((job.run_dir / "profile" / f"step_2_rank_{rank}.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"trident/gen", "trident/update_actor", "trident/update_weights"} <= names
    assert sorted(p.name for p in (job.run_dir / "profile").iterdir()) == ["step_2_rank_0.json", "step_2_rank_1.json"]


def drawn_pixels(png: Path, colour: str) -> int:
    """Pixels of ``colour`` (a matplotlib colour) in the image: the lines drawn in it."""
    import matplotlib.colors
    import matplotlib.image
    import numpy as np

    image = matplotlib.image.imread(png)[..., :3]
    return int((np.abs(image - np.array(matplotlib.colors.to_rgb(colour))).max(axis=-1) < 0.02).sum())


def test_report_draws_the_run_and_compares_two(job, tmp_path):
    result = subprocess.run([sys.executable, "-m", "launch.report", str(job.run_dir)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = job.run_dir / "report"
    pngs = {p.stem for p in report.glob("*.png")}
    assert {"scores", "validation", "kl", "entropy", "response_length", "timing", "memory"} <= pngs
    for name in pngs:
        # Curves are drawn (the first may be hidden under an equal second one, e.g. accuracy = mean score).
        assert sum(drawn_pixels(report / f"{name}.png", f"C{i}") for i in range(10)) > 200, name
    page = (report / "index.html").read_text()
    assert all(f'src="{name}.png"' in page for name in pngs) and "val/accuracy" in page

    other = tmp_path / "other"
    other.mkdir()
    rows = [{**row, "critic/score/mean": 1.0} if "critic/score/mean" in row else row for row in job.rows]
    (other / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = subprocess.run([sys.executable, "-m", "launch.report", str(job.run_dir), str(other), "--out",
                             str(tmp_path / "compare")], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    compare = tmp_path / "compare" / "scores.png"
    # One metric, two runs: the same colour, twice the line (solid and dashed).
    assert drawn_pixels(compare, "C0") > 1.5 * drawn_pixels(report / "scores.png", "C0")
    assert "other" in (tmp_path / "compare" / "index.html").read_text()


def test_report_names_a_folder_without_metrics(tmp_path):
    result = subprocess.run([sys.executable, "-m", "launch.report", str(tmp_path)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "has no metrics.jsonl" in result.stderr and "Traceback" not in result.stderr


def test_dashboard_queries_metrics_the_trainer_serves(job):
    dashboard = json.loads((REPO_ROOT / "launch" / "grafana" / "trident_dashboard.json").read_text())
    import re

    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            match = re.search(r'name(=~?)"([^"]+)"', target["expr"])
            if match and match.group(2) in GPU_ONLY:
                continue
            if match:
                pattern = match.group(2) if match.group(1) == "=~" else re.escape(match.group(2))
                assert any(re.fullmatch(pattern, name) for name in job.names), (panel["title"], target["expr"])
            else:
                assert target["expr"].startswith(("trident_step", "sglang:")), target["expr"]


def test_a_logger_without_its_package_is_a_config_error_naming_the_extra(monkeypatch):
    import importlib.util

    from engine.config import ConfigError, load_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"trainer.logger includes 'wandb', but wandb is not installed; "
                                          r"pip install 'trident-ppo\[wandb\]'"):
        load_config(REPO_ROOT / "yaml/demo_cpu.yaml", ["trainer.logger=[console,wandb]"])
    load_config(REPO_ROOT / "yaml/demo_cpu.yaml", ["trainer.logger=[console,mlflow]"])


def test_profile_settings_are_checked(tmp_path):
    import torch

    from engine.config import ConfigError, load_config
    from engine.config.trainer import ProfileConfig
    from engine.trainer.profiling import StepProfiler

    with pytest.raises(ConfigError, match=r"trainer.profile.ranks=\[2\]: must be global ranks"):
        load_config(REPO_ROOT / "yaml/demo_cpu.yaml", ["trainer.profile.ranks=[2]"])
    with pytest.raises(ConfigError, match="trainer.profile.tool='perf' is not a valid choice"):
        load_config(REPO_ROOT / "yaml/demo_cpu.yaml", ["trainer.profile.tool=perf"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA GPUs; on this machine use trainer.profile.tool=torch"):
            StepProfiler(ProfileConfig(steps=[1], tool="nvtx"), 0, tmp_path)
    with StepProfiler(ProfileConfig(steps=[1], ranks=[1]), 0, tmp_path).step(1):
        pass
    assert not list(tmp_path.iterdir())  # rank 0 was not asked to profile


CAPTURED = """
import logging, os, sys, warnings
from pathlib import Path
from engine.trainer import console
console.capture_output(Path(sys.argv[1]), int(sys.argv[2]))
print("python print")
os.system("echo from a child process")
warnings.warn("a library warning")
logging.getLogger("megatron.core").info("an INFO dump")
console.say("progress line")
console.say_error("the one error")
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_captured_output_goes_to_the_rank_log(tmp_path, rank):
    log = tmp_path / "logs" / f"rank_{rank}.log"
    result = subprocess.run([sys.executable, "-c", CAPTURED, str(log), str(rank)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == ("progress line\n" if rank == 0 else "")
    assert result.stderr == "the one error\n"
    text = log.read_text()
    for line in ("python print", "from a child process", "a library warning", f"rank{rank} INFO megatron.core: an INFO dump",
                 "progress line", "the one error"):
        assert line in text, line
