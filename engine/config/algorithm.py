"""``algorithm.*``: advantage estimation and the KL penalty in the reward."""
from __future__ import annotations

from dataclasses import dataclass, field

# Estimators that compare the rollout.n responses of one prompt with each other.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@dataclass
class KLControlSection:
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

    def controller_config(self):
        """The ``engine.algo.kl.KLControllerConfig`` of these settings (imports torch)."""
        from engine.algo.kl import KLControllerConfig

        return KLControllerConfig(type=self.type, kl_coef=self.kl_coef, target_kl=self.target_kl, horizon=self.horizon)


@dataclass
class AlgorithmSection:
    """``algorithm.*``.

    Attributes:
        adv_estimator: one of ``registry.names("adv_estimator")``; "gae" (Schulman et al. 2016)
            needs the critic, the group estimators (GRPO, RLOO) need ``rollout.n >= 2``.
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
    kl_ctrl: KLControlSection = field(default_factory=KLControlSection)

    @property
    def uses_critic(self) -> bool:
        """Whether this estimator needs the value model."""
        return self.adv_estimator == "gae"

    def advantage_config(self):
        """The ``engine.algo.advantages.AdvantageConfig`` of these settings (imports torch)."""
        from engine.algo.advantages import AdvantageConfig

        return AdvantageConfig(adv_estimator=self.adv_estimator, gamma=self.gamma, lam=self.lam,
                               norm_adv_by_std_in_grpo=self.norm_adv_by_std_in_grpo)
