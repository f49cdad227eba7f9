"""launch.memory_model against formulas written differently and published numbers (docs/planner.md)."""
import dataclasses
from types import SimpleNamespace

import pytest

from engine.models.hf_config import architecture_from_hf
from launch.memory_model import (
    LayerShape,
    ModelMemoryConfig,
    RolloutMemoryConfig,
    estimate_memory,
    full_model_parameters,
    hybrid_engine_sync,
    kv_cache_bytes_per_token,
    layer_activation_bytes,
    pipeline_layers_in_flight,
)
from launch.plan import KNOWN_ARCHITECTURES
from parallel.layout import ParallelLayout


def known(name):
    return architecture_from_hf(SimpleNamespace(**KNOWN_ARCHITECTURES[name]))


# GPT-3 175B as in Korthikanti et al. 2022, Table 3: a=96, h=12288, s=2048.
GPT3 = LayerShape(hidden_size=12288, num_attention_heads=96, num_query_groups=96, kv_channels=128,
                  ffn_hidden_size=4 * 12288, gated_linear_unit=False, dropout=True, flash_attention=False)


@pytest.mark.parametrize("t, sp, recompute, closed_form", [
    # Korthikanti et al. eq. (1)-(5): activation bytes per layer
    (1, False, None, lambda s, b, h, a, t: s * b * h * (34 + 5 * a * s / h)),
    (8, False, None, lambda s, b, h, a, t: s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
    (8, True, None, lambda s, b, h, a, t: s * b * h / t * (34 + 5 * a * s / h)),
    (8, True, "selective", lambda s, b, h, a, t: s * b * h / t * 34),
    (1, False, "full", lambda s, b, h, a, t: 2 * s * b * h),
])
def test_layer_activations_reproduce_korthikanti_closed_forms(t, sp, recompute, closed_form):
    s, b = 2048, 1
    ours = layer_activation_bytes(GPT3, s * b, s, t, sp, recompute)
    assert ours == pytest.approx(closed_form(s, b, GPT3.hidden_size, GPT3.num_attention_heads, t), rel=1e-12)


def test_llama_layer_with_flash_attention_counts_swiglu_and_gqa():
    # Term by term for Llama-3-70B (h=8192, kv width 1024, f=28672), no dropout, flash attention:
    # norms 2*2h + block inputs 2*2h | Q,O 2*2h + K,V 2*2*1024 + lse 4*64 | fc1 2*2f + fc2 in 2f
    shape = LayerShape.from_architecture(known("meta-llama-3-70b"))
    h, f = 8192, 28672
    per_token = 8 * h + (4 * h + 4 * 1024 + 4 * 64 + 6 * f) / 8
    assert layer_activation_bytes(shape, 1, 4096, 8, False) == pytest.approx(per_token)
    assert layer_activation_bytes(shape, 1, 4096, 8, True) == pytest.approx((8 * h + 4 * h + 4 * 1024 + 4 * 64 + 6 * f) / 8)


def test_pipeline_in_flight_matches_korthikanti_and_megatron_warmup():
    L = 80
    # 1F1B: stage 0 holds p micro-batches of L/p layers = L
    assert pipeline_layers_in_flight(L, ParallelLayout(1, 4), 16, 0) == L
    assert pipeline_layers_in_flight(L, ParallelLayout(1, 4), 16, 3) == L / 4
    assert pipeline_layers_in_flight(L, ParallelLayout(1, 4), 2, 0) == L / 2  # fewer micro-batches than stages
    # interleaved: L (1 + (p-1)/(p v)) on stage 0 (Korthikanti sec. 4.2.3)
    for p, v in [(4, 5), (8, 2), (2, 4)]:
        assert pipeline_layers_in_flight(L, ParallelLayout(1, p, v), 64, 0) == pytest.approx(L * (1 + (p - 1) / (p * v)))


@pytest.mark.parametrize("name, published", [
    # parameter counts of the released checkpoints (model cards / safetensors index totals)
    ("meta-llama-3-70b", 70_553_706_496),
    ("meta-llama-3-8b", 8_030_261_248),
    ("qwen2.5-72b", 72_706_203_648),
    ("qwen2.5-7b", 7_615_616_512),
    ("qwen2.5-0.5b", 494_032_768),
    ("qwen3-8b", 8_190_735_360),  # safetensors index total_size 16_381_470_720 bytes in bf16
    ("qwen3-30b-a3b", 30_532_122_624),  # model card: 30.5 B; total_size 61_064_245_248 bytes in bf16
    ("mixtral-8x7b-instruct-v0.1", 46_702_792_704),  # safetensors total
])
def test_parameter_counts_match_published_checkpoints(name, published):
    assert full_model_parameters(known(name)) == published


def test_sixteen_bytes_per_parameter_rule_for_mixed_precision_adam():
    # ZeRO (Rajbhandari et al. 2020, sec. 3.1): 2 (fp16 params) + 2 (grads) + 12 (fp32 copy, m, v)
    architecture = known("meta-llama-3-8b")
    model = ModelMemoryConfig(role="actor", architecture=architecture, layout=ParallelLayout(), data_parallel_size=1,
                              trainable=True, params_dtype_bytes=2, grad_dtype_bytes=2, use_distributed_optimizer=False)
    state = model.params_bytes(0) + model.grad_bytes(0) + model.optimizer_bytes(0)
    assert state == 16 * full_model_parameters(architecture)
    # ZeRO stage 1 over N_d ranks: 4 + 12/N_d bytes per parameter
    sharded = ModelMemoryConfig(role="actor", architecture=architecture, layout=ParallelLayout(), data_parallel_size=64,
                                trainable=True, params_dtype_bytes=2, grad_dtype_bytes=2)
    total = sharded.params_bytes(0) + sharded.grad_bytes(0) + sharded.optimizer_bytes(0)
    assert total == pytest.approx((4 + 12 / 64) * full_model_parameters(architecture))


def test_moe_experts_split_over_expert_parallel_ranks_and_their_optimizer_over_expert_data_parallel():
    from launch.memory_model import expert_parameters, full_expert_parameters, stage_parameters

    qwen3_moe = known("qwen3-30b-a3b")
    # 48 layers x 128 experts x SwiGLU (3 h f_e), h = 2048, f_e = 768; the rest is attention, norms,
    # routers (128 x h per layer) and the embeddings.
    assert full_expert_parameters(qwen3_moe) == 48 * 128 * 3 * 2048 * 768
    # TP2 x EP4 (+ DP4 of 8 GPUs): each GPU trains 128 / 4 experts per layer, split over its 2 TP ranks.
    layout = ParallelLayout(2, 1, expert_model_parallel_size=4, sequence_parallel=True)
    stage = stage_parameters(qwen3_moe, layout, 0)
    assert stage.experts == 48 * expert_parameters(qwen3_moe, 2, 4) == full_expert_parameters(qwen3_moe) // 8
    # TP halves the embeddings and attention (q 4096, k and v 512, o 4096 wide), not the norms (q/k norms of
    # 128, 2 layer norms of h, the final norm) nor the routers (128 x h).
    h, vocab = 2048, 151936
    attention = h * (4096 + 2 * 512) + 4096 * h
    assert stage.dense == 2 * vocab * h // 2 + h + 48 * (attention // 2 + 2 * 128 + 2 * h + 128 * h)
    # Adam (12 bytes with the fp32 copy) sharded over the dense DP ranks (4) and, for the experts, over
    # the expert-data-parallel ranks: 8 / (TP2 x EP4) = 1.
    model = ModelMemoryConfig(role="actor", architecture=qwen3_moe, layout=layout, data_parallel_size=4, trainable=True)
    assert model.optimizer_bytes(0) == pytest.approx(12 * (stage.dense / 4 + stage.experts / 1))
    # The same 8 GPUs at EP1: every GPU holds all experts at TP2; the dense DP ranks shard their state.
    ep1 = ModelMemoryConfig(role="actor", architecture=qwen3_moe, layout=ParallelLayout(2, 1, sequence_parallel=True),
                            data_parallel_size=4, trainable=True)
    assert stage_parameters(qwen3_moe, ep1.layout, 0).experts == 4 * stage.experts
    assert ep1.optimizer_bytes(0) == pytest.approx(12 * stage_parameters(qwen3_moe, ep1.layout, 0).total / 4)


def test_moe_layer_activations_count_routed_copies():
    # Qwen3-30B-A3B's MoE layer at TP1: the attention and norm terms of its dense twin, and instead of the
    # MLP, per token: router logits (2 B) + fp32 probabilities for 128 experts, and for each of the k = 8
    # routed copies the expert input and output (2 h) and SwiGLU activations (3 f_e), 2 bytes each.
    shape = LayerShape.from_architecture(known("qwen3-30b-a3b"))
    dense = LayerShape(hidden_size=2048, num_attention_heads=32, num_query_groups=4, kv_channels=128, ffn_hidden_size=0)
    mlp_free = layer_activation_bytes(dense, 1, 4096)
    assert layer_activation_bytes(shape, 1, 4096) == pytest.approx(mlp_free + 128 * 6 + 8 * 2 * (2 * 2048 + 3 * 768))
    # Full recompute keeps the layer input only, MoE or not.
    assert layer_activation_bytes(shape, 1, 4096, recompute_granularity="full") == 2 * 2048
    # TP4 + SP: a GPU routes the k copies of its quarter of the tokens; the dispatcher gathers the rows
    # of the t_e expert-TP ranks, whose SwiGLU is split t_e ways. t_e = 4 (the default): k rows of
    # 3 f_e / 4; t_e = 1: k / 4 rows of the whole 3 f_e.
    tp4 = layer_activation_bytes(dense, 1, 4096, 4, True) + 128 * 6 / 4
    assert layer_activation_bytes(shape, 1, 4096, 4, True) == pytest.approx(tp4 + 8 * 2 * (2 * 2048 + 3 * 768 / 4))
    assert layer_activation_bytes(shape, 1, 4096, 4, True, expert_tensor_parallel_size=1) == pytest.approx(
        tp4 + 8 / 4 * 2 * (2 * 2048 + 3 * 768))


def test_kv_cache_bytes_formula():
    llama70 = known("meta-llama-3-70b")
    # 2 * layers * kv_heads * head_dim * bytes: 320 KiB per token for Llama-3-70B in bf16
    assert kv_cache_bytes_per_token(llama70) == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert kv_cache_bytes_per_token(llama70, 8) == 320 * 1024 // 8
    assert kv_cache_bytes_per_token(llama70, 16) == 320 * 1024 // 8  # KV heads replicated past 8 ranks


def test_hybrid_engine_sync_of_experts_counts_what_the_expert_phase_completes():
    qwen3_moe = known("qwen3-30b-a3b")
    rollout = RolloutMemoryConfig(tensor_model_parallel_size=2, gpu_memory_utilization=0.5,
                                  sequences_per_step=8, sequence_length=16)
    sync = hybrid_engine_sync(qwen3_moe, ParallelLayout(2, 1, expert_model_parallel_size=4), 8, rollout)
    experts = 2 * 48 * 128 * 3 * 2048 * 768
    # Dense weights: TP2 -> TP2 moves nothing; experts: a GPU trains 1/4 of its TP half, the engine needs all.
    assert sync.received_bytes == pytest.approx(experts / 2 - experts / 8)
    # An engine at TP1 needs every expert whole: a GPU holds 1/8 of them (1/4 of its TP half), or with
    # whole experts (expert TP 1, EP4 over 2 TP x 2 DP ranks) 1/4 of them.
    rollout = dataclasses.replace(rollout, tensor_model_parallel_size=1)
    for expert_tp, held in ((None, experts / 8), (1, experts / 4)):
        layout = ParallelLayout(2, 1, expert_model_parallel_size=4, expert_tensor_parallel_size=expert_tp)
        received = hybrid_engine_sync(qwen3_moe, layout, 4, rollout).received_bytes
        # the dense weights' part: without EP a GPU holds its TP half of the experts
        dense = hybrid_engine_sync(qwen3_moe, ParallelLayout(2, 1), 4, rollout).received_bytes - experts / 2
        assert received == pytest.approx(dense + experts - held), expert_tp


@pytest.mark.parametrize("t, p, tg, fraction", [
    (8, 1, 8, 0.0),          # same layout: nothing moves
    (8, 2, 8, 1 / 16),       # (tp - tg) / (tg t p) = 8/128
    (8, 4, 4, 28 / 128),
    (4, 4, 2, 14 / 32),
    (2, 4, 8, 3 / 32),       # t_g > t: each GPU holds the engine slices of its stage's layers, 1/32
])
def test_hybrid_engine_sync_bytes_follow_hybridflow(t, p, tg, fraction):
    architecture = known("meta-llama-3-70b")
    world = t * p * 2
    rollout = RolloutMemoryConfig(tensor_model_parallel_size=tg, gpu_memory_utilization=0.5,
                                  sequences_per_step=8, sequence_length=16)
    sync = hybrid_engine_sync(architecture, ParallelLayout(t, p), world, rollout)
    assert sync.model_bytes == 2 * full_model_parameters(architecture)
    assert sync.received_bytes == pytest.approx(fraction * sync.model_bytes)
    assert sync.gather_all_bytes == pytest.approx((world - 1) / world * sync.model_bytes)
    assert sync.engine_shard_bytes == pytest.approx(sync.model_bytes / tg)


def test_offloaded_parts_leave_the_gpu_outside_their_phase():
    from launch.memory_model import OffloadPolicy

    architecture = known("qwen2.5-7b")
    common = dict(architecture=architecture, layout=ParallelLayout(4), data_parallel_size=2, trainable=True,
                  train_tokens_per_microbatch=4096, forward_tokens_per_microbatch=4096, sequence_length=1024)
    rollout = RolloutMemoryConfig(tensor_model_parallel_size=2, gpu_memory_utilization=0.4,
                                  sequences_per_step=64, sequence_length=1024)
    resident = estimate_memory([ModelMemoryConfig(role="actor", **common)], rollout, 8, 80 * 2**30, 0)
    offloaded = estimate_memory(
        [ModelMemoryConfig(role="actor", offload=OffloadPolicy(grad_offload=True, optimizer_offload=True), **common)],
        rollout, 8, 80 * 2**30, 0)
    by_phase = {phase.phase: phase for phase in offloaded.phases}
    assert "actor/optimizer" not in by_phase["gen"].items and "actor/grads" not in by_phase["gen"].items
    assert "actor/optimizer" in by_phase["update_actor"].items
    assert by_phase["update_actor"].total_bytes == {p.phase: p for p in resident.phases}["update_actor"].total_bytes


@pytest.mark.parametrize("free_gib, weights_gib, fraction", [(78.6, 16.4, 0.38), (139.3, 7.1, 0.6), (40.0, 20.0, 0.55)])
def test_the_engines_pool_is_sglangs_own_rule(free_gib, weights_gib, fraction):
    """SGLang 0.5.23 sizes its KV cache in ``srt/mem_cache/kv_cache_configurator.py``,
    ``_profile_available_bytes`` (the two lines computing ``rest_memory``, L3007 and L3038):
    ``rest_memory = available - pre_model_load_memory * (1 - mem_fraction_static)``, ``available`` being
    the memory free after the weights are loaded and ``pre_model_load_memory`` the memory free before
    (``srt/distributed/bootstrap.py``, ``measure_pre_model_load_memory``, L193-223). Written here as
    SGLang writes it; the planner's pool is the weights plus that KV cache."""
    from engine.rollout.base import sglang_static_pool_bytes

    pre_model_load_memory = free_gib
    available = pre_model_load_memory - weights_gib
    rest_memory = available - pre_model_load_memory * (1 - fraction)
    assert sglang_static_pool_bytes(free_gib * 2**30, fraction) == pytest.approx((weights_gib + rest_memory) * 2**30)


def test_the_engine_starts_on_the_gpu_less_two_cuda_contexts():
    """Started before any training model, the engine finds the GPU less the trainer's and its own CUDA
    context free; its pool, CUDA graphs and the contexts are what the rollout phase adds."""
    architecture = known("qwen2.5-7b")
    common = dict(architecture=architecture, layout=ParallelLayout(4), data_parallel_size=2, trainable=True,
                  train_tokens_per_microbatch=4096, forward_tokens_per_microbatch=4096, sequence_length=1024)
    rollout = RolloutMemoryConfig(tensor_model_parallel_size=2, gpu_memory_utilization=0.4,
                                  sequences_per_step=64, sequence_length=1024)
    gpu, context, graphs = 81559 * 2**20, 2**29, 2**30
    plan = estimate_memory([ModelMemoryConfig(role="actor", **common)], rollout, 8, gpu, 0, context_bytes=context,
                           cuda_graph_bytes=graphs)
    phases = {phase.phase: phase.items for phase in plan.phases}
    assert phases["gen"]["rollout/weights+kv_cache"] == pytest.approx(0.4 * (gpu - 2 * context))
    assert phases["gen"]["rollout/cuda_graphs"] == graphs and "rollout/cuda_graphs" not in phases["update_actor"]
    assert all(items["cuda_contexts"] == 2 * context for items in phases.values())
