"""Rollout correction: the sampler's policy is not the trainer's pi_old; reweight or reject.

The rollout engine samples with its own behaviour policy pi_rollout (a bf16 engine with other
kernels, or weights one step old when generating ahead), while PPO's ratio is taken against the
trainer's recomputation pi_old. The decoupled objective (Hilton et al. 2021, "Batch size-invariance
for policy optimization"; Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"; Liu, Li et al. 2025, "When speed kills stability") corrects the gap with
the behaviour ratio

    rho_t = pi_old(y_t) / pi_rollout(y_t) = exp(delta_t),   delta_t = log pi_old(y_t) - log pi_rollout(y_t)

in two independent ways (``algorithm.rollout_correction``, named as in verl):

- truncated importance sampling (TIS; Yao et al. 2025, with IMPALA's truncation, Espeholt et al.
  2018): the policy loss of each token is weighted by ``w_t = min(rho_t, C)`` ("token") or every
  token of a sequence by ``w = min(prod_t rho_t, C) = min(exp(sum_t delta_t), C)`` ("sequence"),
  C = ``rollout_is_threshold``;
- masked importance sampling / rejection (MIS; IcePop, Ling Team 2025, "Every step evolves"):
  tokens ("token": rho_t) or whole sequences ("sequence": prod_t rho_t; "geometric": the geometric
  mean (prod_t rho_t)^(1/|y|) = exp(mean_t delta_t), which does not grow with the length) whose
  ratio leaves [``rollout_rs_threshold_lower``, ``rollout_rs_threshold``] are dropped from the
  actor's loss (its normalisers, entropy and KL terms too, as verl does: as if never sampled).

The weight multiplies PPO's per-token loss ``max(-A rho_theta, -A clip(rho_theta))`` (dual clip
included); since w > 0 that equals the same loss with the advantage ``w A``, which is how the
actor receives it (``engine.trainer.ppo_trainer``). Log-ratios (per token, and summed per
sequence) are clamped to +-``LOG_RATIO_BOUND`` before exponentiating, so a token the engine found
nearly impossible gives a large finite ratio, never inf.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config.algorithm import RolloutCorrectionConfig

# exp(20) ~ 5e8: far above any sensible threshold, far below float32 overflow.
LOG_RATIO_BOUND = 20.0


@dataclass
class RolloutCorrection:
    """What the actor's update uses instead of the plain batch, and the ``rollout_corr/*`` metrics."""

    weights: torch.Tensor  # [B, R] w_t (1 where IS is off), 0 on padding and rejected tokens; detached
    mask: torch.Tensor  # [B, R] the response mask without the rejected tokens and sequences
    metrics: dict[str, float]


def compute_rollout_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, config: RolloutCorrectionConfig) -> RolloutCorrection:
    """TIS weights and the MIS mask of a batch (see the module docstring); float64 inside.

    Every row is corrected on its own, so the result for a subset of rows (a micro-batch) is
    those rows of the result for the whole batch.
    """
    mask = response_mask.to(torch.float64)
    real = mask > 0
    # where() rather than multiply: padding may hold any value, inf included.
    delta = torch.where(real, old_log_probs.detach().double() - rollout_log_probs.detach().double(),
                        torch.zeros_like(mask)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    token_ratio = torch.exp(delta)
    sequence_log_ratio = delta.sum(dim=1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)

    weights = torch.ones_like(mask)
    truncated = torch.zeros_like(real)
    if config.rollout_is == "token":
        weights = token_ratio.clamp(max=config.rollout_is_threshold)
        truncated = token_ratio > config.rollout_is_threshold
    elif config.rollout_is == "sequence":
        sequence_ratio = torch.exp(sequence_log_ratio)
        weights = sequence_ratio.clamp(max=config.rollout_is_threshold).unsqueeze(1).expand_as(mask)
        truncated = (sequence_ratio > config.rollout_is_threshold).unsqueeze(1).expand_as(mask)

    kept = real
    if config.rollout_rs is not None:
        upper, lower = config.rejection_bounds()
        if config.rollout_rs == "token":
            kept = real & (token_ratio >= lower) & (token_ratio <= upper)
        else:
            log_ratio = sequence_log_ratio if config.rollout_rs == "sequence" else _mean_per_row(delta, mask)
            ratio = torch.exp(log_ratio)
            kept = real & ((ratio >= lower) & (ratio <= upper)).unsqueeze(1)
    new_mask = kept.to(response_mask.dtype)
    weights = torch.where(kept, weights, torch.zeros_like(weights)).to(old_log_probs.dtype)
    return RolloutCorrection(weights, new_mask, _metrics(delta, token_ratio, mask, kept, truncated))


def _mean_per_row(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def _metrics(delta, token_ratio, mask, kept, truncated) -> dict[str, float]:
    """Over the batch's response tokens and sequences; the ratios before truncation."""
    tokens = mask.sum().clamp(min=1)
    real = mask.bool()
    sequences = real.any(dim=1)
    masked_sequences = sequences & ~kept.any(dim=1)  # no token of the sequence is left
    # KL(pi_rollout || pi_old) from the rollout's own samples: k1 = E[-delta], k3 = E[rho - 1 - delta]
    # (Schulman's low-variance estimator, >= 0 per token). log_ppl_diff: log PPL_old - log PPL_rollout
    # per sequence (mean_t -delta), averaged over sequences; > 0: the trainer finds the responses
    # less likely than the sampler did.
    return {
        "rollout_corr/is_ratio_mean": float((token_ratio * mask).sum() / tokens),
        "rollout_corr/is_ratio_max": float(token_ratio[real].max()) if real.any() else 1.0,
        "rollout_corr/is_ratio_min": float(token_ratio[real].min()) if real.any() else 1.0,
        "rollout_corr/truncated_fraction": float((truncated & real).sum() / tokens),
        "rollout_corr/masked_token_fraction": float((real & ~kept).sum() / tokens),
        "rollout_corr/masked_sequence_fraction": float(masked_sequences.sum() / sequences.sum().clamp(min=1)),
        "rollout_corr/kl_k1": float((-delta * mask).sum() / tokens),
        "rollout_corr/kl_k3": float(((token_ratio - 1 - delta) * mask).sum() / tokens),
        "rollout_corr/log_ppl_diff": float(-_mean_per_row(delta, mask)[sequences].mean()) if sequences.any() else 0.0,
    }
