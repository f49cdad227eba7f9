"""The Hugging Face <-> Megatron parameter mapping, as data plus pure tensor functions.

One ``ParamMapping`` per Megatron parameter of the *unsplit* model (TP1, PP1: global layer
indices), naming the HF tensor(s) it is made of, the dimension tensor parallelism splits, and how
several HF tensors are fused into one Megatron tensor:

- ``qkv``: Megatron's ``linear_qkv`` stores, per query group g, the rows
  [q heads of g | k of g | v of g]; TP ranks own whole groups.
- ``gate_up``: ``linear_fc1`` of SwiGLU stores [gate rows of this rank | up rows of this rank].

Two kinds of padding make every TP rank's slice equal (``padding``):

- ``vocab``: embedding / output rows up to ``ModelArchitecture.padded_vocab_size(tp)``; pad rows
  are zero and never exported.
- ``heads``: when num_key_value_heads is not divisible by TP (SmolLM2-135M: 3 groups at TP2), we
  add whole query groups whose q/k/v rows and o_proj columns are zero. Such a group's output is 0
  for any input and its gradients are 0, so the padded model computes exactly the HF model.

The functions need no model instance: ``shard_from_hf`` builds one TP rank's tensor from any reader
of HF tensor slices (safetensors ``get_slice``, an in-memory state dict), ``hf_from_shards`` turns
the TP shards of one parameter back into full HF tensors. Layer-local Megatron names (a pipeline
chunk's ``decoder.layers.0`` ...) become global ones with ``global_megatron_name``; the offset of a
chunk is ``megatron.core.transformer.transformer_layer.get_transformer_layer_offset``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Mapping, Sequence

import torch

from engine.models.hf_config import ModelArchitecture

# read(hf_name, dim, start, stop) -> the full HF tensor narrowed to [start, stop) along dim.
SliceReader = Callable[[str, int, int, int], torch.Tensor]


class FusedKind(str, Enum):
    NONE = "none"
    QKV = "qkv"
    GATE_UP = "gate_up"


class Padding(str, Enum):
    NONE = "none"
    VOCAB = "vocab"
    HEADS = "heads"


@dataclass(frozen=True)
class ParamMapping:
    """How one Megatron parameter relates to HF tensors."""

    megatron_name: str  # global name in an unsplit GPTModel, e.g. decoder.layers.3.mlp.linear_fc1.weight
    hf_names: tuple[str, ...]  # (q, k, v) for qkv, (gate, up) for gate_up, else one name
    hf_shapes: tuple[tuple[int, ...], ...]  # full HF shape of each hf_names entry
    tensor_parallel_dim: int | None  # None: replicated on every TP rank
    fused: FusedKind = FusedKind.NONE
    padding: Padding = Padding.NONE
    # False for a tied output layer: HF stores only embed_tokens, which the embedding exports.
    exported: bool = True
    # True for the critic's value head: an actor checkpoint does not have it.
    optional: bool = False
    # An MoE expert's weight: split over expert-parallel ranks (whole experts), and over the expert
    # tensor-parallel group instead of the TP group.
    expert: bool = False


_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(\d+)\.")
# An expert's index in megatron's local spec (SequentialMLP) and in TE's grouped experts.
_EXPERT_INDEX = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(?=\.)|(\.mlp\.experts\.linear_fc[12]\.weight)(\d+)$")


def global_megatron_name(local_name: str, layer_offset: int, expert_offset: int = 0) -> str:
    """A name in a pipeline chunk / on an expert-parallel rank -> its name in the unsplit model:
    ``decoder.layers.{i}.`` -> ``decoder.layers.{i + layer_offset}.``, local expert {e} -> {e + expert_offset}."""
    name = _LAYER_PREFIX.sub(lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", local_name, count=1)
    if expert_offset:
        name = _EXPERT_INDEX.sub(lambda m: f"{m.group(1) or m.group(3)}{int(m.group(2) or m.group(4)) + expert_offset}",
                                 name, count=1)
    return name


def expert_index(megatron_name: str) -> int | None:
    """The expert a megatron parameter name belongs to (local or global, as the name has it), or None."""
    match = _EXPERT_INDEX.search(megatron_name)
    return None if match is None else int(match.group(2) or match.group(4))


def weight_mappings(
    architecture: ModelArchitecture, *, transformer_engine: bool = False, value_head: bool = False
) -> list[ParamMapping]:
    """Every parameter of the unsplit Megatron model, in model order.

    ``transformer_engine``: names of the TE layer spec (norms fused into linear_qkv / linear_fc1)
    instead of the local spec. ``value_head``: the critic (``output_layer`` is a [1, hidden] value
    head exported as HF ``score``, as in ``*ForTokenClassification`` with num_labels=1).
    """
    a = architecture
    hidden, head_dim = a.hidden_size, a.kv_channels
    q_rows, kv_rows = a.num_attention_heads * head_dim, a.num_query_groups * head_dim
    entries = [
        ParamMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",),
                     ((a.vocab_size, hidden),), 0, padding=Padding.VOCAB),
    ]
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if transformer_engine else "input_layernorm.weight"
    for layer in range(a.num_layers):
        m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        attn = h + "self_attn."
        entries.append(ParamMapping(m + input_norm, (h + "input_layernorm.weight",), ((hidden,),), None))
        entries.append(ParamMapping(
            m + "self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            ((q_rows, hidden), (kv_rows, hidden), (kv_rows, hidden)), 0, FusedKind.QKV, Padding.HEADS,
        ))
        if a.add_qkv_bias:
            entries.append(ParamMapping(
                m + "self_attention.linear_qkv.bias",
                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                ((q_rows,), (kv_rows,), (kv_rows,)), 0, FusedKind.QKV, Padding.HEADS,
            ))
        if a.qk_layernorm:  # one [head_dim] weight shared by all heads, so replicated on TP ranks
            entries += [ParamMapping(m + f"self_attention.{part}_layernorm.weight", (attn + f"{part}_norm.weight",),
                                     ((head_dim,),), None) for part in ("q", "k")]
        entries.append(ParamMapping(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",),
                                    ((hidden, q_rows),), 1, padding=Padding.HEADS))
        if a.moe is not None and layer in a.moe.layers:
            entries += _moe_mappings(a, layer, transformer_engine)
        else:
            mlp_norm = "mlp.linear_fc1.layer_norm_weight" if transformer_engine else "pre_mlp_layernorm.weight"
            entries.append(ParamMapping(m + mlp_norm, (h + "post_attention_layernorm.weight",), ((hidden,),), None))
            entries.append(ParamMapping(
                m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                ((a.ffn_hidden_size, hidden),) * 2, 0, FusedKind.GATE_UP,
            ))
            entries.append(ParamMapping(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",),
                                        ((hidden, a.ffn_hidden_size),), 1))
    entries.append(ParamMapping("decoder.final_layernorm.weight", ("model.norm.weight",), ((hidden,),), None))
    if value_head:
        entries.append(ParamMapping("output_layer.weight", ("score.weight",), ((1, hidden),), None, optional=True))
        entries.append(ParamMapping("output_layer.bias", ("score.bias",), ((1,),), None, optional=True))
    elif a.tie_word_embeddings:
        # Exists only on the last pipeline stage when PP > 1 (a copy megatron keeps in sync).
        entries.append(ParamMapping("output_layer.weight", ("model.embed_tokens.weight",),
                                    ((a.vocab_size, hidden),), 0, padding=Padding.VOCAB, exported=False))
    else:
        entries.append(ParamMapping("output_layer.weight", ("lm_head.weight",),
                                    ((a.vocab_size, hidden),), 0, padding=Padding.VOCAB))
    return entries


# HF names of an MoE block: (router, expert prefix, gate, up, down) per model_type.
_HF_MOE_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts", "w1", "w3", "w2"),
}


# transformers >= 5 holds an MoE block's experts fused in memory, under ``mlp``: experts.gate_up_proj
# [experts, 2 * ffn, hidden] (each expert's gate rows, then its up rows) and experts.down_proj
# [experts, hidden, ffn]. Checkpoints, SGLang and our export name each expert's matrices.
_CHECKPOINT_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|w1|up_proj|w3|down_proj|w2)\.weight$"
)
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def transformers_in_memory_slot(checkpoint_name: str) -> tuple[str, int | None, str | None]:
    """Where a checkpoint tensor lives in a transformers model: (parameter name, expert index, part
    "gate" / "up" / "down"), or (name, None, None) for a tensor held as it is saved."""
    match = _CHECKPOINT_EXPERT.match(checkpoint_name)
    if match is None:
        # Mixtral's router is saved under block_sparse_moe, held under mlp.
        return checkpoint_name.replace(".block_sparse_moe.gate.", ".mlp.gate."), None, None
    layer, expert, part = match.groups()
    part = _EXPERT_PART[part]
    return f"{layer}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}", int(expert), part


def _moe_mappings(a: ModelArchitecture, layer: int, transformer_engine: bool) -> list[ParamMapping]:
    """One MoE layer's norm, router and experts. The router is replicated on every rank; expert e's
    SwiGLU is split over the expert TP group like a dense MLP (megatron's global expert index e)."""
    m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    router, experts, gate, up, down = _HF_MOE_NAMES[a.model_type]
    hidden, ffn = a.hidden_size, a.moe.ffn_hidden_size
    entries = [
        # The MoE layer keeps its norm as a module of its own, also with TE (no fused fc1 to hold it).
        ParamMapping(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), ((hidden,),), None),
        ParamMapping(m + "mlp.router.weight", (h + router,), ((a.moe.num_experts, hidden),), None),
    ]
    for e in range(a.moe.num_experts):
        fc1, fc2 = ((f"mlp.experts.linear_fc1.weight{e}", f"mlp.experts.linear_fc2.weight{e}") if transformer_engine
                    else (f"mlp.experts.local_experts.{e}.linear_fc1.weight", f"mlp.experts.local_experts.{e}.linear_fc2.weight"))
        hf = f"{h}{experts}.{e}."
        entries.append(ParamMapping(m + fc1, (hf + f"{gate}.weight", hf + f"{up}.weight"), ((ffn, hidden),) * 2, 0,
                                    FusedKind.GATE_UP, expert=True))
        entries.append(ParamMapping(m + fc2, (hf + f"{down}.weight",), ((hidden, ffn),), 1, expert=True))
    return entries


def mappings_by_megatron_name(
    architecture: ModelArchitecture, *, transformer_engine: bool = False, value_head: bool = False
) -> dict[str, ParamMapping]:
    return {
        entry.megatron_name: entry
        for entry in weight_mappings(architecture, transformer_engine=transformer_engine, value_head=value_head)
    }


# ---------------------------------------------------------------------------------------------
# Sizes along the tensor-parallel dimension


def _group_counts(architecture: ModelArchitecture, tp_size: int) -> tuple[int, int]:
    """(query groups per TP rank, q heads per group) in the padded Megatron model."""
    return architecture.padded_num_query_groups(tp_size) // tp_size, architecture.heads_per_query_group


def megatron_shard_shape(entry: ParamMapping, architecture: ModelArchitecture, tp_size: int) -> tuple[int, ...]:
    """Shape of one TP rank's tensor for ``entry``."""
    a = architecture
    if entry.fused is FusedKind.QKV:
        groups, heads_per_group = _group_counts(a, tp_size)
        rows = groups * (heads_per_group + 2) * a.kv_channels
        return (rows, *entry.hf_shapes[0][1:])
    if entry.fused is FusedKind.GATE_UP:
        gate = entry.hf_shapes[0]
        return (2 * gate[0] // tp_size, *gate[1:])
    shape = list(entry.hf_shapes[0])
    if entry.tensor_parallel_dim is None:
        return tuple(shape)
    dim = entry.tensor_parallel_dim
    if entry.padding is Padding.VOCAB:
        shape[dim] = a.padded_vocab_size(tp_size)
    elif entry.padding is Padding.HEADS:
        shape[dim] = a.padded_num_query_groups(tp_size) * a.heads_per_query_group * a.kv_channels
    shape[dim] //= tp_size
    return tuple(shape)


def _read_zero_padded(read: SliceReader, name: str, shape: tuple[int, ...], dim: int, start: int, stop: int) -> torch.Tensor:
    """HF tensor ``name`` narrowed to [start, stop) along ``dim``; rows past its end are zeros."""
    real_stop = min(stop, shape[dim])
    if real_stop >= stop:
        return read(name, dim, start, stop)
    pad_shape = list(shape)
    pad_shape[dim] = stop - max(start, real_stop)
    if start >= real_stop:
        return torch.zeros(pad_shape)
    part = read(name, dim, start, real_stop)
    return torch.cat([part, part.new_zeros(pad_shape)], dim=dim)


# ---------------------------------------------------------------------------------------------
# HF -> Megatron


def shard_from_hf(
    entry: ParamMapping, architecture: ModelArchitecture, read: SliceReader, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """TP rank ``tp_rank``'s Megatron tensor for ``entry``, reading only the HF slices it needs."""
    a = architecture
    if entry.fused is FusedKind.QKV:
        groups, heads_per_group = _group_counts(a, tp_size)
        d = a.kv_channels
        first = tp_rank * groups
        q_name, k_name, v_name = entry.hf_names
        q_shape, k_shape, v_shape = entry.hf_shapes
        q = _read_zero_padded(read, q_name, q_shape, 0, first * heads_per_group * d, (first + groups) * heads_per_group * d)
        k = _read_zero_padded(read, k_name, k_shape, 0, first * d, (first + groups) * d)
        v = _read_zero_padded(read, v_name, v_shape, 0, first * d, (first + groups) * d)
        rest = q.shape[1:]
        fused = torch.cat(
            [q.reshape(groups, heads_per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
            dim=1,
        )
        return fused.reshape(groups * (heads_per_group + 2) * d, *rest)
    if entry.fused is FusedKind.GATE_UP:
        rows = entry.hf_shapes[0][0] // tp_size
        gate_name, up_name = entry.hf_names
        return torch.cat([read(gate_name, 0, tp_rank * rows, (tp_rank + 1) * rows),
                          read(up_name, 0, tp_rank * rows, (tp_rank + 1) * rows)], dim=0)
    (name,), (shape,) = entry.hf_names, entry.hf_shapes
    if entry.tensor_parallel_dim is None:
        return read(name, 0, 0, shape[0])
    dim = entry.tensor_parallel_dim
    size = megatron_shard_shape(entry, a, tp_size)[dim]
    return _read_zero_padded(read, name, shape, dim, tp_rank * size, (tp_rank + 1) * size)


def reader_from_state_dict(hf_state_dict: Mapping[str, torch.Tensor]) -> SliceReader:
    """A ``SliceReader`` over full HF tensors already in memory."""

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        if name not in hf_state_dict:
            raise KeyError(f"HF tensor {name!r} not in the state dict")
        return hf_state_dict[name].narrow(dim, start, stop - start)

    return read


# ---------------------------------------------------------------------------------------------
# Megatron -> HF


def hf_from_shards(
    entry: ParamMapping, architecture: ModelArchitecture, shards: Sequence[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Full HF tensors of ``entry`` from its TP shards (index = TP rank), padding removed."""
    a = architecture
    tp_size = len(shards)
    if entry.fused is FusedKind.QKV:
        groups, heads_per_group = _group_counts(a, tp_size)
        d = a.kv_channels
        parts: list[list[torch.Tensor]] = [[], [], []]
        for shard in shards:
            per_group = shard.reshape(groups, (heads_per_group + 2) * d, *shard.shape[1:])
            q, k, v = per_group.split([heads_per_group * d, d, d], dim=1)
            for out, piece in zip(parts, (q, k, v)):
                out.append(piece.reshape(-1, *shard.shape[1:]))
        return {
            name: torch.cat(pieces, dim=0)[: shape[0]].contiguous()  # drop padded query groups
            for name, shape, pieces in zip(entry.hf_names, entry.hf_shapes, parts)
        }
    if entry.fused is FusedKind.GATE_UP:
        gates, ups = zip(*(shard.chunk(2, dim=0) for shard in shards))
        return {entry.hf_names[0]: torch.cat(gates, dim=0), entry.hf_names[1]: torch.cat(ups, dim=0)}
    (name,), (shape,) = entry.hf_names, entry.hf_shapes
    if entry.tensor_parallel_dim is None:
        return {name: shards[0].clone()}
    dim = entry.tensor_parallel_dim
    full = torch.cat(list(shards), dim=dim)
    return {name: full.narrow(dim, 0, shape[dim]).contiguous()}
