"""Weight-sync integrity: cheap additive fingerprints of HF tensors, compared by name.

A fingerprint is five float64 numbers of a tensor x seen as a matrix (rows along dim 0, the other
dims flattened into columns):

    sum x,  sum |x|,  sum x^2,  sum_r a(r) * rowsum_r(x),  sum_c b(c) * colsum_c(x)

with position weights a(r) = 1 + r mod 1009 and b(c) = 1 + c mod 1013. The weighted sums catch
what plain sums miss: rows or column blocks in the wrong order (a misplaced TP slice, a wrong
q/k/v interleave). All five are additive over disjoint slices once the slice's offset is known, so
the trainer can fingerprint its training shards where they are and all-reduce, without gathering
a tensor anywhere; the engine side fingerprints what it holds.

It is a sum, not a hash: a flipped low-order bit of one element in a large tensor can hide below
float64 rounding. It exists to catch wrong layouts, stale or missing tensors, dtype mistakes.
"""

from __future__ import annotations

from typing import Mapping

import torch

FINGERPRINT_FIELDS = ("sum", "abs_sum", "sum_sq", "row_weighted", "col_weighted")
_ROW_PERIOD, _COL_PERIOD = 1009, 1013
# Elements converted to float64 at a time: bounds the fingerprint's extra memory.
_BLOCK_ELEMENTS = 1 << 22


class WeightSyncError(RuntimeError):
    """The rollout engine's weights differ from the trainer's; the message names the tensors."""


def tensor_fingerprint(
    tensor: torch.Tensor, dim: int | None = None, start: int = 0, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Fingerprint (float64 tensor of 5) of ``tensor``, a slice starting at ``start`` along ``dim``
    of a larger HF tensor (dim None or 0: rows; dim 1: columns of a 2-D tensor). ``dtype``: round to
    this dtype first (the transfer dtype), as the receiver will see the values.
    """
    if dim not in (None, 0, 1):
        raise ValueError(f"fingerprints of slices along dim {dim} are not supported (dims 0 and 1 only)")
    if dim == 1 and tensor.dim() != 2:
        raise ValueError(f"a slice along dim 1 must be 2-D, got shape {tuple(tensor.shape)}")
    matrix = tensor.reshape(1, 1) if tensor.dim() == 0 else tensor.reshape(tensor.shape[0], -1)
    rows, cols = matrix.shape
    row_offset, col_offset = (start, 0) if dim in (None, 0) else (0, start)
    device = matrix.device
    col_weights = 1.0 + ((torch.arange(cols, device=device) + col_offset) % _COL_PERIOD).double()
    result = torch.zeros(5, dtype=torch.float64, device=device)
    block = max(1, _BLOCK_ELEMENTS // max(1, cols))
    for first in range(0, rows, block):
        part = matrix[first:first + block]
        if dtype is not None:
            part = part.to(dtype)
        part = part.double()
        row_sums = part.sum(dim=1)
        row_weights = 1.0 + ((torch.arange(first, first + part.shape[0], device=device) + row_offset) % _ROW_PERIOD).double()
        result += torch.stack([
            row_sums.sum(),
            part.abs().sum(),
            (part * part).sum(),
            (row_weights * row_sums).sum(),
            (col_weights * part.sum(dim=0)).sum(),
        ])
    return result


def fingerprints_of(named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fingerprints of whole tensors, by name (e.g. what a rollout engine holds)."""
    return {name: tensor_fingerprint(tensor.detach()).cpu() for name, tensor in named_tensors.items()}


def compare_fingerprints(
    expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor], rtol: float = 1e-7
) -> list[str]:
    """Names (with the differing fields) of tensors whose fingerprints disagree or are missing.

    Tolerance: float64 sums of the same values in another order differ by ~1e-16 relative per
    term; each field is compared relative to its own magnitude scale (sum |x| for the sums,
    times the largest weight for the weighted sums).
    """
    problems = []
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            problems.append(f"{name}: missing on the engine side")
            continue
        want, got = want.double().cpu(), got.double().cpu()
        abs_sum = float(want[1])
        scales = (abs_sum, abs_sum, float(want[2]), abs_sum * _ROW_PERIOD, abs_sum * _COL_PERIOD)
        bad = [
            f"{field} {float(w):.10g} != {float(g):.10g}"
            for field, w, g, scale in zip(FINGERPRINT_FIELDS, want, got, scales)
            if abs(float(w) - float(g)) > rtol * scale + 1e-30
        ]
        if bad:
            problems.append(f"{name}: " + ", ".join(bad))
    return problems


def check_fingerprints(
    expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor], rtol: float = 1e-7
) -> None:
    """Raise ``WeightSyncError`` listing every tensor whose fingerprint differs."""
    problems = compare_fingerprints(expected, actual, rtol)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise WeightSyncError(
            f"weight sync check failed: {len(problems)} of {len(expected)} tensors differ between the trainer "
            f"and the rollout engine:\n  {shown}{more}"
        )
