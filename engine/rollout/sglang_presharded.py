"""Loading pre-sharded weights into SGLang's own TP workers (the sharded weight push).

The HybridEngine's ``SHARDED`` target gives each generation TP rank exactly its shard of every HF
tensor (``parallel.hybrid_engine``: rows of q/k/v_proj for its heads, of gate/up_proj for its part
of the MLP, columns of o_proj and down_proj, its vocab rows, each expert's slice). Each rank hands
its shards to its own SGLang TP worker through ``/update_weights_from_tensor`` with
``load_format`` set to this module's ``load_presharded_weights``, which SGLang 0.5.x calls inside
the worker (``--custom-weight-loader``; ``model_runner_components/weight_updater.py``,
``update_weights_from_tensor``: ``custom_loader(model, named_tensors)``).

No re-sharding happens there. The model's own ``load_weights`` does the name mapping (q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``, experts into ``w13_weight`` / ``w2_weight``) while
every parallel layer has ``use_presharded_weights`` set, the switch SGLang's linear and fused-MoE
weight loaders read to copy a rank-local shard into place instead of narrowing a full tensor
(``layers/linear.py``, ``layers/moe/fused_moe_triton/layer.py``). Vocab rows are the one exception:
SGLang's presharded embedding expects V / TP rows per rank, which padding breaks, so this module
copies each rank's rows itself, exactly as ``VocabParallelEmbedding.weight_loader`` ends (its rows,
then zeros for the padding).

``vocab_rows`` is SGLang's vocab padding, for the sender to plan which rows each rank gets.
"""

from __future__ import annotations

from typing import Iterable

import torch

# The value Trident passes as --custom-weight-loader and as load_format.
LOADER = "engine.rollout.sglang_presharded.load_presharded_weights"

# SGLang's DEFAULT_VOCAB_PADDING_SIZE (layers/vocab_parallel_embedding.py).
VOCAB_PADDING = 64


def vocab_rows(vocab_size: int, tensor_parallel_size: int) -> int:
    """Vocab rows of SGLang's ``VocabParallelEmbedding`` / ``ParallelLMHead`` at this TP size: a
    multiple of 64, or of 64 x TP where the first does not split evenly (its ``__init__``)."""
    padding = VOCAB_PADDING
    if _round_up(vocab_size, padding) % tensor_parallel_size:
        padding *= tensor_parallel_size
    return _round_up(vocab_size, padding)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def load_presharded_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy this TP rank's shards into ``model`` (runs inside an SGLang TP worker)."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from engine.rollout.sglang_cpu import rank_local_presharded_weights

    from sglang.srt.layers.linear import RowParallelLinear

    parameters = dict(model.named_parameters())
    rest = []
    for name, tensor in named_tensors:
        module = model.get_submodule(name.rsplit(".", 1)[0]) if name in parameters else None
        if isinstance(module, VocabParallelEmbedding):
            _load_vocab_rows(module, parameters[name], name, tensor)
        elif isinstance(module, RowParallelLinear):
            rest.append((name, _zero_padded_columns(parameters[name], tensor)))
        else:
            rest.append((name, tensor))
    if not rest:
        return
    switched = [m for m in model.modules() if hasattr(m, "use_presharded_weights")
                and not isinstance(m, VocabParallelEmbedding) and not m.use_presharded_weights]
    for module in switched:
        module.use_presharded_weights = True
    try:
        with rank_local_presharded_weights():
            model.load_weights(rest)
    finally:
        for module in switched:
            module.use_presharded_weights = False


def _zero_padded_columns(parameter: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """A row-parallel shard widened with zero columns to its parameter's padded width: SGLang pads
    intermediate sizes on CPU (to a multiple of 32 x TP, ``adjust_config_with_unaligned_cpu_tp``),
    and its row-parallel loader pads only whole tensors, not pre-sharded ones. The column-parallel
    and fused-MoE loaders zero their padding themselves."""
    dim = getattr(parameter, "input_dim", None)
    if dim is None or shard.shape[dim] >= parameter.shape[dim]:
        return shard
    padding = list(shard.shape)
    padding[dim] = parameter.shape[dim] - shard.shape[dim]
    return torch.cat([shard, shard.new_zeros(padding)], dim=dim)


def _load_vocab_rows(module, parameter: torch.Tensor, name: str, rows: torch.Tensor) -> None:
    indices = module.shard_indices
    expected = indices.org_vocab_end_index - indices.org_vocab_start_index
    if rows.shape[0] != expected or tuple(rows.shape[1:]) != tuple(parameter.shape[1:]):
        raise ValueError(f"{name}: TP rank's shard has shape {tuple(rows.shape)}, SGLang's rank holds "
                         f"{expected} real rows of {tuple(parameter.shape)}")
    with torch.no_grad():
        parameter[:expected].copy_(rows)
        parameter[expected:].fill_(0)
