"""The actor's Megatron model described for the HybridEngine: one ``ParameterSpec`` per exported
Megatron parameter, built from ``engine.models.weight_mapping`` (names, TP dim, fused kind,
padding) and the training layout (which pipeline stage / virtual chunk owns each layer).
"""

from __future__ import annotations

import re
from typing import Sequence

import torch

from engine.models.gpt import named_global_parameters, use_transformer_engine
from engine.models.hf_config import ModelArchitecture
from engine.models.weight_mapping import FusedKind as MappingFusedKind
from engine.models.weight_mapping import Padding, ParamMapping, expert_index, weight_mappings
from parallel.hybrid_engine.layouts import TrainingLayout
from parallel.hybrid_engine.spec import FusedKind, HFTensorLayout, ParameterSpec

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def owner_of(megatron_name: str, architecture: ModelArchitecture, layout: TrainingLayout) -> tuple[int, int]:
    """(pipeline rank, virtual pipeline chunk) holding ``megatron_name`` (``ParallelLayout.layer_owner``
    for a layer's weights)."""
    pp, vpp = layout.pipeline_model_parallel_size, layout.virtual_pipeline_stages
    match = _LAYER.match(megatron_name)
    if match:
        return layout.layer_owner(int(match.group(1)), architecture.num_layers)
    if megatron_name.startswith("embedding."):
        return 0, 0
    return pp - 1, vpp - 1  # final norm, output layer / value head


def _hf_layouts(entry: ParamMapping, architecture: ModelArchitecture, tp_size: int,
                generation_vocab_rows: int | None) -> tuple[HFTensorLayout, ...]:
    a = architecture
    head_dim, heads_per_group = a.kv_channels, a.heads_per_query_group
    padded_groups = a.padded_num_query_groups(tp_size)
    layouts = []
    for index, (name, shape) in enumerate(zip(entry.hf_names, entry.hf_shapes)):
        unit, padded = 1, None
        if entry.fused is MappingFusedKind.QKV:
            unit = heads_per_group * head_dim if index == 0 else head_dim
            padded = padded_groups * unit
        elif entry.padding is Padding.HEADS:  # o_proj columns
            unit = heads_per_group * head_dim
            padded = padded_groups * unit
        elif entry.padding is Padding.VOCAB:
            padded = a.padded_vocab_size(tp_size)
        generation = generation_vocab_rows if entry.padding is Padding.VOCAB else None
        layouts.append(HFTensorLayout(name, tuple(shape), padded, unit, generation))
    return tuple(layouts)


def parameter_specs(
    architecture: ModelArchitecture,
    layout: TrainingLayout,
    *,
    value_head: bool = False,
    transformer_engine: bool | None = None,
    generation_vocab_rows: int | None = None,
) -> list[ParameterSpec]:
    """Specs of every exported parameter, in HF streaming order (the mapping's model order).

    ``generation_vocab_rows``: the generation engine's padded vocab rows where it pads its own way
    (SGLang, for a sharded push), which decides each generation rank's vocab slice."""
    if transformer_engine is None:
        transformer_engine = use_transformer_engine()
    tp_size = layout.tensor_model_parallel_size
    specs = []
    for entry in weight_mappings(architecture, transformer_engine=transformer_engine, value_head=value_head):
        if not entry.exported:
            continue
        stage, chunk = owner_of(entry.megatron_name, architecture, layout)
        expert_owner = None
        if entry.expert:  # megatron gives expert-parallel rank r experts [r E / EP, (r + 1) E / EP)
            experts_per_rank = architecture.moe.num_experts // layout.expert_model_parallel_size
            expert_owner = expert_index(entry.megatron_name) // experts_per_rank
        specs.append(ParameterSpec(
            megatron_name=entry.megatron_name,
            hf_tensors=_hf_layouts(entry, architecture, tp_size, generation_vocab_rows),
            pipeline_rank=stage,
            virtual_pipeline_rank=chunk,
            tensor_parallel_dim=entry.tensor_parallel_dim,
            fused=FusedKind(entry.fused.value),
            expert_owner=expert_owner,
        ))
    return specs


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while not hasattr(chunk, "hf_architecture") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def local_parameters(
    model_chunks: Sequence[torch.nn.Module], specs: Sequence[ParameterSpec], pipeline_rank: int, expert_rank: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's parameters by global Megatron name, checked against the specs' owners (pipeline
    stage, and expert-parallel rank for MoE experts)."""
    by_name = {spec.megatron_name: spec for spec in specs}
    result: dict[str, torch.Tensor] = {}
    for vp, chunk in enumerate(model_chunks):
        for name, param in named_global_parameters(unwrap(chunk)):
            spec = by_name.get(name)
            if spec is None:
                continue  # not exported (the tied output layer's copy on the last stage)
            if (spec.pipeline_rank, spec.virtual_pipeline_rank) != (pipeline_rank, vp):
                raise ValueError(
                    f"{name} sits on pipeline stage {pipeline_rank} chunk {vp}, but the layout puts it on "
                    f"stage {spec.pipeline_rank} chunk {spec.virtual_pipeline_rank} (non-uniform layer split?)"
                )
            if spec.expert_owner not in (None, expert_rank):
                raise ValueError(f"{name} sits on expert-parallel rank {expert_rank}, the layout puts it on "
                                 f"{spec.expert_owner}")
            result[name] = param
    missing = [s.megatron_name for s in specs if s.pipeline_rank == pipeline_rank
               and s.expert_owner in (None, expert_rank) and s.megatron_name not in result]
    if missing:
        raise ValueError(f"pipeline stage {pipeline_rank} lacks parameters the layout gives it: {missing[:5]}")
    return result
