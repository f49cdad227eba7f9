"""One reward per response from its rule, reward-model and judge scores (``reward_model.combine``).

Pure tensor math on the global batch (every rank holds the same scores, so every rank computes the
same rewards). The formulas are in ``engine.config.reward_model.RewardCombineConfig``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config.reward_model import RewardCombineConfig


@dataclass
class RewardScores:
    """Per-response scores of one batch, ``[B]`` each; None for a source that is off."""

    rule: torch.Tensor | None = None
    model: torch.Tensor | None = None
    judge: torch.Tensor | None = None


def combine_rewards(scores: RewardScores, config: RewardCombineConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The reward of each response and the ``reward/<source>/mean`` metrics (raw scores, before
    normalisation and clipping, so runs with different settings compare)."""
    present = [s for s in (scores.rule, scores.model, scores.judge) if s is not None]
    if not present:
        raise ValueError("no reward source produced scores")
    reward = torch.zeros_like(present[0], dtype=torch.float32)
    metrics: dict[str, float] = {}
    for name, score in (("rule", scores.rule), ("model", scores.model), ("judge", scores.judge)):
        if score is not None:
            metrics[f"reward/{name}/mean"] = score.float().mean().item()
    if scores.rule is not None:
        reward = reward + config.rule_weight * scores.rule.float()
    gate = torch.ones_like(reward)
    if config.mode == "gated":
        if scores.rule is None:
            raise ValueError("reward_model.combine.mode='gated' needs rule scores (data sources with a scorer)")
        gate = (scores.rule.float() >= config.gate_threshold).float()
        metrics["reward/gate/open_fraction"] = gate.mean().item()
    if scores.model is not None:
        model = scores.model.float()
        if config.normalize_model_score:
            # Whitened over the batch; a constant batch (std 0) becomes all zeros, not NaN.
            model = (model - model.mean()) / (model.std(unbiased=False) + 1e-6)
        if config.model_score_clip is not None:
            model = model.clamp(-config.model_score_clip, config.model_score_clip)
        reward = reward + config.model_weight * gate * model
    if scores.judge is not None:
        reward = reward + config.judge_weight * gate * scores.judge.float()
    if config.reward_clip is not None:
        reward = reward.clamp(-config.reward_clip, config.reward_clip)
    return reward, metrics
