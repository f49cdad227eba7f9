"""The name registry behind the config keys of engine/algo."""
import pytest
import torch

from engine.algo import registry
from engine.algo.advantages import AdvantageInputs, compute_advantages
from engine.algo.kl import build_kl_controller, kl_divergence
from engine.algo.losses import LossScale, compute_actor_loss
from engine.config import ActorConfig, AlgorithmConfig, KLControlConfig, PolicyLossConfig

EXPECTED = {
    "adv_estimator": {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"},
    "kl_estimator": {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"},
    "kl_controller": {"fixed", "adaptive"},
    "policy_loss": {"vanilla", "gspo"},
    "loss_agg_mode": {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"},
}


def test_names_cover_every_kind():
    for kind, expected in EXPECTED.items():
        names = registry.names(kind)
        assert names == sorted(names)
        if kind == "kl_estimator":
            expected = expected | {name + "+" for name in expected}
        assert set(names) == expected, kind


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_unknown_name_lists_key_and_valid_names(kind):
    with pytest.raises(registry.UnknownNameError) as info:
        registry.get(kind, "no-such-name")
    message = str(info.value)
    assert registry.CONFIG_KEYS[kind] in message and "'no-such-name'" in message
    for name in registry.names(kind):
        assert name in message
    assert isinstance(info.value, ValueError)


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="adv_estimator"):
        registry.names("optimizer")


def test_entry_points_reject_unknown_names_naming_the_key():
    # (The config check refuses them before any model is built: tests/test_config_errors.py.)
    inputs = AdvantageInputs(torch.zeros(2, 3), torch.ones(2, 3))
    args = (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3))

    def actor_loss(**settings):
        return compute_actor_loss(*args, ActorConfig(**settings), LossScale(6, 2), ref_log_probs=torch.zeros(2, 3))

    cases = [
        (lambda: compute_advantages(inputs, AlgorithmConfig(adv_estimator="gea")), "algorithm.adv_estimator"),
        (lambda: actor_loss(policy_loss=PolicyLossConfig(loss_mode="ppo2")), "policy_loss.loss_mode"),
        (lambda: actor_loss(loss_agg_mode="mean"), "loss_agg_mode"),
        (lambda: actor_loss(use_kl_loss=True, kl_loss_type="k4"), "actor_rollout_ref.actor.kl_loss_type"),
        (lambda: build_kl_controller(KLControlConfig(type="pid")), "algorithm.kl_ctrl.type"),
    ]
    for build, key in cases:
        with pytest.raises(registry.UnknownNameError, match=key):
            build()
    with pytest.raises(registry.UnknownNameError, match="low_var_kl"):
        kl_divergence(torch.zeros(1, 2), torch.zeros(1, 2), "k5")


def test_missing_estimator_input_names_the_field():
    inputs = AdvantageInputs(torch.zeros(2, 3), torch.ones(2, 3))
    for estimator, field in (("gae", "values"), ("grpo", "group_index"), ("remax", "baseline_scores")):
        with pytest.raises(ValueError, match=f"{estimator}.*AdvantageInputs.{field}"):
            compute_advantages(inputs, AlgorithmConfig(adv_estimator=estimator))


def test_register_refuses_a_second_implementation_for_a_name():
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("policy_loss", "vanilla")(lambda *args: None)
