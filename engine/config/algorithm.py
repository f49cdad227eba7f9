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
    """

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)

    @property
    def uses_critic(self) -> bool:
        """Whether this estimator needs the value model."""
        return self.adv_estimator == "gae"

    @property
    def uses_greedy_baseline(self) -> bool:
        """Whether each prompt also gets a greedy response whose reward is the baseline (ReMax)."""
        return self.adv_estimator == "remax"
