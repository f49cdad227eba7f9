"""Tiny random Llama, Qwen2 and Qwen3 checkpoints in Megatron at TP1, TP2, PP2, TP2xPP2, PP2xVPP2 and
TP2 with sequence parallelism (gloo); tiny Qwen3-MoE and Mixtral also with expert parallelism.

One 4-rank torchrun launch per test runs every layout of its families (tests/dist_workers/models_parity.py)
against transformers' own forward pass on the same checkpoint.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_torchrun

LAYOUTS = ["1,1,0", "2,1,0", "1,2,0", "2,2,0", "1,2,2", "2,1,0,1"]  # tp,pp,vpp[,sequence parallel]
CRITIC_LAYOUTS = ["2,2,0,1", "1,2,2"]


@torch.no_grad()
def away_from_init(model):
    """Weights unlike their initial values (norms != 1, biases != 0, larger matrices), so a mapping
    mistake that init values would hide shows."""
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.normal_(0, 0.5)
        elif param.dim() == 1:
            param.uniform_(0.5, 1.5)
        else:
            param.normal_(0, 0.2)
    return model


def save_tiny_checkpoints(root):
    """Llama: untied, GQA, llama3 rope scaling that acts at these lengths (original context 64).
    Qwen2: tied embeddings, QKV bias. Qwen3: per-head q/k RMSNorm, head_dim 32 != hidden / heads = 16.
    Vocab 100 is padded by Megatron at every TP size."""
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM)

    common = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    configs = {
        "llama": (LlamaForCausalLM, LlamaConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                                rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    }
    return save_checkpoints(root, configs)


def save_checkpoints(root, configs):
    """Each (model class, config) as a random model away from its init, saved to root / name."""
    torch.manual_seed(0)
    for name, (model_class, config) in configs.items():
        away_from_init(model_class(config)).save_pretrained(root / name)
    return [root / name for name in configs]


def run_parity(tmp_path, dirs, layouts, critic_layouts) -> dict:
    out = tmp_path / "results.json"
    run_torchrun("models_parity.py", 4, [
        "--hf-dirs", *map(str, dirs), "--layouts", *layouts, "--critic-layouts", *critic_layouts,
        "--work-dir", str(tmp_path), "--out", str(out),
    ])
    return json.loads(out.read_text())


# tp,pp,vpp[,sp,ep[,etp]] (etp: expert tensor-parallel size, default TP); the last two keep experts whole
# (expert TP 1) at TP2 + SP: EP2, and EP4 over the TP and data-parallel ranks.
MOE_LAYOUTS = ["1,1,0", "2,1,0", "1,2,0", "1,1,0,0,2", "2,1,0,0,2", "2,1,0,1,2", "1,2,0,0,2", "2,1,0,1,2,1",
               "2,1,0,1,4,1"]
MOE_CRITIC_LAYOUTS = ["2,1,0,1,2", "1,2,0,0,2"]


def save_tiny_moe_checkpoints(root):
    """Qwen3-MoE: 4 experts, top-2 without renormalisation (norm_topk_prob=False, its default), layer 1
    dense (mlp_only_layers). Mixtral: 4 experts, top-2 renormalised, untied, every layer MoE."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, num_experts_per_tok=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    configs = {
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(**common, head_dim=32, num_experts=4, moe_intermediate_size=48,
                                                          intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=False)),
        "mixtral": (MixtralForCausalLM, MixtralConfig(**common, num_local_experts=4, intermediate_size=48)),
    }
    return save_checkpoints(root, configs)


def check_results(results, families, layouts, critic_layouts):
    for family in families:
        for layout in layouts:
            measured = results[family][layout]
            assert measured["max_abs_logit_diff"] <= 1e-4, (family, layout, measured)
            assert measured["round_trip_bit_exact"], (family, layout)
        first, second = (results[family][f"critic {layout}"] for layout in critic_layouts)
        assert first["values_shape"] == [4, 12]
        assert first["max_abs_value_diff_vs_hf_hidden"] <= 1e-4
        assert first["max_abs_value_diff_vs_hf_token_classification"] <= 1e-4
        assert first["saved_files"] > 1  # the sharded save path with an index
        # Each pipeline stage's TP rank 0 wrote its own stage's files (no rank gathered the model).
        stages = int(critic_layouts[0].split(",")[1])
        assert len(first["writer_ranks"]) >= stages and (stages == 1 or 0 < max(first["writer_ranks"])), first
        assert second["max_abs_value_diff_vs_first_critic_layout"] <= 1e-4


@pytest.mark.dist
def test_hf_logits_round_trip_and_critic_at_every_layout(tmp_path):
    results = run_parity(tmp_path, save_tiny_checkpoints(tmp_path), LAYOUTS, CRITIC_LAYOUTS)
    check_results(results, ("llama", "qwen2", "qwen3"), LAYOUTS, CRITIC_LAYOUTS)


@pytest.mark.dist
def test_moe_hf_logits_round_trip_and_critic_with_expert_parallelism(tmp_path):
    """EP2 (experts 0-1 on one rank, 2-3 on the other), EP2 x TP2, EP2 with sequence parallelism, EP2 x PP2,
    whole experts at TP2 (expert TP 1) with EP2 and EP4."""
    results = run_parity(tmp_path, save_tiny_moe_checkpoints(tmp_path), MOE_LAYOUTS, MOE_CRITIC_LAYOUTS)
    check_results(results, ("qwen3_moe", "mixtral"), MOE_LAYOUTS, MOE_CRITIC_LAYOUTS)
    for family in ("qwen3_moe", "mixtral"):
        for layout in MOE_LAYOUTS:
            fields = layout.split(",")
            expert_parallel = int(fields[4]) if len(fields) > 4 else 1
            assert results[family][layout]["local_experts"] == 4 // expert_parallel, (family, layout)
