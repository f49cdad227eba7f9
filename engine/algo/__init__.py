"""The PPO algorithm as pure tensor math: advantage estimators, KL estimators and controllers,
policy/value/entropy losses and their micro-batch-invariant aggregation.

Config-selectable parts are looked up by name in :mod:`engine.algo.registry`.
"""
from engine.algo.advantages import (
    AdvantageInputs,
    AdvantageOutput,
    compute_advantages,
    compute_gae,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
    discounted_returns,
    group_index_from_uids,
    group_statistics,
    sequence_scores,
)
from engine.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_divergence,
)
from engine.algo.losses import (
    LossOutput,
    LossScale,
    aggregate_loss,
    compute_actor_loss,
    aggregate_entropy,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
    count_tokens_and_sequences,
    explained_variance,
)
from engine.algo.registry import UnknownNameError
from engine.algo.stats import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "AdaptiveKLController",
    "AdvantageInputs",
    "AdvantageOutput",
    "FixedKLController",
    "LossOutput",
    "LossScale",
    "UnknownNameError",
    "aggregate_loss",
    "apply_kl_penalty",
    "build_kl_controller",
    "compute_actor_loss",
    "compute_advantages",
    "aggregate_entropy",
    "compute_gae",
    "compute_grpo_advantages",
    "compute_kl_loss",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "compute_remax_advantages",
    "compute_rloo_advantages",
    "compute_value_loss",
    "count_tokens_and_sequences",
    "discounted_returns",
    "explained_variance",
    "group_index_from_uids",
    "group_statistics",
    "kl_divergence",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "sequence_scores",
]
