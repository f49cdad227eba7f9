"""DAPO's two reward-side pieces (Yu et al. 2025, "DAPO: an open-source LLM reinforcement learning
system at scale"): dynamic sampling's group filter (section 3.2) and overlong reward shaping
(section 3.4, eq. 13). Pure tensor math on the global batch.
"""
from __future__ import annotations

import torch


def groups_with_spread(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which prompt groups to keep: ``[B / group_size]`` bool, True where the group's ``values``
    (``[B]``, one per response; each group's responses consecutive) are not all equal. A group
    whose responses all score alike gets advantage 0 from every group estimator: no gradient, only
    cost. DAPO keeps ``0 < |{correct}| < G``; for scores that are not 0/1 the same test is a
    non-zero spread (verl compares the group's std with 0)."""
    if values.dim() != 1 or len(values) % group_size:
        raise ValueError(f"values {tuple(values.shape)} must be [batch] with batch a multiple of the group size {group_size}")
    groups = values.double().view(-1, group_size)
    return groups.amax(dim=1) > groups.amin(dim=1)


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_length: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, ``[B]``: 0 up to ``max_response_length - buffer_length``
    tokens, then falling linearly to ``-penalty_factor`` at ``max_response_length``:
    ``min(0, (L_max - L_cache - |y|) / L_cache) * penalty_factor``."""
    expected = max_response_length - buffer_length
    excess = response_lengths.float() - expected
    return torch.clamp(-excess / buffer_length * penalty_factor, max=0.0)
