"""KL estimators, the KL penalty in the reward, and the KL controllers."""
import pytest
import torch

from engine.algo import registry
from engine.algo.kl import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_divergence,
)
from engine.config import KLControlConfig
from tests import algo_reference as ref


@pytest.mark.parametrize("name", registry.names("kl_estimator"))
def test_estimator_values_match_schulman_definitions(name):
    batch = ref.ragged_batch(6, 7, seed=2)
    log_probs, ref_log_probs = batch["log_probs"], batch["ref_log_probs"]
    # Include log-ratios far outside k3's clamp.
    log_probs[0, :3] = torch.tensor([30.0, -30.0, 0.0], dtype=torch.float64)
    out = kl_divergence(log_probs, ref_log_probs, name)
    expected = torch.tensor(
        [[ref.reference_kl(float(a), float(b), name) for a, b in zip(row_a, row_b)]
         for row_a, row_b in zip(log_probs, ref_log_probs)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_k3_is_nonnegative_and_unbiased_for_kl():
    # Sample tokens from q over a small vocabulary; E_q[k1] = E_q[k3] = KL(q || p).
    generator = torch.Generator().manual_seed(0)
    # Mild logits keep every k3 term inside its [-10, 10] clamp, where it is exact.
    q = torch.softmax(0.5 * torch.randn(5, generator=generator, dtype=torch.float64), 0)
    p = torch.softmax(0.5 * torch.randn(5, generator=generator, dtype=torch.float64), 0)
    exact = float((q * (q.log() - p.log())).sum())
    expectation = {name: float((q * kl_divergence(q.log(), p.log(), name)).sum()) for name in ("k1", "k3")}
    assert expectation["k1"] == pytest.approx(exact, rel=1e-12)
    assert expectation["k3"] == pytest.approx(exact, rel=1e-12)
    assert torch.all(kl_divergence(q.log(), p.log(), "k3") >= 0)


@pytest.mark.parametrize("base", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_straight_through_has_estimator_value_and_k2_gradient(base):
    batch = ref.ragged_batch(4, 5, seed=5)
    log_probs = batch["log_probs"].clone().requires_grad_(True)
    straight = kl_divergence(log_probs, batch["ref_log_probs"], base + "+")
    torch.testing.assert_close(straight, kl_divergence(log_probs, batch["ref_log_probs"], base), rtol=0, atol=1e-15)
    (gradient,) = torch.autograd.grad(straight.sum(), log_probs)
    # d/dlogp of 0.5 (logp - logp_ref)^2.
    torch.testing.assert_close(gradient, batch["log_probs"] - batch["ref_log_probs"], rtol=1e-12, atol=1e-12)


def test_kl_penalty_in_reward_per_token():
    batch = ref.ragged_batch(5, 6, seed=7)
    mask = batch["response_mask"]
    scores = batch["token_level_rewards"]
    rewards, current_kl = apply_kl_penalty(scores, batch["log_probs"], batch["ref_log_probs"], mask, 0.05, "k3")
    per_sequence = []
    for i in range(5):
        steps = ref.valid_positions(mask, i)
        kls = {t: ref.reference_kl(float(batch["log_probs"][i, t]), float(batch["ref_log_probs"][i, t]), "k3") for t in steps}
        for t in range(6):
            expected = float(scores[i, t]) - 0.05 * kls.get(t, 0.0)
            assert float(rewards[i, t]) == pytest.approx(expected, rel=1e-12, abs=1e-12)
        per_sequence.append(sum(kls.values()) / len(kls))
    assert float(current_kl) == pytest.approx(sum(per_sequence) / len(per_sequence), rel=1e-12)


def test_adaptive_controller_follows_ziegler_update_and_restores():
    config = KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=6.0, horizon=10000)
    controller = build_kl_controller(config)
    assert isinstance(controller, AdaptiveKLController)
    beta = 0.2
    for current_kl in (12.0, 7.0, 1.0, 6.0, 5.4):
        controller.update(current_kl, n_steps=256)
        error = min(max(current_kl / 6.0 - 1.0, -0.2), 0.2)
        beta = beta * (1.0 + error * 256 / 10000)
        assert controller.value == pytest.approx(beta, rel=1e-15)
    assert controller.value != 0.2

    restored = build_kl_controller(config)
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    controller.update(9.0, 64)
    restored.update(9.0, 64)
    assert restored.value == controller.value


def test_fixed_controller_is_constant_and_checkpoint_type_is_checked():
    fixed = build_kl_controller(KLControlConfig(type="fixed", kl_coef=0.01))
    assert isinstance(fixed, FixedKLController)
    fixed.update(100.0, 1000)
    assert fixed.value == 0.01
    adaptive = build_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.01))
    with pytest.raises(ValueError, match="algorithm.kl_ctrl.type"):
        adaptive.load_state_dict(fixed.state_dict())


