"""Runs a ReshardPlan bucket by bucket and yields what each generation rank receives.

Per bucket: every rank copies (and converts to the transfer dtype, once) the slices it holds into
the output buffers, then phase 1 (pipeline broadcast / point-to-point) and phase 2 (all-gather in
the TP block) fill in the rest. Collectives are issued with ``async_op=True``; with ``overlap``
the next bucket's phase 1 is in flight while the caller pushes the current bucket into the rollout
engine. The bucket partition is the same on every rank, so all ranks issue the same collectives
between the same waits. The point-to-point transfers of a phase go out together, as one
``batch_isend_irecv``: NCCL groups them on the world's communicator, where separate ``isend`` /
``irecv`` calls would open a communicator for every pair of ranks that ever exchange a slice (slime
batches its weight-update P2P the same way); gloo runs the same list one by one.

Memory: the executor allocates only the buckets' output buffers plus, per tensor, at most one
temporary (a stacked buffer for slices along dim 1, a converted copy of a slice it sends but does
not keep). With ``overlap`` two buckets of half the budget are alive at once, so the extra memory
stays within ``bucket_megabytes`` plus one tensor larger than a bucket. It is counted exactly in
``ReshardStats.peak_staging_bytes`` (and measured by the allocator on GPU). The caller must drop
a bucket's tensors before asking for the next one (``push_weights`` copies them into the engine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from parallel.hybrid_engine.integrity import tensor_fingerprint
from parallel.hybrid_engine.layouts import HybridEngineGroups
from parallel.hybrid_engine.plan import ReshardPlan, TensorSteps
from parallel.hybrid_engine.spec import ParameterSpec, SliceRange, hf_chunks_of_shard

# The world group, once it has run an operation of all its ranks here (see iter_buckets).
_world_groups_used: list = []

# local_shard(spec) -> this rank's Megatron tensor for ``spec`` (called on its owner stage only).
LocalShardFn = Callable[[ParameterSpec], torch.Tensor]


@dataclass
class WeightShard:
    """What a generation rank receives for one HF tensor.

    ``tensor`` covers rows [start, start + tensor.shape[dim]) of the HF tensor along ``dim``;
    with ``ReshardTarget.FULL`` it is the whole tensor (``dim`` may still name the TP dimension,
    ``start`` is 0). ``dim`` None: a replicated tensor, always whole.
    """

    name: str
    tensor: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int | None
    start: int

    @property
    def is_full(self) -> bool:
        return tuple(self.tensor.shape) == tuple(self.full_shape)


@dataclass
class ReshardStats:
    """Measured by the executor during one sync (bytes in the transfer dtype)."""

    num_tensors: int = 0
    num_buckets: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    bytes_output: int = 0
    peak_staging_bytes: int = 0
    # torch.cuda.max_memory_allocated() above the allocation at the start (GPU only).
    device_peak_extra_bytes: int | None = None
    seconds: float = 0.0


class _Staging:
    """Output buffers and temporaries of one tensor on this rank."""

    def __init__(self, steps: TensorSteps) -> None:
        self.steps = steps
        self.stacked: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.temporaries: list[torch.Tensor] = []
        # (received buffer, output view) pairs copied once the transfers are complete.
        self.copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def slot(self, span: SliceRange) -> torch.Tensor:
        """The (contiguous) part of the output buffers that receives ``span``."""
        steps = self.steps
        if self.stacked is not None:
            return self.stacked[steps.gather.index(span)]
        if steps.tensor.dim is None:
            return self.out
        return self.out.narrow(steps.tensor.dim, span.start - steps.need.start, span.length)


class ReshardExecutor:
    """Executes ``plan`` on this rank with ``groups`` (from ``layouts.build_groups``)."""

    def __init__(
        self,
        plan: ReshardPlan,
        groups: HybridEngineGroups,
        local_shard: LocalShardFn,
        device: torch.device | str = "cpu",
    ) -> None:
        if groups.layout != plan.layout:
            raise ValueError("the groups were built for another layout than the plan")
        self.plan = plan
        self.groups = groups
        self.local_shard = local_shard
        self.device = torch.device(device)
        self.rank = groups.rank
        self.steps = plan.steps(self.rank)
        self._tensor_rank = plan.layout.training.coordinates(self.rank).tensor
        self.stats = ReshardStats()
        self.expected_fingerprints: dict[str, torch.Tensor] | None = None
        self._live_bytes = 0
        self._outputs: list[torch.Tensor] = []

    # ------------------------------------------------------------------ public

    def iter_buckets(
        self, bucket_megabytes: float, overlap: bool = True, fingerprints: bool = False
    ) -> Iterator[list[WeightShard]]:
        """Yield this rank's received tensors bucket by bucket (collective over the world).

        ``fingerprints``: also compute the trainer-side fingerprint of every HF tensor from the
        training shards (one small all-reduce at the end) into ``expected_fingerprints``.
        """
        if not bucket_megabytes > 0:
            raise ValueError(f"rollout.update_weights_bucket_megabytes={bucket_megabytes!r} must be > 0")
        if dist.group.WORLD not in _world_groups_used:
            # NCCL makes a group's communicator at the group's first operation, which must then
            # involve every rank; a batch of point-to-point operations between some ranks would
            # leave that undefined (torch's batch_isend_irecv docs; slime runs a world barrier
            # first). One element reduced over the world, with the rest of this data plane.
            dist.all_reduce(torch.zeros(1, device=self.device))
            _world_groups_used[:] = [dist.group.WORLD]
        budget = int(bucket_megabytes * 1024 * 1024) // (2 if overlap else 1)
        buckets = self.plan.buckets(max(1, budget))
        self.stats = ReshardStats(num_buckets=len(buckets))
        self._live_bytes = 0
        fingerprint_rows = (torch.zeros(len(self.plan.tensors), 5, dtype=torch.float64, device=self.device)
                            if fingerprints else None)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        start = time.perf_counter()
        pending = self._start(buckets[0], fingerprint_rows) if buckets else None
        for number in range(len(buckets)):
            shards = self._finish(pending)
            following = number + 1 < len(buckets)
            pending = self._start(buckets[number + 1], fingerprint_rows) if overlap and following else None
            yield shards
            self._release_outputs()
            del shards
            if not overlap and following:
                pending = self._start(buckets[number + 1], fingerprint_rows)
        if fingerprint_rows is not None:
            dist.all_reduce(fingerprint_rows)
            self.expected_fingerprints = {
                tensor.name: fingerprint_rows[tensor.index].cpu() for tensor in self.plan.tensors
            }
        self.stats.seconds = time.perf_counter() - start
        if on_gpu:
            self.stats.device_peak_extra_bytes = torch.cuda.max_memory_allocated(self.device) - base

    # ------------------------------------------------------------------ buffers

    def _allocate(self, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=self.plan.dtype, device=self.device)
        self._live_bytes += tensor.numel() * tensor.element_size()
        self.stats.peak_staging_bytes = max(self.stats.peak_staging_bytes, self._live_bytes)
        return tensor

    def _free(self, tensor: torch.Tensor) -> None:
        self._live_bytes -= tensor.numel() * tensor.element_size()

    def _converted(self, source: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of ``source`` in the transfer dtype, counted as staging."""
        copy = self._allocate(tuple(source.shape))
        copy.copy_(source)
        return copy

    def _release_outputs(self) -> None:
        for backing in self._outputs:
            self._free(backing)
        self._outputs = []

    # ------------------------------------------------------------------ phases

    def _start(self, bucket: list[int], fingerprint_rows: torch.Tensor | None) -> dict:
        """Allocate outputs, copy local slices, issue phase 1 (and phase 2 where no phase 1 is due)."""
        stagings: list[_Staging] = []
        chunks_by_spec: dict[int, list[torch.Tensor]] = {}
        handles, point_to_point = [], []
        early_gathers = []
        received = self._expert_phase(bucket, chunks_by_spec)
        for index in bucket:
            steps = self.steps[index]
            tensor = steps.tensor
            if steps.need.length == 0 and not steps.direct_sends:  # STAGE off the tensor's stage: nothing to do
                if steps.held is not None and fingerprint_rows is not None:
                    self._fingerprint_local(steps, self._held_chunk(steps, chunks_by_spec), fingerprint_rows)
                continue
            staging = _Staging(steps)
            if steps.gather and tensor.dim != 0:
                chunk_shape = tensor.slice_shape(steps.gather[0])
                staging.stacked = self._allocate((len(steps.gather), *chunk_shape))
            else:
                staging.out = self._allocate(tensor.slice_shape(steps.need))
            local_chunk = None
            if steps.local is not None:
                if index in received:
                    local_chunk = received[index]
                    staging.temporaries.append(local_chunk)
                else:
                    local_chunk = self._held_chunk(steps, chunks_by_spec)
                self._check_local_shape(steps, local_chunk)
                kept = steps.need.intersect(steps.local)
                if kept.length > 0:
                    staging.slot(kept).copy_(self._narrow(steps, local_chunk, steps.local, kept))
                if fingerprint_rows is not None and steps.held is not None:
                    self._fingerprint_local(steps, local_chunk, fingerprint_rows)
            handles.extend(self._issue_pipeline(staging, local_chunk, point_to_point))
            self._issue_direct(staging, local_chunk, point_to_point)
            if steps.gather and not steps.receives_in_pipeline_phase:
                early_gathers.append(staging)
            stagings.append(staging)
        handles.extend(_batched(point_to_point))
        for staging in early_gathers:
            handles.append(self._issue_gather(staging))
        return {"stagings": stagings, "handles": handles, "early": {id(s) for s in early_gathers}}

    def _held_chunk(self, steps: TensorSteps, chunks_by_spec: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """This rank's own training slice of the tensor (a view of its parameter)."""
        index = steps.tensor.spec_index
        if index not in chunks_by_spec:
            spec = self.plan.specs[index]
            chunks_by_spec[index] = hf_chunks_of_shard(spec, self.local_shard(spec).detach())
        return chunks_by_spec[index][steps.tensor.hf_index]

    def _expert_phase(self, bucket: list[int], chunks_by_spec: dict) -> dict[int, torch.Tensor]:
        """Send the experts this rank holds to the expert ranks that need them and receive the others
        (point-to-point, posted in bucket order on both sides, complete before phase 1)."""
        point_to_point, copies, received = [], [], {}
        element = self.plan.element_size
        for index in bucket:
            steps = self.steps[index]
            if steps.expert_sends:
                copy = self._converted(self._held_chunk(steps, chunks_by_spec))
                copies.append(copy)
                for destination, _ in steps.expert_sends:
                    point_to_point.append(dist.P2POp(dist.isend, copy, destination))
                    self.stats.bytes_sent += copy.numel() * element
            if steps.expert_receive is not None:
                source, span = steps.expert_receive
                buffer = self._allocate(steps.tensor.slice_shape(span))
                point_to_point.append(dist.P2POp(dist.irecv, buffer, source))
                self.stats.bytes_received += buffer.numel() * element
                received[index] = buffer
        for handle in _batched(point_to_point):
            handle.wait()
        for copy in copies:
            self._free(copy)
        return received

    def _finish(self, pending: dict) -> list[WeightShard]:
        for handle in pending["handles"]:
            handle.wait()
        late = [s for s in pending["stagings"] if s.steps.gather and id(s) not in pending["early"]]
        for handle in [self._issue_gather(staging) for staging in late]:
            handle.wait()
        shards = []
        for staging in pending["stagings"]:
            for received, view in staging.copy_back:
                view.copy_(received)
            for temporary in staging.temporaries:
                self._free(temporary)
            if staging.steps.need.length == 0:  # an owner that only sent (STAGE target)
                self._free(staging.out)
                continue
            shards.append(self._assemble(staging))
        self.stats.num_tensors += len(shards)
        return shards

    def _issue_pipeline(self, staging: _Staging, local_chunk: torch.Tensor | None, point_to_point: list) -> list:
        """Issues the pipeline broadcast (returns its handle); adds the sends and the receive to
        ``point_to_point``."""
        steps = staging.steps
        handles = []
        element = self.plan.element_size
        if steps.broadcast is not None:
            source, span = steps.broadcast
            if self.rank == source:
                buffer = self._outgoing(staging, local_chunk, span)
                self.stats.bytes_sent += buffer.numel() * element * (len(self.groups.pipeline_ranks) - 1)
            else:
                buffer = staging.slot(span)
                self.stats.bytes_received += buffer.numel() * element
            handles.append(dist.broadcast(buffer, src=source, group=self.groups.pipeline, async_op=True))
        for destination, span in steps.sends:
            buffer = self._outgoing(staging, local_chunk, span)
            self.stats.bytes_sent += buffer.numel() * element
            point_to_point.append(dist.P2POp(dist.isend, buffer, destination))
        if steps.receive is not None:
            source, span = steps.receive
            buffer = staging.slot(span)
            self.stats.bytes_received += buffer.numel() * element
            point_to_point.append(dist.P2POp(dist.irecv, buffer, source))
        return handles

    def _issue_direct(self, staging: _Staging, local_chunk: torch.Tensor | None, point_to_point: list) -> None:
        """Point-to-point pieces of an expert sent straight from its owners (``ReshardPlan.direct``),
        added to ``point_to_point``."""
        steps = staging.steps
        element = self.plan.element_size
        outgoing: dict[SliceRange, torch.Tensor] = {}  # one buffer per distinct range
        for destination, span in steps.direct_sends:
            if span not in outgoing:
                outgoing[span] = self._outgoing(staging, local_chunk, span)
            self.stats.bytes_sent += outgoing[span].numel() * element
            point_to_point.append(dist.P2POp(dist.isend, outgoing[span], destination))
        for source, span in steps.direct_receives:
            buffer = staging.slot(span)
            if not ReshardPlan.contiguous_slot(steps, span):  # gloo and NCCL take contiguous buffers
                buffer = self._allocate(steps.tensor.slice_shape(span))
                staging.temporaries.append(buffer)
                staging.copy_back.append((buffer, staging.slot(span)))
            self.stats.bytes_received += buffer.numel() * element
            point_to_point.append(dist.P2POp(dist.irecv, buffer, source))

    def _outgoing(self, staging: _Staging, local_chunk: torch.Tensor, span: SliceRange) -> torch.Tensor:
        """The buffer a source sends ``span`` from: its own output slot, or a converted copy."""
        steps = staging.steps
        if ReshardPlan.sends_from_output(steps, span):
            return staging.slot(span)
        copy = self._converted(self._narrow(steps, local_chunk, steps.local, span))
        staging.temporaries.append(copy)
        return copy

    def _issue_gather(self, staging: _Staging):
        steps = staging.steps
        element = self.plan.element_size
        mine = staging.slot(steps.gather[steps.gather_position])
        members = len(steps.gather)
        self.stats.bytes_received += mine.numel() * element * (members - 1)
        self.stats.bytes_sent += mine.numel() * element * (members - 1)
        # The gather block's slices are the whole output (or the stacked buffer), in member order.
        # (gloo takes only the "concatenated along dim 0" form of the output, not the stacked one)
        output = staging.stacked.flatten(0, 1) if staging.stacked is not None else staging.out
        return dist.all_gather_into_tensor(output, mine, group=self.groups.tensor_gather, async_op=True)

    def _assemble(self, staging: _Staging) -> WeightShard:
        """The real (unpadded) part of the output, contiguous; padding rows sit at the end."""
        steps = staging.steps
        tensor, dim = steps.tensor, steps.tensor.dim
        real = tensor.real(steps.need)
        if staging.stacked is not None:
            pieces = [staging.stacked[i].narrow(dim, 0, tensor.real(span).length)
                      for i, span in enumerate(steps.gather)]
            result = self._allocate(tensor.slice_shape(real))
            torch.cat(pieces, dim=dim, out=result)
            self._free(staging.stacked)
            backing = result
        elif dim is None:
            result = backing = staging.out
        elif dim == 0 or real.length == steps.need.length:
            result, backing = staging.out.narrow(dim, 0, real.length), staging.out  # a prefix view
        else:
            result = self._allocate(tensor.slice_shape(real))
            result.copy_(staging.out.narrow(dim, 0, real.length))
            self._free(staging.out)
            backing = result
        self._outputs.append(backing)
        self.stats.bytes_output += result.numel() * self.plan.element_size
        start = real.start if real.length > 0 else min(steps.need.start, tensor.real_length)
        return WeightShard(tensor.name, result, tensor.layout.shape, dim, start)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _narrow(steps: TensorSteps, chunk: torch.Tensor, chunk_span: SliceRange, span: SliceRange) -> torch.Tensor:
        if steps.tensor.dim is None:
            return chunk
        return chunk.narrow(steps.tensor.dim, span.start - chunk_span.start, span.length)

    def _check_local_shape(self, steps: TensorSteps, chunk: torch.Tensor) -> None:
        expected = steps.tensor.slice_shape(steps.local)
        if tuple(chunk.shape) != expected:
            spec = self.plan.specs[steps.tensor.spec_index]
            raise ValueError(
                f"{spec.megatron_name} -> {steps.tensor.name}: this rank's slice has shape {tuple(chunk.shape)}, "
                f"the plan expects {expected} (training layout or padding differs from the model?)"
            )

    def _fingerprint_local(self, steps: TensorSteps, chunk: torch.Tensor, rows: torch.Tensor) -> None:
        """Add this rank's real rows to the export fingerprint (one primary holder per slice)."""
        tensor = steps.tensor
        if not self.plan.fingerprint_holder(tensor, self.rank) or (tensor.dim is None and self._tensor_rank != 0):
            return
        real = tensor.real(steps.local)
        if real.length == 0:
            return
        part = self._narrow(steps, chunk, steps.local, real)
        rows[tensor.index] += tensor_fingerprint(
            part, dim=tensor.dim, start=real.start if tensor.dim is not None else 0, dtype=self.plan.dtype
        ).to(rows.device)


def _batched(point_to_point: list) -> list:
    """Issue a phase's point-to-point operations as one batch; their handles."""
    return dist.batch_isend_irecv(point_to_point) if point_to_point else []
