"""The HF <-> Megatron mapping and the HF config reading, in-process (no megatron model needed)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.models.checkpoint import CheckpointError, SafetensorsCheckpoint
from engine.models.hf_config import UnsupportedModelError, architecture_from_hf, rope_inverse_frequencies
from engine.models.weight_mapping import (
    FusedKind,
    Padding,
    global_megatron_name,
    hf_from_shards,
    megatron_shard_shape,
    reader_from_state_dict,
    shard_from_hf,
    weight_mappings,
)


def small_config(**overrides):
    values = dict(vocab_size=100, hidden_size=48, intermediate_size=36, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=3, head_dim=8)
    values.update(overrides)
    return Qwen2Config(**values)


def random_hf_state_dict(architecture, entries):
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator)
            for entry in entries for name, shape in zip(entry.hf_names, entry.hf_shapes)}


def reference_qkv_shard(q, k, v, num_groups, heads_per_group, head_dim, tp_rank, tp_size):
    """Megatron's fused QKV rows built head by head: per group [its q heads, its k, its v]."""
    padded_groups = -(-num_groups // tp_size) * tp_size
    rows = []
    for group in range(padded_groups):
        real = group < num_groups
        for head in range(heads_per_group):
            index = group * heads_per_group + head
            rows.append(q[index * head_dim:(index + 1) * head_dim] if real else torch.zeros_like(q[:head_dim]))
        for tensor in (k, v):
            rows.append(tensor[group * head_dim:(group + 1) * head_dim] if real else torch.zeros_like(k[:head_dim]))
    full = torch.cat(rows)
    return full.chunk(tp_size)[tp_rank]


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
def test_shards_match_reference_layout_and_round_trip(tp_size):
    architecture = architecture_from_hf(small_config())  # 3 query groups: padded at TP 2 and 4
    entries = weight_mappings(architecture)
    hf = random_hf_state_dict(architecture, entries)
    read = reader_from_state_dict(hf)
    hd, hpg = architecture.kv_channels, architecture.heads_per_query_group
    for entry in entries:
        shards = [shard_from_hf(entry, architecture, read, rank, tp_size) for rank in range(tp_size)]
        for rank, shard in enumerate(shards):
            assert tuple(shard.shape) == megatron_shard_shape(entry, architecture, tp_size), entry.megatron_name
            if entry.fused is FusedKind.QKV:
                q, k, v = (hf[name] for name in entry.hf_names)
                expected = reference_qkv_shard(q, k, v, architecture.num_query_groups, hpg, hd, rank, tp_size)
                assert torch.equal(shard, expected), entry.megatron_name
            elif entry.fused is FusedKind.GATE_UP:
                gate, up = (hf[name].chunk(tp_size)[rank] for name in entry.hf_names)
                assert torch.equal(shard, torch.cat([gate, up])), entry.megatron_name
            elif entry.padding is Padding.VOCAB:
                padded = torch.zeros(architecture.padded_vocab_size(tp_size), architecture.hidden_size)
                padded[: architecture.vocab_size] = hf[entry.hf_names[0]]
                assert torch.equal(shard, padded.chunk(tp_size)[rank])
        if entry.exported:
            back = hf_from_shards(entry, architecture, shards if entry.tensor_parallel_dim is not None else shards[:1])
            assert back.keys() == set(entry.hf_names)
            for name in entry.hf_names:
                assert torch.equal(back[name], hf[name]), name


def test_padded_query_groups_cover_exactly_the_real_heads():
    architecture = architecture_from_hf(small_config())
    assert architecture.padded_num_query_groups(2) == 4 and architecture.padded_num_query_groups(3) == 3
    proj = next(e for e in weight_mappings(architecture) if e.megatron_name.endswith("linear_proj.weight"))
    ones = {proj.hf_names[0]: torch.ones(proj.hf_shapes[0])}
    shards = [shard_from_hf(proj, architecture, reader_from_state_dict(ones), r, 4) for r in range(4)]
    # 4 groups x 2 heads x 8 dims = 64 columns, 48 of them real; the last rank holds one zero group.
    assert [int(s.sum().item()) for s in shards] == [16 * 48, 16 * 48, 16 * 48, 0]


def test_padded_vocab_size_is_aligned_to_tp():
    architecture = architecture_from_hf(small_config(vocab_size=49152))
    assert architecture.padded_vocab_size(1) == 49152
    assert architecture.padded_vocab_size(3) == 49152  # 128 * 384
    assert architecture_from_hf(small_config(vocab_size=49153)).padded_vocab_size(3) == 49152 + 384
    assert architecture_from_hf(small_config()).padded_vocab_size(2) == 128  # lcm(128, 2), not 128 x 2


def test_padded_vocab_does_not_depend_on_tp_so_checkpoints_load_across_tp():
    # Qwen2.5's 151,936 rows: Megatron-LM's 128 x TP rule would give 152,064 at TP2 and 152,576 at TP8.
    architecture = architecture_from_hf(small_config(vocab_size=151_936))
    assert {architecture.padded_vocab_size(tp) for tp in (1, 2, 4, 8)} == {151_936}
    assert architecture_from_hf(small_config(vocab_size=49_153)).padded_vocab_size(8) == 49_280


def test_mapping_names_tied_untied_critic_and_te():
    tied = weight_mappings(architecture_from_hf(small_config(tie_word_embeddings=True)))
    output = [e for e in tied if e.megatron_name == "output_layer.weight"][0]
    assert output.hf_names == ("model.embed_tokens.weight",) and not output.exported
    untied = weight_mappings(architecture_from_hf(small_config(tie_word_embeddings=False)))
    assert [e.hf_names for e in untied if e.megatron_name == "output_layer.weight"] == [("lm_head.weight",)]
    critic = weight_mappings(architecture_from_hf(small_config()), value_head=True)
    assert {e.hf_names[0] for e in critic if e.optional} == {"score.weight", "score.bias"}
    te = {e.megatron_name for e in weight_mappings(architecture_from_hf(small_config()), transformer_engine=True)}
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in te
    assert not any("q_layernorm" in e.megatron_name for e in untied)  # Qwen2 has no q/k norms
    assert global_megatron_name("decoder.layers.0.mlp.linear_fc1.weight", 3) == "decoder.layers.3.mlp.linear_fc1.weight"
    assert global_megatron_name("embedding.word_embeddings.weight", 3) == "embedding.word_embeddings.weight"


def test_qwen3_head_dim_is_decoupled_and_q_k_norms_are_mapped():
    """Qwen3: head_dim 16 with hidden 48 / 6 heads (= 8), per-head q/k RMSNorm, no bias anywhere."""
    config = Qwen3Config(vocab_size=100, hidden_size=48, intermediate_size=36, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    architecture = architecture_from_hf(config)
    assert (architecture.kv_channels, architecture.qk_layernorm, architecture.add_qkv_bias) == (16, True, False)
    entries = {e.megatron_name: e for e in weight_mappings(architecture)}
    for part in ("q", "k"):
        norm = entries[f"decoder.layers.1.self_attention.{part}_layernorm.weight"]
        assert norm.hf_names == (f"model.layers.1.self_attn.{part}_norm.weight",)
        assert norm.hf_shapes == ((16,),) and norm.tensor_parallel_dim is None
    assert entries["decoder.layers.0.self_attention.linear_proj.weight"].hf_shapes == ((48, 6 * 16),)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in entries
    # The same names with the TE spec: megatron keeps q/k norms as their own modules there.
    te = {e.megatron_name for e in weight_mappings(architecture, transformer_engine=True)}
    assert "decoder.layers.1.self_attention.k_layernorm.weight" in te


def test_moe_configs_are_read_as_transformers_routes():
    """Qwen3-MoE: MoE on every decoder_sparse_step-th layer not in mlp_only_layers, renormalised top-k
    only with norm_topk_prob; Mixtral: every layer, always renormalised; megatron's router keys follow."""
    from engine.models.hf_config import transformer_config_from_hf
    from parallel.layout import ParallelLayout

    qwen = architecture_from_hf(Qwen3MoeConfig(num_hidden_layers=6, num_experts=8, num_experts_per_tok=2,
                                               decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=False))
    assert qwen.moe.layers == (1, 5) and not qwen.moe.renormalize and qwen.qk_layernorm
    config = transformer_config_from_hf(qwen, ParallelLayout(expert_model_parallel_size=2))
    assert config.moe_layer_freq == [0, 1, 0, 0, 0, 1] and config.moe_router_pre_softmax
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 768)
    mixtral = architecture_from_hf(MixtralConfig(num_hidden_layers=2, intermediate_size=64))
    assert mixtral.moe.layers == (0, 1) and mixtral.moe.renormalize and mixtral.moe.ffn_hidden_size == 64
    names = {e.megatron_name: e for e in weight_mappings(mixtral)}
    fc1 = names["decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight"]
    assert fc1.expert and fc1.hf_names == ("model.layers.1.block_sparse_moe.experts.7.w1.weight",
                                           "model.layers.1.block_sparse_moe.experts.7.w3.weight")
    assert names["decoder.layers.0.mlp.router.weight"].hf_names == ("model.layers.0.block_sparse_moe.gate.weight",)
    te = {e.megatron_name for e in weight_mappings(mixtral, transformer_engine=True)}
    assert {"decoder.layers.0.mlp.experts.linear_fc2.weight7", "decoder.layers.0.pre_mlp_layernorm.weight"} <= te
    # An expert-parallel rank's local expert 1 with experts 4.. is global expert 5, in both specs.
    assert global_megatron_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", 2, 4) == \
        "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1.weight"
    assert global_megatron_name("decoder.layers.0.mlp.experts.linear_fc2.weight1", 0, 4) == \
        "decoder.layers.0.mlp.experts.linear_fc2.weight5"


def test_expert_parallel_layouts_are_checked():
    from parallel.layout import ParallelLayout

    with pytest.raises(UnsupportedModelError, match="needs a Mixture-of-Experts model"):
        architecture_from_hf(small_config()).validate_layout(ParallelLayout(expert_model_parallel_size=2))
    with pytest.raises(UnsupportedModelError, match="8 experts are not divisible by expert_model_parallel_size=3"):
        architecture_from_hf(MixtralConfig()).validate_layout(ParallelLayout(expert_model_parallel_size=3))


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rope_frequencies_match_transformers(rope):
    config = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters=rope)
    ours = rope_inverse_frequencies(architecture_from_hf(config))
    if rope["rope_type"] == "default":
        expected = 1.0 / (rope["rope_theta"] ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    torch.testing.assert_close(ours.double(), expected.double(), rtol=1e-6, atol=0)


def test_legacy_rope_keys_are_read():
    """Configs written before transformers 5 carry ``rope_theta`` + ``rope_scaling`` instead."""
    config = SimpleNamespace(**{**LlamaConfig(hidden_size=64, num_attention_heads=2).to_dict(), "rope_parameters": None,
                                "rope_theta": 12345.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    architecture = architecture_from_hf(config)
    assert architecture.rotary_base == 12345.0 and architecture.rope_scaling.factor == 2.0


@pytest.mark.parametrize("config, message", [
    (MistralConfig(), "model_type 'mistral'"),
    (LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "'yarn'"),
    (LlamaConfig(attention_bias=True), "attention_bias"),
    (LlamaConfig(hidden_act="gelu"), "hidden_act"),
    (Qwen2Config(use_sliding_window=True), "use_sliding_window"),
    (Qwen3Config(use_sliding_window=True), "use_sliding_window"),
    (Qwen3Config(attention_bias=True), "attention_bias"),
    (MixtralConfig(sliding_window=4096), "sliding_window"),
    (MixtralConfig(router_jitter_noise=0.1), "router_jitter_noise"),
    (MixtralConfig(num_experts_per_tok=1), "num_experts_per_tok=1 with renormalised"),
])
def test_unsupported_configs_fail_early_naming_the_key(config, message):
    with pytest.raises(UnsupportedModelError, match=message):
        architecture_from_hf(config)


def test_ffn_not_divisible_by_tp_is_a_clear_error():
    from parallel.layout import ParallelLayout

    with pytest.raises(UnsupportedModelError, match="intermediate_size=40"):
        architecture_from_hf(small_config(intermediate_size=40)).validate_layout(ParallelLayout(tensor_model_parallel_size=3))


def test_safetensors_checkpoint_reads_slices_of_a_sharded_folder(tmp_path):
    from safetensors.torch import save_file

    a, b = torch.arange(24.0).reshape(4, 6), torch.arange(5.0)
    save_file({"a": a}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": b}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    checkpoint = SafetensorsCheckpoint(tmp_path)
    assert checkpoint.shape("a") == (4, 6) and "b" in checkpoint
    assert torch.equal(checkpoint.read("a", 1, 2, 5), a[:, 2:5])
    assert torch.equal(checkpoint.read("b", 0, 1, 3), b[1:3])
    with pytest.raises(CheckpointError, match="'c' not found"):
        checkpoint.read("c", 0, 0, 1)
    index["weight_map"]["c"] = "model-00003-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="00003.*missing"):
        SafetensorsCheckpoint(tmp_path)
