"""The reshard plan: which slices every rank holds, which it needs, and the collectives between.

Computed once per (layout, parameters, target). For one HF tensor owned by pipeline stage o with
TP dimension d, and a rank at training coordinates (stage i, TP rank t):

- holds: training slice t of T (the whole tensor when replicated) if i == o, else nothing;
- needs: the whole tensor (``ReshardTarget.FULL``) or generation slice g of tg (``SHARDED``);
  with ``STAGE`` the whole tensor if i == o on data-parallel rank 0, else nothing (no phase 1).

Before them, an MoE expert's tensor is held only by its expert-parallel rank (``ParameterSpec.
expert_owner``): the expert phase sends the owner's training slice t point-to-point to the ranks of
the same (stage, TP rank, expert-data rank) on the other expert ranks that need a part of it, which
then act as holders in the two phases below (with a FULL or tg <= T SHARDED target each such rank
needs all of slice t, so the expert phase moves no byte above the lower bound). With an expert
tensor-parallel size Te < T the owners' slices (1 / Te) do not line up with the TP slices the two
phases gather, and a SHARDED target with tg > T needs sub-slices of them, so there an expert's
tensor skips every phase: each rank receives what it needs and lacks directly from the owners of
the same expert-data rank (``direct_receives``), one piece per owner slice, which is the lower
bound by construction. A SHARDED target into an engine that pads a tensor its own way
(``HFTensorLayout.generation_padded_length``: SGLang's vocab rows) moves that tensor the same
direct way, from the owners at the rank's data rank, real rows only.

Two phases move exactly the missing slices (each needed slice is received once, none twice):

1. pipeline (ranks with i != o): from (o, t) the part of training slice t the rank needs, by one
   ``broadcast`` in the pipeline group when every stage needs the same part, else point-to-point
   (tg > T: stages need different sub-slices);
2. tensor: an ``all_gather`` of training slices inside a block of consecutive TP ranks of the same
   stage: all T ranks for FULL, T / tg for SHARDED (tg <= T), none otherwise.

Bytes are counted as a direct (point-to-point) realisation would move them: a receiver counts every
slice it gets, a sender counts one copy per receiver (a ring or tree collective forwards on the way
but no rank receives more). Slices are moved in Megatron's padded coordinates, so padded vocab rows
or zero query groups travel too; the lower bound counts only real rows.

Lower bounds reported per rank (element size of the transfer dtype):
- ``lower_bound_bytes``: exact minimum, bytes the rank needs that it does not hold;
- ``hybridflow_bound_bytes``: HybridFlow's formula (tp - tg*pg) / (tg*pg*tp*pp) * M with pg = 1,
  which assumes equal stages and tg <= tp (it is below the exact minimum otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import torch

from parallel.hybrid_engine.layouts import HybridLayout, lcm
from parallel.hybrid_engine.spec import (
    HFTensorLayout,
    ParameterSpec,
    ReshardTarget,
    SliceRange,
    check_divisible,
    chunk_range,
    padded_length,
)
from parallel.layout import LayoutError


@dataclass(frozen=True)
class PlannedTensor:
    """One HF tensor of the plan, in the order it is streamed."""

    index: int
    spec_index: int
    hf_index: int  # position in its ParameterSpec.hf_tensors
    layout: HFTensorLayout
    dim: int | None
    pipeline_rank: int
    expert_owner: int | None = None

    @property
    def name(self) -> str:
        return self.layout.name

    @property
    def real_length(self) -> int:
        """Length along the TP dimension without padding (1 for a replicated tensor: one whole unit)."""
        return self.layout.shape[self.dim] if self.dim is not None else 1

    def row_elements(self) -> int:
        """Elements per unit of length along the TP dimension (the whole tensor when replicated)."""
        return math.prod(self.layout.shape) // self.real_length

    def slice_shape(self, span: SliceRange) -> tuple[int, ...]:
        if self.dim is None:
            return self.layout.shape
        shape = list(self.layout.shape)
        shape[self.dim] = span.length
        return tuple(shape)

    def real(self, span: SliceRange) -> SliceRange:
        """The part of ``span`` that is not padding."""
        return span.intersect(SliceRange(0, self.real_length))


@dataclass(frozen=True)
class TensorSteps:
    """What one rank does for one tensor (global ranks; ranges in padded coordinates)."""

    tensor: PlannedTensor
    # The range this rank ends up with (its output).
    need: SliceRange
    # The training slice this rank has when phase 1 starts: its own shard, or (expert_receive) the
    # expert owner's; None: it has nothing.
    local: SliceRange | None
    # Phase 1 by broadcast in the pipeline group: (source rank, range); the source takes part too.
    broadcast: tuple[int, SliceRange] | None = None
    # Phase 1 point-to-point: the range this rank receives from a source, and what it sends.
    receive: tuple[int, SliceRange] | None = None
    sends: tuple[tuple[int, SliceRange], ...] = ()
    # Phase 2: slices of the all-gather block members in member order, and this rank's position.
    gather: tuple[SliceRange, ...] = ()
    gather_position: int = 0
    # The expert phase: the slice received from the expert's owner, or the peers the owner sends to.
    expert_receive: tuple[int, SliceRange] | None = None
    expert_sends: tuple[tuple[int, SliceRange], ...] = ()
    # Experts at expert TP < TP, instead of every phase above: (source, range) pieces this rank
    # receives from the owners, and the (destination, range) pieces it sends as an owner.
    direct_receives: tuple[tuple[int, SliceRange], ...] = ()
    direct_sends: tuple[tuple[int, SliceRange], ...] = ()

    @property
    def held(self) -> SliceRange | None:
        """The training slice this rank holds itself (before any transfer)."""
        return None if self.expert_receive is not None else self.local

    @property
    def receives_in_pipeline_phase(self) -> bool:
        return self.receive is not None or (self.broadcast is not None and self.local is None)


@dataclass
class RankTraffic:
    """Bytes one rank moves for a whole sync."""

    rank: int
    received: int = 0
    sent: int = 0
    lower_bound: int = 0
    output: int = 0  # real bytes the rank ends up with
    held: int = 0  # real bytes of the training shard it starts from
    hybridflow_bound: float = 0.0
    by_phase: dict = field(default_factory=lambda: {"expert": 0, "pipeline": 0, "tensor": 0})


class ReshardPlan:
    """The full reshard plan for ``layout``, ``specs`` and ``target`` (see the module docstring)."""

    def __init__(
        self,
        layout: HybridLayout,
        specs: Sequence[ParameterSpec],
        target: ReshardTarget | str = ReshardTarget.FULL,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.layout = layout
        self.specs = list(specs)
        self.target = ReshardTarget(target)
        self.dtype = dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        t = layout.training
        self.tp = t.tensor_model_parallel_size
        self.pp = t.pipeline_model_parallel_size
        self.tg = layout.generation.tensor_model_parallel_size
        self.etp = t.expert_tensor_size
        self._validate()
        self.tensors: list[PlannedTensor] = []
        for spec_index, spec in enumerate(self.specs):
            for hf_index, hf in enumerate(spec.hf_tensors):
                self.tensors.append(PlannedTensor(
                    len(self.tensors), spec_index, hf_index, hf, spec.tensor_parallel_dim, spec.pipeline_rank,
                    spec.expert_owner,
                ))
        if self.target in (ReshardTarget.FULL, ReshardTarget.STAGE):
            self.tensor_gather_size = self.tp
        else:
            self.tensor_gather_size = self.tp // self.tg if self.tg <= self.tp else 1
        self._steps_cache: dict[int, list[TensorSteps]] = {}

    def _validate(self) -> None:
        names: set[str] = set()
        vpp = self.layout.training.virtual_pipeline_stages
        for spec in self.specs:
            if not 0 <= spec.pipeline_rank < self.pp:
                raise LayoutError(
                    f"{spec.megatron_name}: pipeline_rank {spec.pipeline_rank} outside the {self.pp} pipeline stages"
                )
            if not 0 <= spec.virtual_pipeline_rank < vpp:
                raise LayoutError(
                    f"{spec.megatron_name}: virtual_pipeline_rank {spec.virtual_pipeline_rank} outside {vpp} chunks"
                )
            experts = self.layout.training.expert_model_parallel_size
            if spec.expert_owner is not None and not 0 <= spec.expert_owner < experts:
                raise LayoutError(f"{spec.megatron_name}: expert_owner {spec.expert_owner} outside {experts} expert ranks")
            split, key = self.tp, "tensor_model_parallel_size"
            if spec.expert_owner is not None:
                split, key = self.etp, "expert_tensor_parallel_size"
            check_divisible(spec, split, f"{key}={split}")
            own_padding = any(t.generation_padded_length not in (None, padded_length(t, spec.tensor_parallel_dim))
                              for t in spec.hf_tensors)
            if self.target is ReshardTarget.SHARDED and not own_padding:  # own padding: moved directly
                check_divisible(spec, lcm(split, self.tg), f"lcm of {key}={split} and "
                                                           f"rollout.tensor_model_parallel_size={self.tg}")
            for tensor in spec.hf_tensors:
                if tensor.generation_padded_length is not None and (
                        tensor.generation_padded_length % self.tg or tensor.generation_padded_length < tensor.shape[spec.tensor_parallel_dim]):
                    raise ValueError(f"{tensor.name}: the generation engine's padded length "
                                     f"{tensor.generation_padded_length} does not split into "
                                     f"rollout.tensor_model_parallel_size={self.tg} slices of its {tensor.shape[spec.tensor_parallel_dim]} rows")
            for hf in spec.hf_tensors:
                if hf.name in names:
                    raise ValueError(f"HF tensor {hf.name!r} is produced by two parameters; mark one as not exported")
                names.add(hf.name)

    # ------------------------------------------------------------------ per rank

    def need(self, tensor: PlannedTensor, rank: int) -> SliceRange:
        if self.target is ReshardTarget.STAGE and not self.sends_stage(tensor.pipeline_rank, rank):
            return SliceRange(0, 0)
        if tensor.dim is None or self.target in (ReshardTarget.FULL, ReshardTarget.STAGE):
            return chunk_range(tensor.layout, tensor.dim, 0, 1)
        g = self.layout.generation_coordinates(rank).tensor
        return chunk_range(tensor.layout, tensor.dim, g, self.tg, generation=True)

    def sends_stage(self, stage: int, rank: int) -> bool:
        """``STAGE``: whether ``rank`` assembles pipeline stage ``stage``'s tensors (data-parallel
        rank 0 of that stage, all its TP ranks)."""
        c = self.layout.training.coordinates(rank)
        return c.pipeline == stage and c.data == 0 and c.context == 0

    def direct(self, tensor: PlannedTensor) -> bool:
        """Whether ``tensor`` goes straight from its owners: an expert's at expert TP < TP, or for a
        SHARDED target with generation TP > TP (each rank needs a sub-slice of another stage's
        experts, which the expert phase could only complete with the owner's whole slice); and for a
        SHARDED target, a tensor the generation engine pads its own way (its generation slices do
        not line up with the training slices the TP all-gather moves)."""
        sharded = self.target is ReshardTarget.SHARDED
        if sharded and self.generation_padding_differs(tensor):
            return True
        return tensor.expert_owner is not None and (self.etp != self.tp or (sharded and self.tg > self.tp))

    @staticmethod
    def generation_padding_differs(tensor: PlannedTensor) -> bool:
        generation = tensor.layout.generation_padded_length
        return tensor.dim is not None and generation is not None and generation != padded_length(tensor.layout, tensor.dim)

    def hold(self, tensor: PlannedTensor, rank: int, *, after_expert_phase: bool = False) -> SliceRange | None:
        """The training slice ``rank`` holds (with ``after_expert_phase``: also another expert rank's)."""
        c = self.layout.training.coordinates(rank)
        if c.pipeline != tensor.pipeline_rank:
            return None
        if tensor.expert_owner not in (None, c.expert) and not after_expert_phase:
            return None
        # An expert's slice is its expert-TP rank's (the TP rank's when expert TP = TP).
        index, slices = (c.expert_tensor, self.etp) if tensor.expert_owner is not None else (c.tensor, self.tp)
        return chunk_range(tensor.layout, tensor.dim, index, slices if tensor.dim is not None else 1)

    def fingerprint_holder(self, tensor: PlannedTensor, rank: int) -> bool:
        """Whether ``rank``'s own slice of ``tensor`` goes into the export fingerprint (one rank per slice)."""
        c = self.layout.training.coordinates(rank)
        if tensor.expert_owner is not None:
            return c.expert == tensor.expert_owner and c.expert_data == 0
        return c.data == 0 and c.context == 0

    def _pipeline_receive_range(self, tensor: PlannedTensor, rank: int) -> SliceRange:
        """What a non-owner rank gets in phase 1: the part of its TP index's training slice it needs."""
        c = self.layout.training.coordinates(rank)
        if tensor.dim is None:
            return chunk_range(tensor.layout, None, 0, 1)
        return self.need(tensor, rank).intersect(chunk_range(tensor.layout, tensor.dim, c.tensor, self.tp))

    def steps(self, rank: int) -> list[TensorSteps]:
        """The steps of ``rank`` for every tensor, in streaming order."""
        if rank not in self._steps_cache:
            self._steps_cache[rank] = [self._tensor_steps(tensor, rank) for tensor in self.tensors]
        return self._steps_cache[rank]

    def _tensor_steps(self, tensor: PlannedTensor, rank: int) -> TensorSteps:
        if self.direct(tensor):
            return self._direct_steps(tensor, rank)
        training = self.layout.training
        c = training.coordinates(rank)
        owner = training.rank(c.tensor, c.context, c.data, tensor.pipeline_rank)
        need, local = self.need(tensor, rank), self.hold(tensor, rank)
        expert_receive, expert_sends = None, ()
        if tensor.expert_owner is not None and c.pipeline == tensor.pipeline_rank:
            stage_slice = self.hold(tensor, rank, after_expert_phase=True)
            peers = [training.expert_peer(rank, e) for e in range(training.expert_model_parallel_size)]
            if local is None and need.length > 0:
                expert_receive, local = (peers[tensor.expert_owner], stage_slice), stage_slice
            elif local is not None:
                expert_sends = tuple((peer, stage_slice) for peer in peers
                                     if peer != rank and self.need(tensor, peer).length > 0)
        others = [training.rank(c.tensor, c.context, c.data, stage)
                  for stage in range(self.pp) if stage != tensor.pipeline_rank]
        if self.target is ReshardTarget.STAGE:
            others = []  # each stage's tensors stay on that stage
        broadcast = receive = None
        sends: tuple[tuple[int, SliceRange], ...] = ()
        if others:
            ranges = {other: self._pipeline_receive_range(tensor, other) for other in others}
            if len(set(ranges.values())) == 1:
                broadcast = (owner, next(iter(ranges.values())))
            elif rank == owner:
                sends = tuple(ranges.items())
            else:
                receive = (owner, ranges[rank])
        gather: tuple[SliceRange, ...] = ()
        position = 0
        size = self.tensor_gather_size
        if tensor.dim is not None and size > 1 and need.length > 0:
            first = c.tensor // size * size
            gather = tuple(chunk_range(tensor.layout, tensor.dim, first + i, self.tp) for i in range(size))
            position = c.tensor - first
        return TensorSteps(tensor, need, local, broadcast, receive, sends, gather, position, expert_receive,
                           expert_sends)

    def _direct_receives(self, tensor: PlannedTensor, rank: int) -> tuple[tuple[int, SliceRange], ...]:
        """The pieces of ``tensor`` that ``rank`` needs and lacks, each from the owner of its slice at
        ``rank``'s expert-data rank (which spreads the senders over the expert-data replicas), or for
        a dense tensor at ``rank``'s data and context ranks."""
        training = self.layout.training
        c = training.coordinates(rank)
        need, held = self.need(tensor, rank), self.hold(tensor, rank)
        expert = tensor.expert_owner is not None
        slices = (self.etp if expert else self.tp) if tensor.dim is not None else 1
        pieces = []
        for index in range(slices):
            owned = chunk_range(tensor.layout, tensor.dim, index, slices)
            piece = tensor.real(need.intersect(owned))  # padding rows are never moved
            if piece.length > 0 and owned != held:
                source = (training.expert_rank(index, tensor.expert_owner, c.expert_data, tensor.pipeline_rank) if expert
                          else training.rank(index, c.context, c.data, tensor.pipeline_rank))
                pieces.append((source, piece))
        return tuple(pieces)

    def _direct_steps(self, tensor: PlannedTensor, rank: int) -> TensorSteps:
        training = self.layout.training
        c = training.coordinates(rank)
        local = self.hold(tensor, rank)
        sends: tuple[tuple[int, SliceRange], ...] = ()
        if local is not None:  # an owner: every rank of its expert-data (data) rank may take a piece of its slice
            peers = (self._ranks_of_expert_data[c.expert_data] if tensor.expert_owner is not None
                     else self._ranks_of_data[(c.data, c.context)])
            sends = tuple((peer, span) for peer in peers if peer != rank
                          for source, span in self._direct_receives(tensor, peer) if source == rank)
        return TensorSteps(tensor, self.need(tensor, rank), local, direct_receives=self._direct_receives(tensor, rank),
                           direct_sends=sends)

    @cached_property
    def _ranks_of_expert_data(self) -> dict[int, list[int]]:
        training = self.layout.training
        ranks: dict[int, list[int]] = {}
        for rank in range(training.world_size):
            ranks.setdefault(training.coordinates(rank).expert_data, []).append(rank)
        return ranks

    @cached_property
    def _ranks_of_data(self) -> dict[tuple[int, int], list[int]]:
        training = self.layout.training
        ranks: dict[tuple[int, int], list[int]] = {}
        for rank in range(training.world_size):
            c = training.coordinates(rank)
            ranks.setdefault((c.data, c.context), []).append(rank)
        return ranks

    # ------------------------------------------------------------------ bytes

    def _bytes(self, tensor: PlannedTensor, span: SliceRange | None) -> int:
        if span is None:
            return 0
        return span.length * tensor.row_elements() * self.element_size

    def staging_bytes(self, steps: TensorSteps) -> int:
        """Peak bytes the executor allocates for this tensor on this rank."""
        out = self._bytes(steps.tensor, steps.need)
        if steps.gather and steps.tensor.dim != 0:
            out *= 2  # slices gathered into a stacked buffer, then concatenated along dim
        # A slice this rank sends but does not keep goes out of a converted contiguous copy.
        outgoing = [span for _, span in steps.sends]
        if steps.broadcast is not None and steps.local is not None:
            outgoing.append(steps.broadcast[1])
        out += sum(self._bytes(steps.tensor, span) for span in outgoing if not self.sends_from_output(steps, span))
        if steps.expert_receive is not None:
            out += self._bytes(steps.tensor, steps.expert_receive[1])
        if steps.expert_sends:  # one converted copy serves every peer
            out += self._bytes(steps.tensor, steps.expert_sends[0][1])
        # Direct pieces land in a contiguous buffer where their part of the output is not one, and
        # leave from one copy per distinct range.
        out += sum(self._bytes(steps.tensor, span) for _, span in steps.direct_receives
                   if not self.contiguous_slot(steps, span))
        out += sum(self._bytes(steps.tensor, span) for span in {span for _, span in steps.direct_sends}
                   if not self.sends_from_output(steps, span))
        return out

    @staticmethod
    def contiguous_slot(steps: TensorSteps, span: SliceRange) -> bool:
        """Whether ``span``'s part of the output buffers is contiguous (gloo and NCCL move only those):
        rows along dim 0, the whole output, or one slice of the stacked gather buffer."""
        return steps.tensor.dim in (None, 0) or span == steps.need or span in steps.gather

    @classmethod
    def sends_from_output(cls, steps: TensorSteps, span: SliceRange) -> bool:
        """Whether a source sends ``span`` straight from its output buffers (else from a converted copy)."""
        return cls.within(span, steps.need) and cls.contiguous_slot(steps, span)

    @staticmethod
    def within(span: SliceRange, outer: SliceRange) -> bool:
        return outer.start <= span.start and span.stop <= outer.stop

    def traffic(self, rank: int) -> RankTraffic:
        """Predicted bytes of ``rank`` for one sync, with its lower bounds."""
        result = RankTraffic(rank)
        world_model_bytes = 0
        for steps in self.steps(rank):
            tensor = steps.tensor
            real_need, real_held = tensor.real(steps.need), tensor.real(steps.held) if steps.held else None
            overlap = real_need.intersect(real_held) if real_held else None
            result.output += self._bytes(tensor, real_need)
            result.held += self._bytes(tensor, real_held)
            result.lower_bound += self._bytes(tensor, real_need) - self._bytes(tensor, overlap)
            world_model_bytes += self._bytes(tensor, SliceRange(0, tensor.real_length))
            pipeline = tensor_phase = sent = expert = 0
            if steps.expert_receive is not None:
                expert += self._bytes(tensor, steps.expert_receive[1])
            sent += sum(self._bytes(tensor, span) for _, span in steps.expert_sends + steps.direct_sends)
            expert += sum(self._bytes(tensor, span) for _, span in steps.direct_receives)
            if steps.broadcast is not None:
                source, span = steps.broadcast
                if rank == source:
                    sent += self._bytes(tensor, span) * (self.pp - 1)
                else:
                    pipeline += self._bytes(tensor, span)
            if steps.receive is not None:
                pipeline += self._bytes(tensor, steps.receive[1])
            sent += sum(self._bytes(tensor, span) for _, span in steps.sends)
            if steps.gather:
                mine = self._bytes(tensor, steps.gather[steps.gather_position])
                tensor_phase += sum(self._bytes(tensor, span) for span in steps.gather) - mine
                sent += mine * (len(steps.gather) - 1)
            result.received += expert + pipeline + tensor_phase
            result.sent += sent
            result.by_phase["expert"] += expert
            result.by_phase["pipeline"] += pipeline
            result.by_phase["tensor"] += tensor_phase
        result.hybridflow_bound = (self.tp * self.pp - self.tg) / (self.tg * self.tp * self.pp) * world_model_bytes
        return result

    def model_bytes(self) -> int:
        """Real bytes of the whole HF model in the transfer dtype."""
        return sum(self._bytes(t, SliceRange(0, t.real_length)) for t in self.tensors)

    def template_ranks(self) -> list[int]:
        """The ranks of model-parallel group (dp 0, cp 0); every other group repeats their traffic."""
        t = self.layout.training
        return [t.rank(tp, 0, 0, pp) for pp in range(self.pp) for tp in range(self.tp)]

    def report(self) -> dict:
        """Per-rank predicted traffic against the lower bounds, for logs and benchmarks."""
        ranks = [self.traffic(rank) for rank in self.template_ranks()]
        worst = max(ranks, key=lambda r: r.received)
        bound = max(r.lower_bound for r in ranks)
        return {
            "layout": self.layout.describe(),
            "target": self.target.value,
            "model_bytes": self.model_bytes(),
            "max_received_bytes": worst.received,
            "max_lower_bound_bytes": bound,
            "received_over_lower_bound": worst.received / bound if bound else (1.0 if worst.received == 0 else math.inf),
            "hybridflow_bound_bytes": ranks[0].hybridflow_bound,
            "per_rank": [
                {"rank": r.rank, "received": r.received, "sent": r.sent, "lower_bound": r.lower_bound,
                 "output": r.output, "held": r.held, **{f"received_{k}": v for k, v in r.by_phase.items()}}
                for r in ranks
            ],
        }

    # ------------------------------------------------------------------ buckets

    def buckets(self, budget_bytes: int) -> list[list[int]]:
        """Consecutive tensor indices whose staging fits ``budget_bytes`` on every rank.

        The partition is the same on every rank (it uses the largest staging over the ranks of a
        model-parallel group), so every rank issues the same collectives between the same waits. A
        tensor larger than the budget gets a bucket of its own.
        """
        if budget_bytes <= 0:
            raise ValueError(f"bucket budget must be > 0 bytes, got {budget_bytes}")
        per_rank = [self.steps(rank) for rank in self.template_ranks()]
        cost = [max(self.staging_bytes(steps[i]) for steps in per_rank) for i in range(len(self.tensors))]
        buckets: list[list[int]] = []
        current: list[int] = []
        used = 0
        for index, size in enumerate(cost):
            if current and used + size > budget_bytes:
                buckets.append(current)
                current, used = [], 0
            current.append(index)
            used += size
        if current:
            buckets.append(current)
        return buckets
