"""FLOPs formula against independent hand computations, and MFU."""

import pytest
import torch

from engine.trainer.flops import (
    DecoderShape,
    forward_flops,
    model_flops_utilization,
    peak_flops_per_device,
    training_flops,
)


def test_matches_megatron_lm_formula_for_mha_with_4h_mlp():
    # Narayanan et al. 2021, eq. 3 without recomputation: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
    layers, hidden, vocab, seq, batch = 24, 2048, 50304, 2048, 8
    shape = DecoderShape(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=16,
                         num_query_groups=16, kv_channels=hidden // 16, vocab_size=vocab, gated_linear_unit=False)
    megatron = 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))
    assert training_flops(shape, [seq] * batch) == pytest.approx(megatron, rel=1e-12)


def test_gqa_swiglu_by_hand():
    # One layer, h=8, 2 heads of 4, 1 kv group, SwiGLU f=16, V=10; two sequences of 3 and 5 tokens.
    shape = DecoderShape(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                         num_query_groups=1, kv_channels=4, vocab_size=10)
    q, k, v, o = 8 * 8, 8 * 4, 8 * 4, 8 * 8
    mlp = 3 * 8 * 16
    n = q + k + v + o + mlp + 8 * 10
    assert shape.matmul_parameters() == n == 656
    # forward per sequence of s tokens: 2 N s + (QK^T and AV: 2 x 2 s^2 x 8 per layer)
    by_hand = sum(2 * n * s + 2 * 2 * s * s * 8 for s in (3, 5))
    assert forward_flops(shape, [3, 5]) == by_hand
    assert training_flops(shape, [3, 5]) == 3 * by_hand
    assert training_flops(shape, [3, 5], activation_recompute=True) == 4 * by_hand
    critic = DecoderShape(**{**shape.__dict__, "value_head": True})
    assert critic.matmul_parameters() == n - 8 * 10 + 8


def test_architecture_of_a_real_config():
    from transformers import LlamaConfig

    from engine.models.hf_config import architecture_from_hf

    # SmolLM2-135M: 30 layers, h=576, 9 heads / 3 kv groups of 64, f=1536, V=49152, tied.
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    shape = DecoderShape.from_architecture(architecture_from_hf(config))
    per_layer = 576 * 576 + 2 * 576 * 192 + 576 * 576 + 3 * 576 * 1536
    assert shape.matmul_parameters() == 30 * per_layer + 576 * 49152
    # Its 134.5M parameters = the matmul ones (the tied embedding counted once, as the LM head) + norms.
    assert shape.matmul_parameters() + 61 * 576 == 134_515_008


def test_moe_counts_the_experts_a_token_runs_through():
    from transformers import Qwen3MoeConfig

    from engine.models.hf_config import architecture_from_hf

    # Qwen3-30B-A3B: 48 layers, h=2048, 32 heads / 4 groups of 128, 128 experts of f=768, top-8, V=151936.
    config = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            moe_intermediate_size=768, intermediate_size=6144, tie_word_embeddings=False)
    shape = DecoderShape.from_architecture(architecture_from_hf(config))
    per_layer = 2048 * (32 + 8) * 128 + 32 * 128 * 2048 + 8 * 3 * 2048 * 768 + 2048 * 128
    assert shape.matmul_parameters() == 48 * per_layer + 2048 * 151936
    # Qwen's model card: 3.3B activated parameters (the matmul ones + the input embedding + norms).
    assert shape.matmul_parameters() + 2048 * 151936 == pytest.approx(3.3e9, rel=0.02)


def test_peak_table_and_mfu():
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_per_device("NVIDIA H200") == 989e12
    assert peak_flops_per_device("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_per_device("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_per_device("NVIDIA GeForce GTX 1080") is None
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3", dtype=torch.float32) is None
    if not torch.cuda.is_available():
        assert peak_flops_per_device() is None  # CPU: no made-up peak
    # 8 GPUs at 989 TFLOP/s for 2 s do 15.824 PFLOP at 100%; 4.7472 PFLOP is 30%.
    assert model_flops_utilization(4.7472e15, 2.0, 8, 989e12) == pytest.approx(0.30)
    assert model_flops_utilization(1e15, 2.0, 8, None) is None
