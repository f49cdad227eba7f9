"""``algorithm.*``: advantage estimation and the KL penalty in the reward (read by ``engine.algo``)."""
from __future__ import annotations

from dataclasses import dataclass, field

# Estimators that compare the rollout.n responses of one prompt with each other.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@dataclass
class KLControlConfig:
    """``algorithm.kl_ctrl.*``: the coefficient beta of the in-reward KL penalty.

    Attributes:
        type: "fixed" or "adaptive" (Ziegler et al. 2019: beta moves to keep the KL near target_kl).
        kl_coef: beta, or its starting value.
        target_kl: the adaptive controller's target.
        horizon: the adaptive controller's horizon in samples.
    """

    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")


@dataclass
class RolloutCorrectionConfig:
    """``algorithm.rollout_correction.*``: correct for the rollout engine's policy differing from
    the trainer's (``engine.algo.rollout_correction``; verl's names and meaning). Off by default.

    Attributes:
        rollout_is: truncated importance sampling of the policy loss by pi_old / pi_rollout:
            null (off), "token" (each token's ratio) or "sequence" (the product over the response).
        rollout_is_threshold: C, the largest weight (weights above are truncated to it).
        rollout_rs: rejection (masked importance sampling): null (off), "token", "sequence" or
            "geometric" (the ratio's geometric mean over the response); what falls outside the
            bounds leaves the actor's loss.
        rollout_rs_threshold: the upper bound; null = ``rollout_is_threshold``.
        rollout_rs_threshold_lower: the lower bound; null = 1 / the upper bound.
    """

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_rs_threshold_lower: float | None = None

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    def rejection_bounds(self) -> tuple[float, float]:
        """(upper, lower) ratio bounds of the rejection."""
        upper = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        lower = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / upper
        return upper, lower


# What ``algorithm.filter_groups.metric`` may name: the per-response value whose spread within a
# prompt's group decides whether the group is kept (``engine.algo.dapo``).
FILTER_GROUP_METRICS = ("acc", "score", "seq_reward")


@dataclass
class FilterGroupsConfig:
    """``algorithm.filter_groups.*``: DAPO's dynamic sampling (Yu et al. 2025; verl's keys). A prompt
    group whose ``rollout.n`` responses all have the same ``metric`` teaches a group estimator
    nothing (every advantage is 0), so such groups are dropped and more prompts are generated, in
    rounds of ``data.train_batch_size`` prompts, until that many groups with a spread exist; the
    step trains on exactly that many (the surplus of the last round is discarded, as in verl).

    Attributes:
        enable: filter groups and generate more.
        metric: "acc" (the rule score counted as correct when >= 1, as ``val/accuracy`` counts),
            "score" (the reward, every source combined, overlong penalty included) or "seq_reward"
            (the sum of the token-level scores: the same value, since the score sits on the last
            token; verl's name).
        max_num_gen_batches: rounds one step may generate; a step that still lacks groups stops the
            run with a message. 0: no limit.
    """

    enable: bool = False
    metric: str = "acc"
    max_num_gen_batches: int = 0


@dataclass
class AlgorithmConfig:
    """``algorithm.*``.

    Attributes:
        adv_estimator: one of ``registry.names("adv_estimator")``; "gae" (Schulman et al. 2016)
            needs the critic; the group estimators (GRPO, RLOO, REINFORCE++ with baseline) need
            ``rollout.n >= 2``; "remax" (Li et al. 2023) also generates one greedy response per
            prompt as its baseline.
        gamma: discount factor.
        lam: GAE's lambda.
        norm_adv_by_std_in_grpo: GRPO divides by the group's std (false gives Dr. GRPO).
        use_kl_in_reward: subtract ``beta * KL(pi_old || pi_ref)`` from the token rewards.
        kl_penalty: that KL's estimator, one of ``registry.names("kl_estimator")``.
        kl_ctrl: how beta is chosen.
        rollout_correction: importance weights / rejection for the rollout engine's own policy.
        filter_groups: DAPO's dynamic sampling (drop prompt groups without a reward spread).
    """

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)

    @property
    def uses_critic(self) -> bool:
        """Whether this estimator needs the value model."""
        return self.adv_estimator == "gae"

    @property
    def uses_greedy_baseline(self) -> bool:
        """Whether each prompt also gets a greedy response whose reward is the baseline (ReMax)."""
        return self.adv_estimator == "remax"
