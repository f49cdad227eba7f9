"""benchmarks/gpu_smoke.py runs its whole flow on CPU (--cpu), so the one-GPU check cannot rot."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed import REPO_ROOT

pytestmark = pytest.mark.slow


def test_gpu_smoke_flow_on_cpu(tmp_path):
    """The smoke's separate-process engine flow end to end on CPU: the engine started (and released)
    before the models, release / resume / push in its own process, PPO steps, a checkpoint and a
    resumed step, the log-prob check; only the JSON goes to --out."""
    out, work = tmp_path / "out", tmp_path / "work"
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_smoke", "--cpu", "--out", str(out), "--work", str(work)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    assert sorted(path.name for path in out.iterdir()) == ["gpu_smoke.json"]
    report = json.loads((out / "gpu_smoke.json").read_text())
    assert [row["step"] for row in report["steps"]] == [1, 2, 3]  # step 3 ran after the resume
    assert report["param_dtype"] == report["rollout_dtype"] == "bfloat16"
    assert report["rollout_engine"].startswith("torch-process")
    assert report["start_order"]["engine_weights_gb"] > 0 and report["start_order"]["engine_pool_gb"] > 0
    hand_off = report["memory_hand_off"]
    before, released, resumed = hand_off["engine_before"], hand_off["engine_released"], hand_off["engine_resumed"]
    assert released["weight_bytes"] == released["pool_bytes"] == 0 < before["weight_bytes"] == resumed["weight_bytes"]
    assert resumed["pool_bytes"] == before["pool_bytes"] > 0
    for row in report["steps"]:
        assert row["perf/mfu/actor"] is None  # no known peak on CPU: absent rather than wrong
        assert row["timing_s/update_actor"] > 0 and row["perf/max_rss_gb/update_actor"] > 0
    assert "resumed from" in result.stdout and "passed" in result.stdout
    # Issue 45's gates, CPU halves: the device decided as a job decides it and a one-rank torchrun job
    # on it (gloo, a CPU tensor, one all-reduce); memory around the save (after step 2's training,
    # timed apart from the step) and around the training state's trip off the device; the attention
    # path of a packed row.
    gate = report["environment"]
    assert gate["decided"] == "device: cpu, gloo (trainer.device=cpu)" and gate["torch_cuda"]
    assert gate["rank"] == {"backend": "gloo", "device": "cpu", "all_reduce": 2.0}
    assert report["save_memory"]["before_gb"] > 0 and report["steps"][1]["timing_s/save"] > 0
    assert "timing_s/save" not in report["steps"][0]
    assert set(report["restart_memory"]) == {"before_gb", "training_state_off_gb", "after_gb"}
    assert report["attention_packed_rows"] == "torch SDPA per packed sequence, causal (THD by cu_seqlens, no mask)"
    assert report["packed_attention"]["varlen_kernel"] is False and report["packed_attention"]["max_abs_diff"] < 1e-4
