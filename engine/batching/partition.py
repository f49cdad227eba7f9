"""Balanced k-way partitioning of sequence lengths: the Karmarkar-Karp largest differencing method.

Used to spread sequences over data-parallel ranks and over micro-batches so that every part
carries about the same number of tokens (the step time of a rank is set by its heaviest part).

Largest differencing method (Karmarkar & Karp 1982, k-way form of Michiels et al. 2007): every
item starts as a *state* of k subsets (the item alone in one subset, the others empty). Repeatedly
take the two states whose spread (largest minus smallest subset sum) is largest and merge them,
joining the heaviest subset of one with the lightest of the other, the second heaviest with the
second lightest, and so on. Merging the largest spreads first lets them cancel each other; the
last remaining state is the partition.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Sequence


@dataclass
class _State:
    # k subsets, each a (sum, item indices) pair, kept sorted by sum, heaviest first.
    subsets: list[tuple[int, list[int]]]

    @property
    def spread(self) -> int:
        return self.subsets[0][0] - self.subsets[-1][0]

    def merge(self, other: "_State") -> "_State":
        # Heaviest of self with lightest of other, and so on down.
        joined = [
            (sum_a + sum_b, items_a + items_b)
            for (sum_a, items_a), (sum_b, items_b) in zip(self.subsets, reversed(other.subsets))
        ]
        joined.sort(key=lambda subset: (-subset[0], min(subset[1], default=-1)))
        return _State(joined)


def karmarkar_karp(
    weights: Sequence[int], num_partitions: int, equal_size: bool = False
) -> list[list[int]]:
    """Split item indices ``0..len(weights)-1`` into ``num_partitions`` parts of near-equal weight.

    Args:
        weights: non-negative item weights (token counts of sequences).
        num_partitions: k, the number of parts.
        equal_size: every part gets exactly ``len(weights) / k`` items (needs divisibility):
            items are then seeded k at a time (sorted by weight), one per subset, so merges
            keep the counts equal.

    Returns:
        k lists of item indices, each sorted ascending; the lists are ordered by their smallest
        index (empty parts last). Deterministic for a given input.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if any(w < 0 for w in weights):
        raise ValueError(f"weights must be non-negative, got {list(weights)[:8]}...")
    if equal_size and len(weights) % num_partitions:
        raise ValueError(
            f"equal_size partitioning of {len(weights)} items into {num_partitions} parts needs "
            f"the item count to be divisible by the part count"
        )
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    states: list[_State] = []
    if equal_size:
        for start in range(0, len(order), num_partitions):
            group = order[start:start + num_partitions]
            states.append(_State(sorted(((weights[i], [i]) for i in group), key=lambda s: (-s[0], s[1]))))
    else:
        for i in order:
            states.append(_State([(weights[i], [i])] + [(0, []) for _ in range(num_partitions - 1)]))
    if not states:
        return [[] for _ in range(num_partitions)]

    tie_breaker = itertools.count()
    heap = [(-state.spread, next(tie_breaker), state) for state in states]
    heapq.heapify(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = first.merge(second)
        heapq.heappush(heap, (-merged.spread, next(tie_breaker), merged))
    parts = [sorted(items) for _, items in heap[0][2].subsets]
    return sorted(parts, key=lambda items: (not items, items[0] if items else 0))


def partition_sums(weights: Sequence[int], parts: Sequence[Sequence[int]]) -> list[int]:
    """Total weight of each part (for balance reports and tests)."""
    return [sum(weights[i] for i in part) for part in parts]
