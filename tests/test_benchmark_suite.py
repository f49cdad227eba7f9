"""benchmarks.suite --matrix quick: Trident, the plain PyTorch loop and TRL on the tiny workload, in CI.

The suite's numbers are reported, not asserted (speed is measured by benchmarks, not unit tests).
What is asserted: every case ran as a real job and produced its JSON, the table and the plots; the
peers did the same work (tokens per step); ``use_rollout_log_probs`` changes nothing but the
recomputation it skips (the fp32 demo's engine log-probs are the trainer's to ~1e-6); and
``--compare`` flags a drop beyond the noise and only then.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import suite

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick(tmp_path_factory, demo_model, pytestconfig):
    out = tmp_path_factory.mktemp("suite")
    # One thread per job: pytest runs a second worker on the other core, where a second OpenMP
    # thread would spin against it (measured: steps 30x slower, 2.4x the CPU of the whole case).
    result = subprocess.run([sys.executable, "-m", "benchmarks.suite", "--matrix", "quick", "--out", str(out),
                             "--steps", "6", "--warmup", "2", "--cpu-threads", "1"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with pytestconfig.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print("\n" + result.stdout)  # the table and the Trident / plain-loop ratio, in the CI log
    return out, json.loads((out / "summary.json").read_text())


def _steps(out: Path, case: str) -> list[dict]:
    return json.loads((out / f"{case}.json").read_text())["steps"]


def test_quick_matrix_writes_json_table_and_plots(quick):
    out, summary = quick
    cases = summary["cases"]
    assert set(cases) == {case.name for case in suite.MATRICES["quick"]}
    for name, result in cases.items():
        if result["case"]["runner"] == "trl" and importlib.util.find_spec("trl") is None:
            assert result["status"] == "skipped" and "requirements/trl.txt" in result["reason"]
            continue
        assert result["status"] == "ok", (name, result.get("reason"))
        assert result["timed_steps"] == 4 and result["tokens_per_s"] > 0 and result["step_s"] > 0
        assert (out / f"{name}.json").exists()
    trident = cases["trident-tiny"]
    assert {"gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "update_weights"} <= set(trident["phases_s"])
    assert trident["peak_memory_gb"]["update_actor"] > 0.1
    assert trident["ratio_to_baseline"] > 0
    table = (out / "summary.md").read_text()
    assert all(f"| {name} |" in table for name in cases)
    for plot in ("phases.png", "scaling.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_peers_do_the_same_work(quick):
    _, summary = quick
    cases = summary["cases"]
    plain = cases["plain-tiny"]["tokens_per_step"]
    for name, result in cases.items():
        if result["status"] == "ok":  # same prompts, batch and response budget: tokens per step agree
            assert abs(result["tokens_per_step"] / plain - 1) < 0.15, (name, result["tokens_per_step"], plain)


def test_rollout_log_probs_as_old_log_probs_change_only_the_recompute(quick):
    out, _ = quick
    recomputed, reused = _steps(out, "trident-tiny")[0], _steps(out, "trident-tiny-rollout-logprobs")[0]
    assert "timing_s/old_log_prob" in recomputed and "timing_s/old_log_prob" not in reused
    assert "rollout/log_prob_abs_diff" not in reused  # nothing to compare against when nothing is recomputed
    assert recomputed["rollout/log_prob_abs_diff"] < 1e-5
    # The same seed samples the same batch; pi_old differs by ~1e-6 only, and so does the first update.
    assert reused["critic/score/mean"] == recomputed["critic/score/mean"]
    for key in ("actor/pg_loss", "actor/ppo_kl", "critic/vf_loss"):
        assert abs(reused[key] - recomputed[key]) < 1e-5, key
    assert abs(reused["actor/grad_norm"] / recomputed["actor/grad_norm"] - 1) < 1e-4


def test_compare_flags_only_drops_beyond_noise(quick):
    _, summary = quick
    new = copy.deepcopy(summary["cases"])
    text, regressions = suite.compare(new, new)
    assert regressions == [] and "regression" not in text
    for result in new.values():
        result["noise"] = 0.05
    old = copy.deepcopy(new)
    old["trident-tiny"]["tokens_per_s"] *= 1.2   # new is 17% slower: beyond 5% noise
    old["plain-tiny"]["tokens_per_s"] *= 1.03    # 3% slower: within it
    text, regressions = suite.compare(new, old)
    assert regressions == ["trident-tiny"] and "| plain-tiny |" in text


@pytest.mark.parametrize("case", list({c.name: c for m in suite.MATRICES.values() for c in m if c.runner == "trident"}.values()),
                         ids=lambda c: c.name)
def test_every_trident_case_is_a_valid_experiment(case, tmp_path, demo_model):
    """The gpu matrix cannot run here; its cases still load and pass validation (layout, batches,
    the model's shapes from its config.json) at their world size, so they are ready when a GPU is."""
    import transformers

    from engine.config import load_config
    from launch.plan import KNOWN_ARCHITECTURES

    model_dir = tmp_path / "model"
    if case.model == "demo":
        model_dir = demo_model.model_dir
        experiment = REPO_ROOT / "yaml" / "demo_cpu.yaml"
    else:
        fields = dict(KNOWN_ARCHITECTURES[case.model])
        transformers.AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(model_dir)
        experiment = REPO_ROOT / "yaml" / ("qwen2.5-0.5b_gsm8k.yaml" if case.model == "qwen2.5-0.5b" else "qwen2.5-7b_gsm8k.yaml")
    workload = suite.Workload(experiment, model_dir, tmp_path / "train.parquet", [f"data.val_files={tmp_path}/val.parquet"])
    command = suite.trident_command(case, workload, steps=8, run_dir=tmp_path / "run")
    overrides = command[command.index(str(experiment)) + 1:]
    cfg = load_config(experiment, overrides, world_size=case.ranks)
    assert cfg.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == case.tp
    assert cfg.actor_rollout_ref.rollout.name == case.rollout and cfg.data.train_batch_size == case.prompts
