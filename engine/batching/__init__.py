"""Batching for the training roles: balanced partitioning, dynamic micro-batches, THD packing."""

from engine.batching.dynamic import (
    fixed_micro_batches,
    restore_order,
    split_for_data_parallel,
    token_budget_micro_batches,
)
from engine.batching.packing import (
    TokenLayout,
    left_align_sequences,
    next_token_labels,
    pack_sequences,
    packing_alignment,
)
from engine.batching.partition import karmarkar_karp, partition_sums

__all__ = [
    "TokenLayout",
    "fixed_micro_batches",
    "karmarkar_karp",
    "left_align_sequences",
    "next_token_labels",
    "pack_sequences",
    "packing_alignment",
    "partition_sums",
    "restore_order",
    "split_for_data_parallel",
    "token_budget_micro_batches",
]
