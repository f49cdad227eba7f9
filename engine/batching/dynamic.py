"""Splitting a batch of sequences across data-parallel ranks and into micro-batches.

Two ways to form micro-batches:

- fixed: ``micro_batch_size`` sequences each, in order (``ppo_micro_batch_size_per_gpu``);
- dynamic (``use_dynamic_bsz``): as few micro-batches as a token budget allows
  (``ppo_max_token_len_per_gpu`` / ``log_prob_max_token_len_per_gpu``), sequences spread over
  them by the Karmarkar-Karp largest differencing method so every micro-batch holds about the
  same number of tokens.

Every function returns index lists into the batch; :func:`restore_order` puts per-part results
back in the original order.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from engine.batching.partition import karmarkar_karp, partition_sums
from parallel.state import device


def fixed_micro_batches(num_sequences: int, micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of ``micro_batch_size`` sequences (the last may be shorter)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    return [
        list(range(start, min(start + micro_batch_size, num_sequences)))
        for start in range(0, num_sequences, micro_batch_size)
    ]


def token_budget_micro_batches(
    seq_lengths: Sequence[int],
    max_tokens_per_micro_batch: int,
    *,
    min_num_micro_batches: int = 1,
    count_multiple_of: int = 1,
    sync_group: dist.ProcessGroup | None = None,
    config_key: str = "ppo_max_token_len_per_gpu",
) -> list[list[int]]:
    """Balanced micro-batches of at most ``max_tokens_per_micro_batch`` tokens each.

    Starts from ``ceil(total / budget)`` micro-batches and adds one until the Karmarkar-Karp
    partition fits the budget. With ``sync_group`` the count is the maximum over that group:
    pipeline stages exchange activations micro-batch by micro-batch, so every rank of a pipeline
    group must run the same number.

    Args:
        seq_lengths: token count of each sequence (after padding removal, if any).
        max_tokens_per_micro_batch: the token budget of one micro-batch.
        min_num_micro_batches: lower bound on the count.
        count_multiple_of: the count is rounded up to a multiple of this (the interleaved
            pipeline schedule needs a multiple of the pipeline size).
        sync_group: process group whose ranks must agree on the count (all-reduce MAX).
        config_key: the config key named in errors.

    Returns:
        Index lists, one per micro-batch, each ascending, ordered by first index.
    """
    if max_tokens_per_micro_batch < 1:
        raise ValueError(f"{config_key} must be >= 1, got {max_tokens_per_micro_batch}")
    lengths = [int(n) for n in seq_lengths]
    if not lengths:
        raise ValueError("token_budget_micro_batches needs at least one sequence")
    for index, length in enumerate(lengths):
        if length > max_tokens_per_micro_batch:
            raise ValueError(
                f"sequence {index} has {length} tokens, more than {config_key}="
                f"{max_tokens_per_micro_batch}; raise {config_key} to at least the longest "
                f"prompt + response length"
            )
    count = max(min_num_micro_batches, math.ceil(sum(lengths) / max_tokens_per_micro_batch))
    count = min(count, len(lengths))
    while max(partition_sums(lengths, karmarkar_karp(lengths, count))) > max_tokens_per_micro_batch:
        count += 1  # terminates: at len(lengths) parts every sequence is alone and fits
    count = -(-count // count_multiple_of) * count_multiple_of
    if sync_group is not None and dist.get_world_size(sync_group) > 1:
        agreed = torch.tensor([count], dtype=torch.long, device=device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=sync_group)
        count = int(agreed.item())
    if count > len(lengths):
        raise ValueError(
            f"{count} micro-batches are needed (pipeline agreement / multiple of "
            f"{count_multiple_of}) but this rank has only {len(lengths)} sequences; give each rank "
            "more sequences"
        )
    return karmarkar_karp(lengths, count)


def split_for_data_parallel(
    seq_lengths: Sequence[int], data_parallel_size: int, balance_tokens: bool
) -> list[list[int]]:
    """One index list per data-parallel rank, each with ``len / data_parallel_size`` sequences.

    ``balance_tokens`` spreads the tokens evenly (Karmarkar-Karp with equal counts); otherwise
    rank r gets the r-th consecutive slice.
    """
    num_sequences = len(seq_lengths)
    if num_sequences % data_parallel_size:
        raise ValueError(
            f"a batch of {num_sequences} sequences cannot be split evenly over "
            f"{data_parallel_size} data-parallel ranks; make the (mini-)batch size a multiple of it"
        )
    if balance_tokens:
        return karmarkar_karp([int(n) for n in seq_lengths], data_parallel_size, equal_size=True)
    share = num_sequences // data_parallel_size
    return [list(range(r * share, (r + 1) * share)) for r in range(data_parallel_size)]


def restore_order(parts: Sequence[torch.Tensor], indices: Sequence[Sequence[int]]) -> torch.Tensor:
    """Inverse of splitting: row j of ``parts[p]`` goes back to row ``indices[p][j]``."""
    flat = [i for part in indices for i in part]
    if sorted(flat) != list(range(len(flat))):
        raise ValueError("restore_order needs indices that form a permutation of 0..n-1")
    for part, part_indices in zip(parts, indices):
        if part.shape[0] != len(part_indices):
            raise ValueError(f"a part has {part.shape[0]} rows but {len(part_indices)} indices")
    stacked = torch.cat(list(parts), dim=0)
    inverse = torch.empty(len(flat), dtype=torch.long)
    inverse[torch.tensor(flat, dtype=torch.long)] = torch.arange(len(flat))
    return stacked[inverse.to(stacked.device)]

