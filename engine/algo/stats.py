"""Masked statistics over ``[batch, response_len]`` tensors: only positions with mask == 1 count."""
from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; masked entries are ignored, not multiplied by 0."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked-in entries (over all of them, or along ``dim``); NaN where none are."""
    weights = mask.to(values.dtype)
    count = weights.sum() if dim is None else weights.sum(dim=dim)
    return masked_sum(values, mask, dim) / count


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over masked-in entries, with Bessel's correction n / (n - 1) by default."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = mask.to(values.dtype).sum()
        if count < 2:
            raise ValueError(f"unbiased masked variance needs at least 2 unmasked entries, got {int(count)}")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, epsilon: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with masked mean/var (unbiased); masked entries become 0.

    ``shift_mean=False`` adds the mean back, ``(x - mean) / std + mean``: unit spread but the
    original mean, so a batch whose advantages are mostly positive stays so.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
