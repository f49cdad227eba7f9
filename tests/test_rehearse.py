"""launch.rehearse: every experiment in yaml/ runs, as written, at the scale of this machine."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers

from engine.models.hf_config import architecture_from_hf
from launch.plan import KNOWN_ARCHITECTURES
from launch.rehearse import _generation_tp, tiny_model_config, write_tiny_model
from launch.rehearse import rehearse as plan_only
from tests.distributed import REPO_ROOT
from tests.rollout_support import SGLANG_MARKS

EXPERIMENTS = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "yaml").glob("*.yaml"))


def uses_sglang(experiment: str) -> bool:
    from engine.config import load_config

    return load_config(REPO_ROOT / experiment).actor_rollout_ref.rollout.name == "sglang"


@pytest.mark.parametrize("written_tg, written_tp, tp, pp, expected", [
    (8, 8, 2, 2, 2),   # tg = T stays tg = T'
    (2, 4, 2, 1, 1),   # tg = T / 2 stays T' / 2
    (1, 1, 1, 1, 1),
    (4, 2, 2, 2, 4),   # tg = 2 T (across two pipeline stages) stays 2 T'
    (8, 2, 2, 2, 4),   # tg = 4 T: only two stages are left to span
])
def test_generation_tp_keeps_its_relation_to_training_tp(written_tg, written_tp, tp, pp, expected):
    assert _generation_tp(written_tg, written_tp, tp, pp) == expected


@pytest.mark.parametrize("name", ["meta-llama-3-70b-instruct", "llama-3.1-70b", "qwen2.5-72b", "qwen2.5-0.5b"])
def test_tiny_model_keeps_the_family(name, tmp_path):
    written = architecture_from_hf(SimpleNamespace(**KNOWN_ARCHITECTURES[name]))
    fields = tiny_model_config(written, tensor_parallel=2, pipeline_stages=4, generation_tp=2, vocab_size=100,
                               max_positions=256)
    tiny = architecture_from_hf(write_tiny_model(fields, tmp_path / "model"))
    assert tiny.model_type == written.model_type and tiny.add_qkv_bias == written.add_qkv_bias
    assert tiny.tie_word_embeddings == written.tie_word_embeddings
    assert tiny.heads_per_query_group == written.heads_per_query_group
    assert (tiny.rope_scaling and tiny.rope_scaling.rope_type) == (written.rope_scaling and written.rope_scaling.rope_type)
    assert tiny.rotary_base == written.rotary_base and tiny.num_layers == 4
    assert tiny.num_query_groups % 2 == 0 and tiny.hidden_size < 256
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "model").chat_template


def test_missing_data_without_a_stand_in_is_a_config_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "launch.rehearse", "yaml/qwen2.5-0.5b_gsm8k.yaml", "--out", str(tmp_path),
         "data.train_files=data/math/train.parquet", "data.val_files=null"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "data/math/train.parquet" in result.stderr and "stand-ins only for GSM8K" in result.stderr
    assert "Traceback" not in result.stderr


# Rehearsal configs already run and passed, by their text with the run's own names and paths removed.
_PASSED: dict[str, str] = {}


def rehearse(experiment: str, out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.rehearse", experiment, "--out", str(out_dir), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500)


def rehearsal_identity(out_dir: Path) -> str:
    """The rehearsal's config without what only names the run (experiment name, its folders)."""
    text = (out_dir / "rehearsal.yaml").read_text().replace(str(out_dir), "<out>")
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith("experiment_name:"))


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("experiment", [
    pytest.param(name, marks=SGLANG_MARKS if uses_sglang(name) else []) for name in EXPERIMENTS])
def test_every_experiment_rehearses(experiment, demo_model, tmp_path, monkeypatch):
    """Each file's rehearsal runs, unless an identical rehearsal already passed in this session: the
    8- and 16-node recipes of a model differ in sizes that the rehearsal caps (PP 8 vs 4, VPP 2 vs 5,
    DP 1 vs 4 all become 2, 2, 1), so their rehearsal configs are byte-identical but for the name."""
    # Planned in this process (the CLI's --dry-run, without a fresh interpreter's imports).
    monkeypatch.chdir(REPO_ROOT)
    plan_only(experiment, [], steps=2, max_ranks=4, out_dir=tmp_path, timeout_s=0, dry_run=True)
    identity = rehearsal_identity(tmp_path)
    if identity in _PASSED:
        print(f"{experiment}: the same rehearsal as {_PASSED[identity]}, which passed")
        return
    result = rehearse(experiment, tmp_path)
    log = tmp_path / "job.log"
    assert result.returncode == 0, (f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}\n"
                                    f"{log.read_text()[-6000:] if log.exists() else ''}")
    report = json.loads((tmp_path / "rehearsal.json").read_text())
    # Only what this machine cannot hold changed; the precision and the rollout engine stayed.
    changed = {change["key"] for change in report["changes"]}
    assert not changed & {"actor_rollout_ref.actor.megatron.param_dtype", "actor_rollout_ref.rollout.dtype",
                          "actor_rollout_ref.rollout.name", "algorithm.adv_estimator"}
    assert report["world_size"] <= 4 and report["result"]["timing_s/step"] > 0
    assert "passed: 2 steps" in result.stdout
    _PASSED[identity] = experiment


def test_dry_run_plans_and_starts_nothing(tmp_path):
    result = rehearse("yaml/llama3-70b_ppo_8node.yaml", tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size: 8 -> 2" in result.stdout
    assert (tmp_path / "rehearsal.yaml").is_file() and (tmp_path / "model" / "config.json").is_file()
    assert not (tmp_path / "job.log").exists() and not (tmp_path / "run").exists()
