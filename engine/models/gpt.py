"""megatron-core GPTModel chunks for a supported HF config (engine.models.hf_config), as actor/reference or critic.

``build_model_chunks`` returns one GPTModel per virtual pipeline stage held by this rank (a list of
one without virtual pipelining), after ``parallel.state.initialize_model_parallel(layout)``. Each
chunk carries ``chunk.hf_architecture`` (the validated HF config) and ``chunk.has_value_head``
for the checkpoint and forward code.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from engine.models.hf_config import (
    ModelArchitecture,
    architecture_from_hf,
    rope_inverse_frequencies,
    transformer_config_from_hf,
)
from engine.models.weight_mapping import Padding, global_megatron_name, mappings_by_megatron_name, shard_from_hf
from parallel.layout import ParallelLayout
from parallel.state import device

logger = logging.getLogger(__name__)


def use_transformer_engine() -> bool:
    """The one place that picks the layer spec: TE on GPU when installed, megatron's local spec else."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def fused_weight_gradients() -> bool:
    """Whether trained models accumulate weight gradients straight into megatron's fp32 ``main_grad``
    buffers (``gradient_accumulation_fusion``): TE's layers do it themselves, and megatron's own
    output layer needs APEX's ``fused_weight_gradient_mlp_cuda`` for it (it refuses the flag
    without that extension), so both must be there."""
    return use_transformer_engine() and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def recompute_settings(gradient_checkpointing: bool) -> dict[str, Any]:
    """TransformerConfig keys for ``model.enable_gradient_checkpointing``: megatron's full
    activation recompute of every layer (each layer keeps only its input for the backward pass)."""
    if not gradient_checkpointing:
        return {}
    return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def layer_spec(transformer_engine: bool, config, vp_stage: int | None):
    """The transformer layers of one model chunk: TE's spec on GPU, megatron's local spec with our
    fused attention else. MoE models get megatron's block spec (a dense or an MoE layer each)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if config.num_moe_experts:
        _megatron_moe_without_transformer_engine()
        spec = get_gpt_decoder_block_spec(config, transformer_engine, normalization="RMSNorm", vp_stage=vp_stage)
        layers = spec.layer_specs
    elif transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
        layers = [spec]
    if not transformer_engine:
        from engine.models.attention import FusedLocalAttention
        from parallel.context_parallel import ContextParallelAttention

        # megatron's local attention refuses CP; the stand-in for TE's CP kernels runs it.
        attention = ContextParallelAttention if config.context_parallel_size > 1 else FusedLocalAttention
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = attention
    return spec


def _megatron_moe_without_transformer_engine() -> None:
    """megatron-core 0.16's router reads ``moe_utils.te_general_gemm``, which exists only when TE
    imports (NameError otherwise); None selects its torch matmul."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class ValueHead(torch.nn.Module):
    """The critic's head: one scalar per token, V(s_t) = w . h_t + b, replicated on every TP rank.

    It stands in for GPTModel's ``output_layer`` and follows its call protocol
    (``(hidden [s, b, h], weight=None, runtime_gather_output=None) -> (output [s, b, 1], None)``),
    so megatron's pipeline schedule and post-processing run unchanged.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype, device=device()))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device()))
        torch.nn.init.normal_(self.weight, mean=0.0, std=config.init_method_std)
        for param in self.parameters():
            # Same value on every TP rank; megatron's grad-norm counts it once (TP rank 0).
            setattr(param, "tensor_model_parallel", False)

    def forward(self, hidden_states: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Every TP rank computes the same values from the full sequence; the backward only
            # keeps this rank's slice of the gradient (no sum: the ranks' losses are identical).
            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden_states, self.weight, self.bias), None


def _synchronise_value_head(head: ValueHead) -> None:
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    source = parallel_state.get_tensor_model_parallel_src_rank()
    for param in head.parameters():
        torch.distributed.broadcast(param.data, src=source, group=group)


def _check_layout_initialised(layout: ParallelLayout) -> None:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call parallel.state.initialize_model_parallel(layout) before building the model")
    actual = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
    )
    expected = (
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.virtual_pipeline_model_parallel_size,
    )
    if actual != expected:
        raise ValueError(f"layout (tp, pp, vpp)={expected} differs from the initialised parallel state {actual}")


def build_model_chunks(
    hf_config: Any,
    layout: ParallelLayout,
    *,
    value_head: bool = False,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    initialize_weights: bool = True,
    **transformer_config_overrides: Any,
) -> list[torch.nn.Module]:
    """This rank's GPTModel chunks (one per virtual pipeline stage) for an HF config or folder.

    ``value_head=True`` builds the critic: the LM head is replaced by a ``ValueHead`` and
    embeddings are never tied. ``initialize_weights=False`` skips megatron's random init (use it
    when ``load_hf_weights`` follows: every parameter is then overwritten; the value head is always
    initialised). Padded vocab rows and padded query groups are zero-initialised either way, so
    a random model also computes the HF model's function of its real weights.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    _check_layout_initialised(layout)
    architecture = architecture_from_hf(hf_config, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    tp_size = layout.tensor_model_parallel_size
    if architecture.padded_num_query_groups(tp_size) != architecture.num_query_groups:
        logger.warning(
            "num_key_value_heads=%d is not divisible by tensor_model_parallel_size=%d: padding to %d "
            "query groups with zero weights (exact, but costs attention compute)",
            architecture.num_query_groups, tp_size, architecture.padded_num_query_groups(tp_size),
        )
    transformer_engine = use_transformer_engine()
    config = transformer_config_from_hf(
        architecture, layout, params_dtype, use_transformer_engine=transformer_engine,
        perform_initialization=initialize_weights, **transformer_config_overrides,
    )
    inverse_frequencies = rope_inverse_frequencies(architecture)
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(layout.virtual_pipeline_model_parallel_size or 1):
        vp = vp_stage if layout.virtual_pipeline_model_parallel_size else None
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp)
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp)
        model = GPTModel(
            config,
            layer_spec(transformer_engine, config, vp),
            vocab_size=architecture.padded_vocab_size(tp_size),
            max_sequence_length=architecture.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=architecture.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_base=architecture.rotary_base,
            vp_stage=vp,
        )
        # megatron's built-in llama3 scaling hard-codes its thresholds; use the config's own.
        model.rotary_pos_emb.inv_freq = inverse_frequencies.to(model.rotary_pos_emb.inv_freq.device)
        if post_process and value_head:
            model.output_layer = ValueHead(config)
            _synchronise_value_head(model.output_layer)
        _zero_padding(model, architecture, tp_size, value_head)
        model.hf_architecture = architecture
        model.has_value_head = value_head  # on every chunk: the head itself is on the last stage only
        chunks.append(model.to(device()))
    return chunks


@torch.no_grad()
def _zero_padding(model: torch.nn.Module, architecture: ModelArchitecture, tp_size: int, value_head: bool) -> None:
    """Zero the padded vocab rows and padded query groups this rank holds (see weight_mapping)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    entries = mappings_by_megatron_name(
        architecture, transformer_engine=use_transformer_engine(), value_head=value_head
    )
    for name, param in named_global_parameters(model):
        entry = entries.get(name)
        if entry is None or entry.padding is Padding.NONE:
            continue
        # This rank's shard of all-ones HF tensors is 1 on real entries and 0 on padding.
        ones = _ones_reader(dict(zip(entry.hf_names, entry.hf_shapes)))
        real = shard_from_hf(entry, architecture, ones, tp_rank, tp_size).to(param.device)
        param.masked_fill_(real == 0, 0.0)  # masked_fill: uninitialised memory may hold NaN


def _ones_reader(shapes: dict[str, tuple[int, ...]]):
    """A SliceReader of all-ones tensors with these full shapes (allocating only the slices)."""

    def read(name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        shape = list(shapes[name])
        shape[dim] = stop - start
        return torch.ones(shape)

    return read


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of a chunk's first transformer layer (0 for a chunk without layers)."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def expert_offset(model: torch.nn.Module) -> int:
    """Global index of this expert-parallel rank's first expert (0 for a dense model)."""
    for layer in model.decoder.layers:
        indices = getattr(layer.mlp, "local_expert_indices", None)
        if indices:
            return indices[0]
    return 0


def named_global_parameters(model: torch.nn.Module):
    """A chunk's (name, parameter) pairs, named as in the unsplit model: global layer and expert indices."""
    layers, experts = layer_offset(model), expert_offset(model)
    for name, param in model.named_parameters():
        yield global_megatron_name(name, layers, experts), param
