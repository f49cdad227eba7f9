"""launch.rehearse: every experiment in yaml/ runs, as written, at the scale of this machine."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers

from engine.config import load_config
from engine.models.hf_config import architecture_from_hf
import launch.rehearse
from launch import prepare_demo_tools_model, prepare_smollm2_example
from launch.plan import KNOWN_ARCHITECTURES
from launch.rehearse import _generation_tp, plan_rehearsal, tiny_model_config, write_tiny_model
from launch.rehearse import rehearse as plan_only
from tests import memory_events
from tests.distributed import REPO_ROOT
from tests.rollout_support import SGLANG_MARKS

EXPERIMENTS = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "yaml").glob("*.yaml"))


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


# Qwen3-30B-A3B's config.json: 128 experts, top-8 renormalised, every layer MoE.
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=40960,
)
MIXTRAL_8X7B = dict(
    model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1000000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=32768, sliding_window=None,
)


@pytest.mark.parametrize("fields, model_class, renormalize", [
    (QWEN3_30B_A3B, "Qwen3MoeForCausalLM", True),
    (dict(QWEN3_30B_A3B, norm_topk_prob=False, num_experts_per_tok=1, mlp_only_layers=[0]), "Qwen3MoeForCausalLM",
     False),
    (MIXTRAL_8X7B, "MixtralForCausalLM", True),
])
def test_tiny_model_keeps_the_experts(fields, model_class, renormalize, tmp_path):
    written = architecture_from_hf(SimpleNamespace(**fields))
    config = tiny_model_config(written, tensor_parallel=2, pipeline_stages=2, generation_tp=2, vocab_size=100,
                               max_positions=256)
    tiny = architecture_from_hf(write_tiny_model(config, tmp_path / "model"))
    assert tiny.model_type == written.model_type and tiny.moe is not None
    assert tiny.moe.num_experts == 4 and tiny.moe.topk == min(written.moe.topk, 2)
    assert tiny.moe.renormalize == written.moe.renormalize == renormalize
    # Every layer MoE as written, or a dense one kept; the experts split over the rehearsal's TP 2.
    assert (len(tiny.moe.layers) == tiny.num_layers) == (len(written.moe.layers) == written.num_layers)
    assert tiny.moe.ffn_hidden_size % 2 == 0 and tiny.hidden_size < 256
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert type(model).__name__ == model_class
    assert sum("experts" in name for name, _ in model.named_parameters()) > 0


@pytest.mark.parametrize("written_ep, written_etp, max_ranks, expected_ep", [
    (4, None, 4, 2),  # TP2 x DP4 x EP4 on 8 GPUs -> TP2 x DP2 x EP2
    (4, None, 2, 1),  # -> TP2 x DP1: no data-parallel ranks to split the experts over
    (1, None, 4, 1),  # EP1 stays, unchanged
    (4, 1, 2, 2),  # whole experts (expert TP 1): TP2 x DP1 still splits them over its 2 TP ranks
])
def test_expert_parallelism_shrinks_within_the_stage(written_ep, written_etp, max_ranks, expected_ep, tmp_path):
    experiment = str(REPO_ROOT / "yaml/qwen3-8b_grpo_gsm8k.yaml")  # TP2 on 8 GPUs, without a critic
    overrides = ["actor_rollout_ref.model.path=models/Qwen3-30B-A3B",
                 f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={written_ep}"]
    if written_etp is not None:
        overrides.append(f"actor_rollout_ref.actor.megatron.expert_tensor_parallel_size={written_etp}")
    config = load_config(experiment, overrides)
    model = write_tiny_model(tiny_model_config(architecture_from_hf(SimpleNamespace(**QWEN3_30B_A3B)),
                                               tensor_parallel=2, pipeline_stages=1, generation_tp=2,
                                               vocab_size=100, max_positions=256), tmp_path / "model")
    plan = plan_rehearsal(experiment, overrides, config, model, (["train.parquet"], ["test.parquet"]),
                          tmp_path / "run", steps=2, max_ranks=max_ranks)
    assert plan.world_size == max_ranks
    rehearsed = load_config(experiment, [*overrides, *plan.overrides()], world_size=plan.world_size)
    for megatron in (rehearsed.actor_rollout_ref.actor.megatron, rehearsed.critic.megatron):
        assert megatron.tensor_model_parallel_size == 2 and megatron.expert_model_parallel_size == expected_ep
        assert megatron.expert_tensor_parallel_size == written_etp
    changed = {change.key for change in plan.changes}
    assert ("actor_rollout_ref.actor.megatron.expert_model_parallel_size" in changed) == (written_ep != expected_ep)


def test_missing_data_without_a_stand_in_is_a_config_error(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "launch.rehearse", "yaml/qwen2.5-0.5b_gsm8k.yaml", "--out", str(tmp_path),
         "data.train_files=data/math/train.parquet", "data.val_files=null"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "data/math/train.parquet" in result.stderr and "stand-ins only for GSM8K" in result.stderr
    assert "Traceback" not in result.stderr


# Experiments whose (small) prompt files a preparation command writes, as their headers say.
EXAMPLE_DATA = {"yaml/smollm2-135m_chain_sum_cpu.yaml": prepare_smollm2_example.prepare_data,
                "yaml/demo_tools_cpu.yaml": prepare_demo_tools_model.prepare_demo_tools_model}
# Rehearsal configs already run and passed, by their text with the run's own names and paths removed.
_PASSED: dict[str, str] = {}


def rehearse(experiment: str, out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.rehearse", experiment, "--out", str(out_dir), *args],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500)


def rehearse_in_this_process(experiment: str, out_dir: Path, capsys) -> SimpleNamespace:
    """``python -m launch.rehearse experiment --out out_dir`` as its ``main``, in this process (which
    has imported what planning needs; the job itself is a torchrun of its own either way)."""
    try:
        launch.rehearse.main([experiment, "--out", str(out_dir)])
        returncode = 0
    except SystemExit as end:
        returncode = end.code
    output = capsys.readouterr()
    return SimpleNamespace(returncode=returncode, stdout=output.out, stderr=output.err)


def rehearsal_identity(out_dir: Path) -> str:
    """The rehearsal's config without what only names the run (experiment name, its folders), and
    its tiny model's config.json: two experiments of one layout on different model families (the
    Llama and the Qwen2.5 LoRA recipes) are different rehearsals."""
    text = (out_dir / "rehearsal.yaml").read_text().replace(str(out_dir), "<out>")
    config = "\n".join(line for line in text.splitlines() if not line.strip().startswith("experiment_name:"))
    return f"{config}\n{(out_dir / 'model' / 'config.json').read_text()}"


def marks(experiment: str) -> list:
    """SGLang's marks where it uses SGLang; experiments of one model share an xdist worker, in file
    order, so a rehearsal identical to one already passed (below) is found there."""
    config = load_config(REPO_ROOT / experiment)
    same_model = pytest.mark.xdist_group(f"rehearse:{config.actor_rollout_ref.model.path}")
    return [same_model, *(SGLANG_MARKS if config.actor_rollout_ref.rollout.name == "sglang" else [])]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("experiment", [pytest.param(name, marks=marks(name)) for name in EXPERIMENTS])
def test_every_experiment_rehearses(experiment, demo_model, tmp_path, monkeypatch, capsys, request):
    """Each file's rehearsal runs, unless an identical rehearsal already passed in this session: the
    8- and 16-node recipes of a model differ in sizes that the rehearsal caps (PP 8 vs 4, VPP 2 vs 5,
    DP 1 vs 4 all become 2, 2, 1), so their rehearsal configs are byte-identical but for the name.
    A job with a Ray reward pool joins this worker's Ray cluster (``shared_ray``), as a job on a
    cluster joins the one in ``RAY_ADDRESS``, instead of starting and stopping its own."""
    if experiment in EXAMPLE_DATA:  # prompts a user makes with one command before the run
        EXAMPLE_DATA[experiment]()
    # Planned in this process (the CLI's --dry-run, without a fresh interpreter's imports).
    monkeypatch.chdir(REPO_ROOT)
    plan_only(experiment, [], steps=2, max_ranks=4, out_dir=tmp_path, timeout_s=0, dry_run=True)
    identity = rehearsal_identity(tmp_path)
    if identity in _PASSED:
        print(f"{experiment}: the same rehearsal as {_PASSED[identity]}, which passed")
        return
    if load_config(REPO_ROOT / experiment).reward_model.num_workers > 0:
        for name, value in request.getfixturevalue("shared_ray").items():
            monkeypatch.setenv(name, value)
    result = rehearse_in_this_process(experiment, tmp_path, capsys)
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
    # The memory choreography on every rank, as the run recorded it (colocated engines).
    rehearsed = load_config(tmp_path / "rehearsal.yaml", world_size=report["world_size"])
    if rehearsed.actor_rollout_ref.rollout.mode == "colocated":
        memory_events.check_run(rehearsed, {rank: tmp_path / "run" / "logs" / f"rank_{rank:05d}.log"
                                            for rank in range(report["world_size"])}, steps=2)
    _PASSED[identity] = experiment


def test_dry_run_plans_and_starts_nothing(tmp_path):
    result = rehearse("yaml/llama3-70b_ppo_8node.yaml", tmp_path, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size: 8 -> 2" in result.stdout
    assert (tmp_path / "rehearsal.yaml").is_file() and (tmp_path / "model" / "config.json").is_file()
    assert not (tmp_path / "job.log").exists() and not (tmp_path / "run").exists()
