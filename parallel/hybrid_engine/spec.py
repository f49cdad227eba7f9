"""How each training parameter is sharded, described without the model code (``parallel`` may not
import ``engine``): the HybridEngine plans and moves bytes from these specs alone.

A Megatron parameter is one tensor per training TP rank. It stands for one or more HF tensors:

- ``FusedKind.NONE``: one HF tensor; the TP shard is a contiguous slice along
  ``tensor_parallel_dim`` (or the whole tensor when replicated).
- ``FusedKind.QKV``: ``linear_qkv`` holds, per query group, [q heads | k | v] rows; a TP rank owns
  whole groups, so its shard splits into contiguous row slices of q_proj, k_proj and v_proj.
- ``FusedKind.GATE_UP``: ``linear_fc1`` of SwiGLU holds [gate rows of this rank | up rows of this
  rank]; the shard splits into contiguous row slices of gate_proj and up_proj.

So every TP shard is, after ``hf_chunks_of_shard``, a set of contiguous slices of HF tensors along
one dimension, and resharding becomes "move contiguous slices". Megatron may pad a dimension so it
divides evenly (vocab rows, zero query groups): slices are then taken in the *padded* coordinates
(``HFTensorLayout.padded_length``), and rows past the real length are padding, never exported.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class FusedKind(str, Enum):
    NONE = "none"
    QKV = "qkv"
    GATE_UP = "gate_up"


class ReshardTarget(str, Enum):
    """What each generation rank receives.

    ``FULL``: complete HF tensors on every generation rank. SGLang's weight loader
    (``update_weights_from_tensor``: each TP worker slices the full tensor itself) and the embedded
    transformers engine take only this; it costs (tg - 1) / tg of the model more per rank than
    ``SHARDED``.
    ``SHARDED``: the zero-redundancy path: each generation rank receives exactly its generation TP
    shard of every tensor (slices in the training's padded coordinates, see ``WeightShard``).
    ``STAGE``: for rollout servers outside the training world (disaggregated mode): complete HF
    tensors of each pipeline stage's own parameters on that stage's ranks of data-parallel rank 0,
    by the stage's TP all-gather only; no tensor crosses a pipeline stage, so no rank ever holds
    more than its stage's share of the model. Every other rank receives nothing.
    """

    FULL = "full"
    SHARDED = "sharded"
    STAGE = "stage"


@dataclass(frozen=True)
class HFTensorLayout:
    """One HF tensor a parameter stands for."""

    name: str
    shape: tuple[int, ...]
    # Length along the TP dimension in Megatron's padded layout; None: no padding.
    padded_length: int | None = None
    # Rows (along the TP dimension) of one indivisible unit: a query group's q heads
    # (heads_per_group * head_dim) for q_proj, head_dim for k/v_proj, 1 otherwise.
    unit: int = 1
    # The generation engine's own padded length, where it pads differently from Megatron (SGLang
    # pads vocab rows to a multiple of 64, Megatron to one of 128 x TP): a ``SHARDED`` target
    # delivers generation rank g the real rows of slice g of this length. None: Megatron's.
    generation_padded_length: int | None = None


@dataclass(frozen=True)
class ParameterSpec:
    """One Megatron parameter: where it lives in training and what HF tensors it makes."""

    megatron_name: str
    hf_tensors: tuple[HFTensorLayout, ...]
    # Pipeline stage (pp rank) that owns the parameter, and its virtual-pipeline chunk there.
    pipeline_rank: int
    virtual_pipeline_rank: int = 0
    # Dimension split by tensor parallelism (the same in Megatron and HF layout); None: replicated.
    tensor_parallel_dim: int | None = None
    fused: FusedKind = FusedKind.NONE
    # An MoE expert's weight: the expert-parallel rank that holds it (None: every one does).
    expert_owner: int | None = None

    def __post_init__(self) -> None:
        expected = {FusedKind.NONE: 1, FusedKind.QKV: 3, FusedKind.GATE_UP: 2}[self.fused]
        if len(self.hf_tensors) != expected:
            raise ValueError(
                f"{self.megatron_name}: fused kind {self.fused.value!r} needs {expected} HF tensors, "
                f"got {[t.name for t in self.hf_tensors]}"
            )
        if self.fused is not FusedKind.NONE and self.tensor_parallel_dim != 0:
            raise ValueError(f"{self.megatron_name}: fused {self.fused.value} parameters split along dim 0")
        dim = self.tensor_parallel_dim
        for tensor in self.hf_tensors:
            if dim is not None and not 0 <= dim < len(tensor.shape):
                raise ValueError(f"{tensor.name}: tensor_parallel_dim {dim} outside its shape {tensor.shape}")
            if dim is not None and tensor.padded_length is not None and tensor.padded_length < tensor.shape[dim]:
                raise ValueError(f"{tensor.name}: padded_length {tensor.padded_length} < length {tensor.shape[dim]}")


@dataclass(frozen=True)
class SliceRange:
    """Rows [start, stop) along the TP dimension, in padded coordinates."""

    start: int
    stop: int

    @property
    def length(self) -> int:
        return max(0, self.stop - self.start)

    def intersect(self, other: "SliceRange") -> "SliceRange":
        return SliceRange(max(self.start, other.start), min(self.stop, other.stop))


def padded_length(tensor: HFTensorLayout, dim: int | None) -> int:
    """Length along the TP dimension in padded coordinates; a replicated tensor is one unit."""
    if dim is None:
        return 1
    return tensor.padded_length if tensor.padded_length is not None else tensor.shape[dim]


def chunk_range(tensor: HFTensorLayout, dim: int | None, index: int, count: int, *,
                generation: bool = False) -> SliceRange:
    """Slice ``index`` of ``count`` equal slices along ``dim`` (padded coordinates, whole units);
    ``generation``: of the generation engine's padded length where it has its own. Padding rows
    sit past the real length in both paddings, so both slicings share one coordinate system."""
    length = padded_length(tensor, dim)
    if generation and dim is not None and tensor.generation_padded_length is not None:
        length = tensor.generation_padded_length
    if dim is None:
        return SliceRange(0, length)
    size = length // count
    return SliceRange(index * size, (index + 1) * size)


def check_divisible(spec: ParameterSpec, parts: int, why: str) -> None:
    """Raise if a TP-split tensor of ``spec`` cannot be cut into ``parts`` slices of whole units."""
    if spec.tensor_parallel_dim is None:
        return
    for tensor in spec.hf_tensors:
        length = padded_length(tensor, spec.tensor_parallel_dim)
        units, remainder = divmod(length, tensor.unit)
        if remainder or units % parts:
            what = "query groups" if tensor.unit > 1 else "rows"
            raise ValueError(
                f"{tensor.name}: {units} {what} along dim {spec.tensor_parallel_dim} cannot be split into "
                f"{parts} equal slices ({why})"
            )


def hf_chunks_of_shard(spec: ParameterSpec, shard: torch.Tensor) -> list[torch.Tensor]:
    """This TP rank's slice of each HF tensor of ``spec`` (views of ``shard``, padded coordinates).

    The slices are those of ``chunk_range(tensor, dim, tp_rank, tp_size)``.
    """
    if spec.fused is FusedKind.QKV:
        q, k, v = spec.hf_tensors
        rows_per_group = q.unit + k.unit + v.unit
        per_group = shard.reshape(-1, rows_per_group, *shard.shape[1:])
        parts = per_group.split([q.unit, k.unit, v.unit], dim=1)
        return [part.reshape(-1, *shard.shape[1:]) for part in parts]
    if spec.fused is FusedKind.GATE_UP:
        return list(shard.chunk(2, dim=0))
    return [shard]
