"""Balanced partitioning, micro-batch formation and token layouts (single process)."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.batching import (
    fixed_micro_batches,
    karmarkar_karp,
    left_align_sequences,
    next_token_labels,
    pack_sequences,
    packing_alignment,
    partition_sums,
    restore_order,
    split_for_data_parallel,
    token_budget_micro_batches,
)


def _best_two_way_spread(weights):
    total = sum(weights)
    best = total
    for mask in itertools.product([0, 1], repeat=len(weights)):
        part = sum(w for w, m in zip(weights, mask) if m)
        best = min(best, abs(total - 2 * part))
    return best


def test_karmarkar_karp_is_a_partition_and_near_optimal():
    generator = torch.Generator().manual_seed(0)
    for trial in range(20):
        weights = torch.randint(1, 100, (10,), generator=generator).tolist()
        parts = karmarkar_karp(weights, 2)
        assert sorted(i for p in parts for i in p) == list(range(10))
        sums = partition_sums(weights, parts)
        # LDM is not always optimal, but on 10 items within a few units of the exact optimum.
        assert abs(sums[0] - sums[1]) <= _best_two_way_spread(weights) + 10


def test_karmarkar_karp_beats_round_robin_on_skewed_lengths():
    weights = [1000, 900, 30, 20, 10, 10, 5, 5, 800, 700, 3, 2]
    parts = karmarkar_karp(weights, 4)
    sums = partition_sums(weights, parts)
    round_robin = partition_sums(weights, [list(range(r, len(weights), 4)) for r in range(4)])
    assert max(sums) - min(sums) < max(round_robin) - min(round_robin)
    assert max(sums) <= 1000 + 30  # the largest item dominates one part; nothing piles on it


def test_karmarkar_karp_equal_size_and_determinism():
    weights = [5, 1, 9, 3, 3, 8, 2, 7]
    parts = karmarkar_karp(weights, 4, equal_size=True)
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert parts == karmarkar_karp(list(weights), 4, equal_size=True)
    with pytest.raises(ValueError, match="divisible"):
        karmarkar_karp(weights, 3, equal_size=True)


def test_token_budget_respects_budget_and_minimises_count():
    lengths = [7, 3, 12, 5, 9, 1, 4, 11]
    parts = token_budget_micro_batches(lengths, 16)
    assert all(s <= 16 for s in partition_sums(lengths, parts))
    assert len(parts) == 4  # 52 tokens need at least ceil(52 / 16) = 4
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert len(token_budget_micro_batches(lengths, 16, count_multiple_of=3)) == 6
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu=10"):
        token_budget_micro_batches(lengths, 10)


def test_fixed_and_data_parallel_splits_and_restore_order():
    assert fixed_micro_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert split_for_data_parallel([1] * 4, 2, balance_tokens=False) == [[0, 1], [2, 3]]
    balanced = split_for_data_parallel([10, 1, 9, 2], 2, balance_tokens=True)
    assert partition_sums([10, 1, 9, 2], balanced) == [11, 11]
    with pytest.raises(ValueError, match="data-parallel"):
        split_for_data_parallel([1] * 5, 2, balance_tokens=False)
    values = torch.arange(10.0).reshape(5, 2)
    parts = [[3, 0], [4, 1, 2]]
    pieces = [values[torch.tensor(p)] for p in parts]
    assert torch.equal(restore_order(pieces, parts), values)


def _padded_batch():
    input_ids = torch.arange(1, 25).reshape(3, 8)
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0, 0]])
    return input_ids, attention_mask


@pytest.mark.parametrize("alignment", [1, 4])
def test_pack_sequences_layout_mask_and_unpack(alignment):
    input_ids, attention_mask = _padded_batch()
    packed = pack_sequences(input_ids, attention_mask, alignment=alignment, pad_token_id=0)
    lengths = [4, 8, 2]
    aligned = [-(-n // alignment) * alignment for n in lengths]
    assert packed.cu_seqlens.tolist() == [0, *itertools.accumulate(aligned)]
    assert packed.max_seqlen == max(aligned)
    real = packed.input_ids[0][packed.input_ids[0] != 0].tolist()
    assert real == input_ids[attention_mask.bool()].tolist()
    # Block-causal mask, checked against a loop over (query, key) pairs.
    mask = packed.block_causal_mask()[0, 0]
    segment = [s for s, n in enumerate(aligned) for _ in range(n)]
    for q in range(mask.shape[0]):
        for k in range(mask.shape[1]):
            assert bool(mask[q, k]) == (not (segment[q] == segment[k] and k <= q))
    # unpack puts every token back where it was; padding gets the fill value.
    restored = packed.unpack(packed.input_ids[..., None].float(), fill_value=-1)[..., 0]
    expected = torch.where(attention_mask.bool(), input_ids.float(), torch.tensor(-1.0))
    assert torch.equal(restored, expected)


def test_left_align_and_padded_to():
    input_ids, attention_mask = _padded_batch()
    layout = left_align_sequences(input_ids, attention_mask, alignment=4)
    assert layout.input_ids.shape == (3, 8)
    assert layout.input_ids[0].tolist() == [3, 4, 5, 6, 0, 0, 0, 0]
    assert layout.input_ids[2, :2].tolist() == [20, 21]
    restored = layout.unpack(layout.input_ids.float(), fill_value=0)
    assert torch.equal(restored, (input_ids * attention_mask).float())
    labels = next_token_labels(layout.input_ids)
    assert labels[0, :3].tolist() == [4, 5, 6]

    packed = pack_sequences(input_ids, attention_mask)
    bigger = packed.padded_to(1, packed.input_ids.shape[1] + 3)
    assert bigger.cu_seqlens.tolist() == packed.cu_seqlens.tolist() + [packed.input_ids.shape[1] + 3]
    assert torch.equal(bigger.unpack(bigger.input_ids.float()), packed.unpack(packed.input_ids.float()))
    with pytest.raises(ValueError):
        packed.padded_to(2, 20)


def test_packing_alignment_and_bad_input():
    assert packing_alignment(4, 1, sequence_parallel=False) == 1
    assert packing_alignment(4, 1, sequence_parallel=True) == 4
    assert packing_alignment(2, 2, sequence_parallel=True) == 8
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        pack_sequences(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [0, 0, 0]]))
