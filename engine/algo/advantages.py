"""Advantage estimators (``algorithm.adv_estimator``) and the returns the critic regresses on.

Inputs are ``token_level_rewards [batch, response_len]`` (scores, minus the per-token KL penalty
when ``algorithm.use_kl_in_reward``) with a float/bool ``response_mask``. Masked positions are not
timesteps: they are skipped (a masked token inside a response, such as a tool output, neither
discounts nor receives credit), and whatever they hold never changes a result. Outputs are 0 there.

Group-relative estimators need ``group_index [batch]``: one integer id per prompt, shared by its
``rollout.n`` samples (:func:`group_index_from_uids` maps string uids). A sequence's score is the
masked sum of its token rewards.

Compute advantages on the whole rollout batch (all prompts, before it is split across
data-parallel ranks): the group statistics and the batch whitening are statistics of that batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

import torch

from engine.algo import registry
from engine.config.algorithm import AlgorithmConfig
from engine.algo.stats import masked_sum, masked_whiten


# Added to the group std before dividing (GRPO), so a group of equal scores gets advantage 0.
GRPO_EPSILON = 1e-6


@dataclass
class AdvantageInputs:
    """What the estimators read from a rollout batch.

    Attributes:
        token_level_rewards: ``[batch, response_len]``.
        response_mask: ``[batch, response_len]``, float or bool.
        values: critic values ``[batch, response_len]`` (``gae``).
        group_index: ``[batch]`` integer prompt ids (``grpo``, ``rloo``,
            ``reinforce_plus_plus_baseline``).
        baseline_scores: ``[batch]`` reward of the greedy response to the same prompt (``remax``).
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor | None = None
    group_index: torch.Tensor | None = None
    baseline_scores: torch.Tensor | None = None


@dataclass
class AdvantageOutput:
    """``advantages`` for the policy loss and ``returns`` for the critic (both 0 off the mask)."""

    advantages: torch.Tensor
    returns: torch.Tensor


def compute_advantages(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutput:
    """Advantages and returns of the estimator named by ``config.adv_estimator`` (``algorithm.*``:
    ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``)."""
    if inputs.token_level_rewards.shape != inputs.response_mask.shape or inputs.token_level_rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(inputs.token_level_rewards.shape)} and response_mask "
            f"{tuple(inputs.response_mask.shape)} must share one [batch, response_len] shape"
        )
    return registry.get("adv_estimator", config.adv_estimator)(inputs, config)


def group_index_from_uids(uids: Sequence[Hashable]) -> torch.Tensor:
    """``[batch]`` int64 group ids from per-sequence prompt uids (e.g. uuid strings), in order of
    first appearance."""
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(uid, len(ids)) for uid in uids], dtype=torch.long)


# --- Building blocks -----------------------------------------------------------------------


def compute_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016), not whitened.

    Over the unmasked steps t of a response, with V = 0 after the last one (the episode ends):
    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``;
    the critic's target is ``R_t = A_t + V_t`` (the lambda-return).

    Returns:
        ``(advantages, returns)``, ``[batch, response_len]``, 0 off the mask.
    """
    _check_pair(token_level_rewards, values, response_mask, "values")
    mask = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    # Right to left; at a masked step the carried V_{t+1} and A_{t+1} skip over it unchanged.
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(mask[:, t], advantage, torch.zeros_like(advantage))
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_advantage = torch.where(mask[:, t], advantage, next_advantage)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def discounted_returns(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reward-to-go ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over unmasked steps; 0 off the mask."""
    mask = response_mask.bool()
    next_return = torch.zeros_like(token_level_rewards[:, 0])
    returns = torch.zeros_like(token_level_rewards)
    for t in reversed(range(token_level_rewards.shape[1])):
        current = token_level_rewards[:, t] + gamma * next_return
        returns[:, t] = torch.where(mask[:, t], current, torch.zeros_like(current))
        next_return = torch.where(mask[:, t], current, next_return)
    return returns


def group_statistics(scores: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence: the mean, unbiased std and size of its group's scores (std = 0 for a group
    of one)."""
    if group_index.shape != scores.shape:
        raise ValueError(f"group_index must be [batch] = {tuple(scores.shape)}, got {tuple(group_index.shape)}")
    if group_index.dtype.is_floating_point or group_index.dtype == torch.bool:
        raise ValueError(f"group_index must hold integer prompt ids, got dtype {group_index.dtype}")
    _, inverse, counts = torch.unique(group_index, return_inverse=True, return_counts=True)
    counts = counts.to(scores.dtype)
    group_mean = torch.zeros_like(counts).index_add_(0, inverse, scores) / counts
    mean = group_mean[inverse]
    squared_deviation = torch.zeros_like(counts).index_add_(0, inverse, (scores - mean) ** 2)
    group_std = torch.sqrt(squared_deviation / (counts - 1).clamp(min=1))
    return mean, group_std[inverse], counts[inverse]


def sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` total reward of each response (masked sum over its tokens)."""
    return masked_sum(token_level_rewards, response_mask, dim=-1)


def _broadcast(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One value per sequence on each of its response tokens, 0 elsewhere."""
    expanded = per_sequence.unsqueeze(-1).expand(response_mask.shape)
    return torch.where(response_mask.bool(), expanded, torch.zeros_like(expanded))


# --- Estimators ------------------------------------------------------------------------------


def compute_grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: torch.Tensor,
    norm_adv_by_std: bool = True,
    epsilon: float = GRPO_EPSILON,
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): ``A_i = (s_i - mean_g(s)) / (std_g(s) + eps)`` on every token.

    ``norm_adv_by_std=False`` is Dr.GRPO (Liu et al. 2025): ``A_i = s_i - mean_g(s)``, removing
    the bias toward questions whose group has a small reward spread. A group of one sequence has
    no relative signal: its advantage is 0.
    """
    scores = sequence_scores(token_level_rewards, response_mask)
    mean, std, _ = group_statistics(scores, group_index)
    advantage = scores - mean
    if norm_adv_by_std:
        advantage = advantage / (std + epsilon)
    return _broadcast(advantage, response_mask)


def compute_rloo_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor
) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): the baseline of sample i is the mean of the *other* n - 1
    samples of its prompt, ``A_i = s_i - (sum_g s - s_i) / (n - 1) = n / (n - 1) * (s_i - mean_g)``.
    0 for a group of one."""
    scores = sequence_scores(token_level_rewards, response_mask)
    mean, _, size = group_statistics(scores, group_index)
    advantage = torch.where(size > 1, size / (size - 1).clamp(min=1) * (scores - mean), torch.zeros_like(scores))
    return _broadcast(advantage, response_mask)


def compute_reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): the discounted reward-to-go of the (KL-penalised) token rewards,
    whitened over all response tokens of the batch; returns the pair ``(advantages, returns)``."""
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


def compute_reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, group_index: torch.Tensor
) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025): subtract the prompt's group mean score, ``s_i - mean_g``,
    then whiten over all response tokens of the batch (global, not per group, normalisation)."""
    scores = sequence_scores(token_level_rewards, response_mask)
    mean, _, _ = group_statistics(scores, group_index)
    return masked_whiten(_broadcast(scores - mean, response_mask), response_mask)


def compute_remax_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, baseline_scores: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): REINFORCE with the greedy response's reward as baseline,
    ``A_t = G_t - r(x, y_greedy)``; returns the pair ``(advantages, returns)``."""
    if baseline_scores.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"baseline_scores must be [batch] = {tuple(token_level_rewards.shape[:1])}, got {tuple(baseline_scores.shape)}"
        )
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    advantages = torch.where(response_mask.bool(), returns - baseline_scores.unsqueeze(-1), torch.zeros_like(returns))
    return advantages, returns


# Registered adapters: one signature, (inputs, config) -> AdvantageOutput, for the config key.


@registry.register("adv_estimator", "gae")
def _gae(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutput:
    values = _require(inputs, "values", "gae", "critic values")
    advantages, returns = compute_gae(inputs.token_level_rewards, values, inputs.response_mask, config.gamma, config.lam)
    # The batch-whitened advantages feed the policy; the raw lambda-returns the critic.
    return AdvantageOutput(masked_whiten(advantages, inputs.response_mask), returns)


@registry.register("adv_estimator", "grpo")
def _grpo(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutput:
    group_index = _require(inputs, "group_index", "grpo", "one prompt id per sequence")
    advantages = compute_grpo_advantages(
        inputs.token_level_rewards, inputs.response_mask, group_index, config.norm_adv_by_std_in_grpo, GRPO_EPSILON
    )
    return AdvantageOutput(advantages, advantages)


@registry.register("adv_estimator", "rloo")
def _rloo(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutput:
    group_index = _require(inputs, "group_index", "rloo", "one prompt id per sequence")
    advantages = compute_rloo_advantages(inputs.token_level_rewards, inputs.response_mask, group_index)
    return AdvantageOutput(advantages, advantages)


@registry.register("adv_estimator", "reinforce_plus_plus")
def _reinforce_plus_plus(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutput:
    advantages, returns = compute_reinforce_plus_plus_advantages(
        inputs.token_level_rewards, inputs.response_mask, config.gamma
    )
    return AdvantageOutput(advantages, returns)


@registry.register("adv_estimator", "reinforce_plus_plus_baseline")
def _reinforce_plus_plus_baseline(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutput:
    group_index = _require(inputs, "group_index", "reinforce_plus_plus_baseline", "one prompt id per sequence")
    advantages = compute_reinforce_plus_plus_baseline_advantages(
        inputs.token_level_rewards, inputs.response_mask, group_index
    )
    return AdvantageOutput(advantages, advantages)


@registry.register("adv_estimator", "remax")
def _remax(inputs: AdvantageInputs, config: AlgorithmConfig) -> AdvantageOutput:
    baseline = _require(inputs, "baseline_scores", "remax", "the greedy response's reward per sequence")
    advantages, returns = compute_remax_advantages(inputs.token_level_rewards, inputs.response_mask, baseline, config.gamma)
    return AdvantageOutput(advantages, returns)


def _require(inputs: AdvantageInputs, name: str, estimator: str, what: str) -> torch.Tensor:
    tensor = getattr(inputs, name)
    if tensor is None:
        raise ValueError(f"algorithm.adv_estimator={estimator!r} needs AdvantageInputs.{name} ({what})")
    return tensor


def _check_pair(rewards: torch.Tensor, other: torch.Tensor, mask: torch.Tensor, other_name: str) -> None:
    if not (rewards.shape == other.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(rewards.shape)}, {other_name} {tuple(other.shape)} and "
            f"response_mask {tuple(mask.shape)} must share one [batch, response_len] shape"
        )
