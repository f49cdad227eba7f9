"""launch.memory_model against formulas written differently and published numbers (docs/planner.md)."""
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


def test_kv_cache_bytes_formula():
    llama70 = known("meta-llama-3-70b")
    # 2 * layers * kv_heads * head_dim * bytes: 320 KiB per token for Llama-3-70B in bf16
    assert kv_cache_bytes_per_token(llama70) == 2 * 80 * 8 * 128 * 2 == 320 * 1024
    assert kv_cache_bytes_per_token(llama70, 8) == 320 * 1024 // 8
    assert kv_cache_bytes_per_token(llama70, 16) == 320 * 1024 // 8  # KV heads replicated past 8 ranks


@pytest.mark.parametrize("t, p, tg, fraction", [
    (8, 1, 8, 0.0),          # same layout: nothing moves
    (8, 2, 8, 1 / 16),       # (tp - tg) / (tg t p) = 8/128
    (8, 4, 4, 28 / 128),
    (4, 4, 2, 14 / 32),
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
    assert "actor/optimizer" not in by_phase["rollout"].items and "actor/grads" not in by_phase["rollout"].items
    assert "actor/optimizer" in by_phase["update_actor"].items
    assert by_phase["update_actor"].total_bytes == {p.phase: p for p in resident.phases}["update_actor"].total_bytes
