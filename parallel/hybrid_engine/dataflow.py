"""Generation-side data flow: a training DP rank's prompts over its micro-DP generation replicas.

Every rank of training data-parallel rank d (all its pipeline, tensor and context ranks) starts
with d's batch, as megatron's data loader gives it. For generation the batch is cut into
contiguous, balanced parts, one per generation replica of d (``micro_data_parallel`` coordinate);
all TP ranks of a replica get the same part. Afterwards the replicas' results are gathered inside
d's group so that every rank of d holds d's whole batch again, in the original order. Only
generation TP rank 0 of each replica contributes its results, so no rank sends or holds more than
d's batch.
"""

from __future__ import annotations

from typing import Any, Sequence, TypeVar

import torch
import torch.distributed as dist

from parallel.hybrid_engine.layouts import HybridEngineGroups, HybridLayout

Item = TypeVar("Item")


def replica_slice(num_items: int, num_replicas: int, replica: int) -> slice:
    """Contiguous balanced part ``replica`` of ``num_items`` (the first parts take the remainder)."""
    base, extra = divmod(num_items, num_replicas)
    start = replica * base + min(replica, extra)
    return slice(start, start + base + (1 if replica < extra else 0))


def split_for_generation(items: Sequence[Item], layout: HybridLayout, rank: int) -> list[Item]:
    """The part of this DP rank's ``items`` (prompts) that ``rank``'s generation replica serves."""
    coordinates = layout.generation_coordinates(rank)
    return list(items[replica_slice(len(items), layout.replicas_per_data_parallel_rank,
                                    coordinates.micro_data_parallel)])


def _leaders_in_order(groups: HybridEngineGroups) -> list[int]:
    """Positions in the micro-DP group of each replica's generation TP rank 0, by micro-DP rank."""
    layout = groups.layout
    leaders = {}
    for position, member in enumerate(groups.micro_data_parallel_ranks):
        coordinates = layout.generation_coordinates(member)
        if coordinates.tensor == 0:
            leaders[coordinates.micro_data_parallel] = position
    return [leaders[micro] for micro in sorted(leaders)]


def gather_generation_results(local_results: Sequence[Any], groups: HybridEngineGroups) -> list[Any]:
    """Concatenate the replicas' results (picklable objects) on every rank of the DP rank.

    ``local_results``: this replica's results for its ``split_for_generation`` part (the same on
    all its TP ranks; only TP rank 0's copy travels).
    """
    layout = groups.layout
    is_leader = layout.generation_coordinates(groups.rank).tensor == 0
    gathered: list[Any] = [None] * len(groups.micro_data_parallel_ranks)
    # On the control group (gloo): the other ranks wait here while the leaders generate.
    dist.all_gather_object(gathered, list(local_results) if is_leader else None,
                           group=groups.micro_data_parallel_control)
    return [item for position in _leaders_in_order(groups) for item in gathered[position]]


def gather_generation_tensors(local: torch.Tensor, groups: HybridEngineGroups) -> torch.Tensor:
    """Concatenate along dim 0 the replicas' tensors (e.g. padded response ids) on every rank of
    the DP rank. Row counts may differ between replicas; other dims, dtype and device must match.
    """
    layout = groups.layout
    is_leader = layout.generation_coordinates(groups.rank).tensor == 0
    members = len(groups.micro_data_parallel_ranks)
    rows = torch.tensor([local.shape[0] if is_leader else 0], dtype=torch.long, device=local.device)
    all_rows = [torch.zeros_like(rows) for _ in range(members)]
    dist.all_gather(all_rows, rows, group=groups.micro_data_parallel)
    counts = [int(r.item()) for r in all_rows]
    # One broadcast per replica leader, of exactly its rows: nobody receives padding or copies.
    parts = []
    for position in _leaders_in_order(groups):
        source = groups.micro_data_parallel_ranks[position]
        if source == groups.rank:
            buffer = local.contiguous()
        else:
            buffer = local.new_empty((counts[position], *local.shape[1:]))
        dist.broadcast(buffer, src=source, group=groups.micro_data_parallel)
        parts.append(buffer)
    return torch.cat(parts, dim=0)
