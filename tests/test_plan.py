"""python -m launch.plan: every experiment in yaml/ validates and fits; undersized plans are refused."""
import json
from pathlib import Path

import pytest

from launch.memory_model import GIB
from launch.docs_tables import sync_cell
from launch.plan import CUDA_CONTEXT_GIB, main, make_plan

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = sorted(str(path.relative_to(REPO)) for path in (REPO / "yaml").glob("*.yaml"))
LARGE = ["yaml/llama3-70b_ppo_8node.yaml", "yaml/llama3-70b_ppo_16node.yaml",
         "yaml/qwen2.5-72b_ppo_8node.yaml", "yaml/qwen2.5-72b_ppo_16node.yaml"]
LORA = ["yaml/llama3-70b_lora_grpo_1node.yaml", "yaml/qwen2.5-72b_lora_grpo_1node.yaml"]
SCALE_TABLE = [*LARGE, "yaml/qwen3-8b_grpo_gsm8k.yaml", "yaml/qwen3-30b-a3b_grpo_gsm8k.yaml", *LORA]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_the_70b_experiments_exist():
    assert set(LARGE) <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_validates_and_fits(experiment, capsys, request):
    if experiment == "yaml/demo_cpu.yaml":
        request.getfixturevalue("demo_model")  # its model.path is the folder `make demo` builds
    status = main([experiment])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "update_actor" in out and "headroom" in out


@pytest.mark.parametrize("experiment", LARGE)
def test_70b_plans_fit_on_their_node_count_with_every_phase(experiment):
    report = make_plan(experiment)
    assert report.world_size == report.nodes * 8 and report.nodes in (8, 16)
    phases = {phase.phase for phase in report.memory.phases}
    assert phases == {"gen", "old_log_prob", "ref", "values", "update_critic", "update_actor", "save", "update_weights"}
    assert all(phase.fits for phase in report.memory.phases)
    # one generation wave: the KV cache holds every sequence a replica gets per step
    assert report.memory.max_concurrent_sequences >= report.memory.sequences_per_replica


@pytest.mark.parametrize("experiment", LORA)
def test_70b_lora_fits_one_node_where_full_fine_tuning_does_not(experiment):
    report = make_plan(experiment)
    assert report.world_size == 8 and report.memory.fits
    actor = report.models[0]
    # Only the adapters have gradients and Adam state; the reference is the actor (no model of its own).
    assert [model.role for model in report.models] == ["actor"]
    assert "ref" not in {phase.phase for phase in report.memory.phases}
    assert actor.grad_bytes(0) == actor.adapter_parameters(0) * 4
    assert 0 < actor.adapter_parameters(0) < 0.015 * actor.params_bytes(0) / 2
    full = make_plan(experiment, ["actor_rollout_ref.model.lora_rank=0"])
    assert not full.memory.fits and {p.phase: p for p in full.memory.phases}["update_actor"].over_by_bytes > 80 * 2**30


def test_lora_adapter_parameters_of_a_70b_layer():
    """r (in + out) per adapted layer, the TP-split side divided by t (tests/test_lora.py holds the
    same formula to the adapters engine.models.lora builds)."""
    from launch.memory_model import adapter_parameters

    architecture = make_plan("yaml/llama3-70b_lora_grpo_1node.yaml").models[0].architecture
    targets = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    # Llama-3-70B, r=32, TP8: qkv 32 (8192 + 10240/8), o 32 (8192/8 + 8192), fc1 32 (8192 + 57344/8), fc2 32 (28672/8 + 8192)
    assert adapter_parameters(architecture, 8, 32, targets) == 32 * (9472 + 9216 + 15360 + 11776)


def test_offload_keys_take_parts_out_of_the_phases_that_do_not_use_them():
    keys = [f"critic.megatron.{part}_offload=true" for part in ("param", "grad", "optimizer")]
    keys.append("actor_rollout_ref.ref.megatron.param_offload=true")
    plain = {p.phase: p for p in make_plan("yaml/llama3-70b_ppo_8node.yaml").memory.phases}
    offloaded = {p.phase: p for p in make_plan("yaml/llama3-70b_ppo_8node.yaml", keys).memory.phases}
    critic_state = sum(plain["gen"].items[f"critic/{part}"] for part in ("params", "grads", "optimizer"))
    saved = plain["gen"].total_bytes - offloaded["gen"].total_bytes
    assert saved == pytest.approx(critic_state + plain["gen"].items["reference/params"])
    assert "critic/optimizer" not in offloaded["update_actor"].items
    # The critic's own phase holds all of it; the reference is out of it.
    assert {k: v for k, v in plain["update_critic"].items.items() if k != "reference/params"} == \
        offloaded["update_critic"].items


def test_undersized_plan_is_refused_naming_the_phase(capsys):
    # the 16-node layout squeezed onto 8 nodes: the optimizer shards double
    status = main(["yaml/llama3-70b_ppo_16node.yaml", "--nodes", "8"])
    err = capsys.readouterr().err
    assert status == 1
    assert "phase 'gen'" in err and "over by" in err and "GiB" in err


def test_small_gpus_refuse_the_training_phases_too(capsys):
    status = main(["yaml/llama3-70b_ppo_8node.yaml", "--gpu-mem", "40"])
    err = capsys.readouterr().err
    assert status == 1
    assert "phase 'update_actor'" in err


def test_json_output_and_layout_errors(capsys):
    assert main(["yaml/llama3-70b_ppo_8node.yaml", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["world_size"] == 64
    assert plan["models"]["actor"]["pipeline_model_parallel_size"] == 8
    sync = plan["weight_sync"]
    # HybridFlow's bound (each GPU its TP8 engine shard) against what the loop moves into SGLang: each
    # GPU its shard (the sharded push; above the bound by the norms, whole on every rank), where whole
    # tensors on every GPU would be the model less the 1/64 it trains.
    assert sync["sharded_bound_bytes_per_gpu"] == pytest.approx((64 - 8) / (8 * 64) * sync["model_bytes"])
    assert sync["mode"] == "sharded" and set(sync["received_bytes_per_gpu_by_mode"]) == {"full", "sharded"}
    assert sync["received_bytes_per_gpu"] == pytest.approx(sync["sharded_bound_bytes_per_gpu"], rel=1e-2)
    assert sync["received_bytes_per_gpu_by_mode"]["full"] == pytest.approx((1 - 1 / 64) * sync["model_bytes"], rel=1e-3)
    # 4 nodes cannot hold TP8 x PP8: a config error naming the key, status 2
    assert main(["yaml/llama3-70b_ppo_8node.yaml", "--nodes", "4"]) == 2
    assert "actor_rollout_ref.actor.megatron" in capsys.readouterr().err


def test_unknown_architecture_is_a_clear_error(capsys):
    status = main(["yaml/llama3-70b_ppo_8node.yaml", "actor_rollout_ref.model.path=/models/Mystery-9B"])
    err = capsys.readouterr().err
    assert status == 2 and "actor_rollout_ref.model.path=/models/Mystery-9B" in err and "config.json" in err


def test_moe_models_are_planned_with_their_experts_split_over_expert_parallel_ranks(tmp_path, capsys):
    from transformers import Qwen3MoeConfig

    from engine.models.hf_config import architecture_from_hf
    from launch.memory_model import full_model_parameters, stage_parameters

    folder = tmp_path / "tiny-moe"
    Qwen3MoeConfig(num_hidden_layers=4, hidden_size=512, moe_intermediate_size=256, num_experts=16,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=64).save_pretrained(folder)
    overrides = [f"actor_rollout_ref.model.path={folder}", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"]
    assert main(["yaml/qwen2.5-7b_gsm8k.yaml", *overrides, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    architecture = architecture_from_hf(folder)
    assert plan["parameters"] == full_model_parameters(architecture)
    actor = plan["models"]["actor"]
    assert actor["expert_model_parallel_size"] == 2
    report = make_plan("yaml/qwen2.5-7b_gsm8k.yaml", overrides)
    layout = report.models[0].layout
    # the actor's parameters: each EP rank holds half the experts
    assert plan["phases"]["gen"]["items_bytes"]["actor/params"] == 2 * stage_parameters(architecture, layout, 0).total
    assert stage_parameters(architecture, layout, 0).experts * 2 * layout.tensor_model_parallel_size == \
        4 * 16 * 3 * 512 * 256


def test_disaggregated_rollout_plans_the_servers_gpus_apart_from_the_trainers(capsys):
    """Servers of their own: no engine memory on a training GPU in any phase (only the sender's two
    buckets in the sync), a 'server' column with the pool SGLang takes of a whole GPU, replicas and
    KV demand counted on the servers' GPUs with every batch in flight, and every server GPU receiving
    the whole model in a sync."""
    from launch.memory_model import sglang_static_pool_bytes

    colocated = make_plan("yaml/qwen2.5-7b_gsm8k.yaml")
    report = make_plan("yaml/qwen2.5-7b_gsm8k.yaml", ["actor_rollout_ref.rollout.mode=disaggregated",
                                                      "actor_rollout_ref.rollout.num_gpus=8", "trainer.max_staleness=2",
                                                      "actor_rollout_ref.rollout.check_weight_sync=false"])
    phases = {phase.phase: phase for phase in report.memory.phases}
    for name, phase in phases.items():
        engine = {key for key in phase.items if key.startswith("rollout/")}
        if name == "server":
            assert phase.items["rollout/weights+kv_cache"] == sglang_static_pool_bytes(
                report.gpu_memory_gib * GIB - CUDA_CONTEXT_GIB * GIB, report.rollout.gpu_memory_utilization)
            assert not any(key.startswith(("actor/", "critic/", "reference/")) for key in phase.items)
        elif name == "update_weights":
            assert engine == {"rollout/sync_buckets"}
        else:
            assert not engine, (name, engine)
    # The training phases are the colocated plan's less the engine and its CUDA context.
    update = {phase.phase: phase for phase in colocated.memory.phases}["update_actor"]
    assert phases["update_actor"].total_bytes == pytest.approx(update.total_bytes - CUDA_CONTEXT_GIB * GIB)
    rollout_tp = report.rollout.tensor_model_parallel_size
    assert report.rollout.replicas(report.world_size) == 8 // rollout_tp
    assert report.memory.sequences_per_replica == report.rollout.sequences_per_step * 2 // (8 // rollout_tp)
    assert report.loop_sync_received_bytes == int(report.memory.sync.model_bytes)
    assert main(["yaml/qwen2.5-7b_gsm8k.yaml", "actor_rollout_ref.rollout.mode=disaggregated",
                 "actor_rollout_ref.rollout.server_addresses=[h:1]", "actor_rollout_ref.rollout.num_gpus=0"]) == 2
    assert "servers on nodes of their own are not planned" in capsys.readouterr().err


def test_config_json_beats_the_table(tmp_path, capsys):
    folder = tmp_path / "Meta-Llama-3-70B-Instruct"
    folder.mkdir()
    hf = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
          "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(hf))
    report = make_plan("yaml/llama3-70b_ppo_8node.yaml", [f"actor_rollout_ref.model.path={folder}"])
    assert report.architecture_source.endswith("config.json") and report.parameters < 1e9


def test_markdown_snippet_is_in_the_docs():
    from launch.plan import markdown_text

    docs = (REPO / "docs" / "planner.md").read_text()
    for experiment in LARGE:
        assert markdown_text(make_plan(experiment)) in docs, f"regenerate docs/planner.md for {experiment}"


def test_scale_docs_print_the_current_estimates():
    page = (REPO / "docs" / "scale.md").read_text().splitlines()
    gib = 2 ** 30
    for experiment in SCALE_TABLE:
        report = make_plan(experiment)
        phases = {phase.phase: phase for phase in report.memory.phases}
        headroom = min(phase.capacity_bytes - phase.total_bytes for phase in report.memory.phases)
        expected = [f"{phases['gen'].total_bytes / gib:.1f}", f"{phases['update_actor'].total_bytes / gib:.1f}",
                    f"{headroom / gib:.1f}", sync_cell(report)]
        row = next(line for line in page if line.startswith(f"| `{experiment}` |"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[-4:] == expected, f"update docs/scale.md's row for {experiment}"


def test_weight_sync_bytes_per_gpu_by_mode():
    """The sharded push moves nothing between GPUs where training and generation TP agree and the
    vocab paddings do (Qwen3's 151936 rows at TP2, Llama 3's 128256 at TP8); LoRA's adapters-only
    sync moves the PEFT adapters (every fused part its own A), in the rollout dtype; where SGLang's
    layout does not match Megatron's slices (4 key/value heads at generation TP 8) there is no
    sharded mode and the loop pushes whole tensors."""
    qwen3 = make_plan("yaml/qwen3-8b_grpo_gsm8k.yaml")
    assert qwen3.loop_sync_mode == "sharded" and qwen3.sync_bytes_by_mode["sharded"] == 0 < qwen3.sync_bytes_by_mode["full"]
    lora = make_plan("yaml/llama3-70b_lora_grpo_1node.yaml")
    assert lora.sync_bytes_by_mode["sharded"] == 0
    adapters = make_plan("yaml/llama3-70b_lora_grpo_1node.yaml", ["actor_rollout_ref.rollout.lora_sync=adapters"])
    assert adapters.loop_sync_mode == "adapters"
    # Llama-3-70B, r=32 on every linear layer of 80: q (8192 + 8192), k and v (8192 + 1024), o (8192 + 8192),
    # gate and up (8192 + 28672), down (28672 + 8192); bf16.
    per_layer = 32 * (16384 + 2 * 9216 + 16384 + 3 * 36864)
    assert adapters.loop_sync_received_bytes == 80 * per_layer * 2
    moe = make_plan("yaml/qwen3-30b-a3b_grpo_gsm8k.yaml")
    assert moe.loop_sync_mode == "full" and "sharded" not in moe.sync_bytes_by_mode
