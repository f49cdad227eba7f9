"""KL(pi_theta || pi_ref) estimators, the KL penalty in the reward, and the KL coefficient controllers.

Estimators follow J. Schulman, "Approximating KL divergence" (2020). With tokens sampled from
pi_theta and ``log r = log pi_ref(a) - log pi_theta(a)``:

- ``k1`` / ``kl``:        ``-log r``                 unbiased, high variance, can be negative;
- ``abs``:                ``|log r|``;
- ``k2`` / ``mse``:       ``0.5 * (log r)^2``        biased, low variance; its gradient is the
  unbiased gradient of KL under on-policy sampling;
- ``k3`` / ``low_var_kl``: ``(r - 1) - log r``       unbiased, >= 0, low variance; clamped to
  [-10, 10] because exp() of a large log-ratio explodes.

``<name>+`` (e.g. ``k3+``, ``low_var_kl+``) is straight-through: the forward value of ``<name>``
with the gradient of ``k2``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from engine.algo import registry
from engine.algo.stats import masked_mean
from engine.config.algorithm import KLControlConfig

# exp(log r) is evaluated on a clamped log-ratio, and k3's value clamped, as is usual for k3.
_K3_LOG_RATIO_BOUND = 20.0
_K3_VALUE_BOUND = 10.0


def _k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs


def _abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - ref_log_probs).abs()


def _k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs) ** 2


def _k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_log_probs - log_probs).clamp(-_K3_LOG_RATIO_BOUND, _K3_LOG_RATIO_BOUND)
    return (torch.exp(log_ratio) - 1.0 - log_ratio).clamp(-_K3_VALUE_BOUND, _K3_VALUE_BOUND)


def _straight_through(estimator: Callable) -> Callable:
    def value_of_estimator_gradient_of_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
        k2 = _k2(log_probs, ref_log_probs)
        return k2 + (estimator(log_probs, ref_log_probs) - k2).detach()

    return value_of_estimator_gradient_of_k2


for _names, _estimator in (
    (("kl", "k1"), _k1),
    (("abs",), _abs),
    (("mse", "k2"), _k2),
    (("low_var_kl", "k3"), _k3),
):
    registry.register("kl_estimator", *_names)(_estimator)
    registry.register("kl_estimator", *(name + "+" for name in _names))(_straight_through(_estimator))


def kl_divergence(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str, config_key: str | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) at the sampled tokens.

    Args:
        log_probs: log pi_theta(a_t) (the actor; differentiable for the KL loss).
        ref_log_probs: log pi_ref(a_t) of the frozen reference policy.
        estimator: a name from ``registry.names("kl_estimator")``.
        config_key: the config key named in the error for an unknown estimator.
    """
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} differ")
    return registry.get("kl_estimator", estimator, config_key)(log_probs, ref_log_probs)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward (``algorithm.use_kl_in_reward``), per token (Ziegler et al. 2019):
    ``token_level_rewards = token_level_scores - beta * KL_t`` on response tokens.

    Args:
        token_level_scores: rewards before the penalty, ``[batch, response_len]`` (the score
            usually sits on the last response token).
        log_probs: the rollout policy's log-probs (old log-probs; no gradient flows here).
        ref_log_probs: the reference policy's log-probs.
        response_mask: response tokens; masked positions get no penalty.
        kl_coef: beta, the current value of the KL controller.
        kl_penalty: estimator name (``algorithm.kl_penalty``).

    Returns:
        ``(token_level_rewards, current_kl)``: current_kl is the batch mean of each sequence's
        token-mean KL, the quantity :meth:`AdaptiveKLController.update` tracks (and the
        ``actor/reward_kl_penalty`` metric).
    """
    kl = kl_divergence(log_probs, ref_log_probs, kl_penalty, "algorithm.kl_penalty").detach()
    kl = torch.where(response_mask.bool(), kl, torch.zeros_like(kl))
    token_level_rewards = token_level_scores - kl_coef * kl
    per_sequence_kl = masked_mean(kl, response_mask, dim=-1)
    has_tokens = response_mask.bool().any(dim=-1)
    current_kl = per_sequence_kl[has_tokens].mean()
    return token_level_rewards, current_kl


# --- KL coefficient controllers (``algorithm.kl_ctrl``) ----------------------------------------


@registry.register("kl_controller", "fixed")
class FixedKLController:
    """A constant beta."""

    def __init__(self, config: KLControlConfig):
        self.value = config.kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state_type(state, "fixed")
        self.value = float(state["value"])


@registry.register("kl_controller", "adaptive")
class AdaptiveKLController:
    """Adaptive beta of Ziegler et al. 2019 ("Fine-Tuning Language Models from Human Preferences"):

    ``e = clip(KL / KL_target - 1, -0.2, 0.2)``;  ``beta <- beta * (1 + e * n_steps / horizon)``.

    A proportional controller: beta grows while the measured KL is above target and shrinks
    below it; the clip bounds how fast one noisy batch can move it.
    """

    def __init__(self, config: KLControlConfig):
        self.value = config.kl_coef
        self.target_kl = config.target_kl
        self.horizon = config.horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta after a batch of ``n_steps`` sequences whose mean KL was ``current_kl``."""
        proportional_error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state_type(state, "adaptive")
        # beta is the state; target and horizon stay as configured, so a resumed run can retune them.
        self.value = float(state["value"])


def build_kl_controller(config: KLControlConfig) -> FixedKLController | AdaptiveKLController:
    """The controller named by ``algorithm.kl_ctrl.type`` (``kl_coef``, ``target_kl``, ``horizon``)."""
    return registry.get("kl_controller", config.type)(config)


def _check_state_type(state: dict[str, Any], expected: str) -> None:
    if state.get("type") != expected:
        raise ValueError(
            f"checkpoint holds a {state.get('type')!r} KL controller but algorithm.kl_ctrl.type={expected!r}"
        )
