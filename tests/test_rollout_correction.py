"""Rollout correction (TIS / MIS) against a float64 reference written token by token from the
definitions (Yao et al. 2025; verl's rollout correction), and its place in the actor's loss."""
from __future__ import annotations

import math
import pytest
import torch

from engine.algo.losses import LossScale, compute_actor_loss
from engine.algo.rollout_correction import LOG_RATIO_BOUND, compute_rollout_correction
from engine.config import ActorConfig, RolloutCorrectionConfig


def batch(seed: int = 0, rows: int = 6, length: int = 7, spread: float = 0.5):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=generator, dtype=torch.float64) * 3
    rollout = old + torch.randn(rows, length, generator=generator, dtype=torch.float64) * spread
    lengths = torch.randint(1, length + 1, (rows,), generator=generator)
    mask = (torch.arange(length) < lengths[:, None]).to(torch.float64)
    old[mask == 0] = rollout[mask == 0] = 0.0  # padding, as the trainer holds it
    return old.float(), rollout.float(), mask.float()


def reference(old, rollout, mask, config: RolloutCorrectionConfig):
    """Weights, kept mask and fractions, one token at a time (float64 Python numbers)."""
    upper = config.rollout_rs_threshold if config.rollout_rs_threshold is not None else config.rollout_is_threshold
    lower = config.rollout_rs_threshold_lower if config.rollout_rs_threshold_lower is not None else 1 / upper
    weights, kept = [], []
    truncated = rejected = tokens = 0
    for i in range(old.shape[0]):
        real = [t for t in range(old.shape[1]) if mask[i, t] > 0]
        deltas = {t: max(-LOG_RATIO_BOUND, min(LOG_RATIO_BOUND, float(old[i, t]) - float(rollout[i, t]))) for t in real}
        sequence_ratio = math.exp(max(-LOG_RATIO_BOUND, min(LOG_RATIO_BOUND, sum(deltas.values()))))
        geometric_ratio = math.exp(sum(deltas.values()) / len(real))
        row_weights, row_kept = [], []
        for t in range(old.shape[1]):
            if t not in deltas:
                row_weights.append(0.0)
                row_kept.append(0.0)
                continue
            tokens += 1
            ratio = math.exp(deltas[t])
            if config.rollout_is == "token":
                weight, cut = min(ratio, config.rollout_is_threshold), ratio > config.rollout_is_threshold
            elif config.rollout_is == "sequence":
                weight = min(sequence_ratio, config.rollout_is_threshold)
                cut = sequence_ratio > config.rollout_is_threshold
            else:
                weight, cut = 1.0, False
            judged = {"token": ratio, "sequence": sequence_ratio, "geometric": geometric_ratio}.get(config.rollout_rs)
            keep = judged is None or lower <= judged <= upper
            truncated += cut
            rejected += not keep
            row_weights.append(weight if keep else 0.0)
            row_kept.append(1.0 if keep else 0.0)
        weights.append(row_weights)
        kept.append(row_kept)
    return (torch.tensor(weights, dtype=torch.float64), torch.tensor(kept, dtype=torch.float64),
            truncated / tokens, rejected / tokens)


MODES = [(is_level, rs_level) for is_level in (None, "token", "sequence")
         for rs_level in (None, "token", "sequence", "geometric") if is_level or rs_level]


@pytest.mark.parametrize("is_level, rs_level", MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_weights_and_mask_match_the_definitions(is_level, rs_level, seed):
    config = RolloutCorrectionConfig(rollout_is=is_level, rollout_is_threshold=1.5, rollout_rs=rs_level,
                                     rollout_rs_threshold={"sequence": 2.5, "geometric": 1.15}.get(rs_level, 1.6))
    old, rollout, mask = batch(seed)
    correction = compute_rollout_correction(old, rollout, mask, config)
    weights, kept, truncated, rejected = reference(old, rollout, mask, config)
    torch.testing.assert_close(correction.weights.double(), weights, rtol=1e-6, atol=1e-7)
    assert torch.equal(correction.mask.double(), kept)
    assert correction.metrics["rollout_corr/truncated_fraction"] == pytest.approx(truncated)
    assert correction.metrics["rollout_corr/masked_token_fraction"] == pytest.approx(rejected)
    if rs_level is not None:  # the thresholds were chosen so that something is rejected and kept
        assert 0 < rejected < 1


def test_mismatch_metrics_match_the_estimators():
    old, rollout, mask = batch(3)
    metrics = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rollout_is="token")).metrics
    real = mask > 0
    delta = (old.double() - rollout.double())[real]
    assert metrics["rollout_corr/kl_k1"] == pytest.approx(float((-delta).mean()), rel=1e-9)
    assert metrics["rollout_corr/kl_k3"] == pytest.approx(float((delta.exp() - 1 - delta).mean()), rel=1e-9)
    assert metrics["rollout_corr/is_ratio_max"] == pytest.approx(float(delta.exp().max()), rel=1e-9)
    assert metrics["rollout_corr/is_ratio_mean"] == pytest.approx(float(delta.exp().mean()), rel=1e-9)


def test_hand_built_fractions():
    # One sequence: ratios e^1, 1, e^-1 -> token TIS at C=2 truncates the first token (1 of 4 real),
    # token rejection in [1/2, 2] drops the first and third tokens; the second sequence (ratio 1) stays.
    old = torch.tensor([[1.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    rollout = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token")
    correction = compute_rollout_correction(old, rollout, mask, config)
    assert correction.metrics["rollout_corr/truncated_fraction"] == 0.25
    assert correction.metrics["rollout_corr/masked_token_fraction"] == 0.5
    assert correction.metrics["rollout_corr/masked_sequence_fraction"] == 0.0
    assert correction.mask.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    sequence = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rollout_rs="geometric",
                                                                                        rollout_rs_threshold=1.01))
    assert sequence.metrics["rollout_corr/masked_sequence_fraction"] == 0.0  # geometric mean of e, 1, 1/e is 1


def test_padding_values_never_reach_the_weights():
    old, rollout, mask = batch(4)
    poisoned_old, poisoned_rollout = old.clone(), rollout.clone()
    poisoned_old[mask == 0], poisoned_rollout[mask == 0] = float("inf"), float("-inf")
    config = RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="geometric", rollout_rs_threshold=1.15)
    clean, poisoned = (compute_rollout_correction(o, r, mask, config) for o, r in ((old, rollout),
                                                                                   (poisoned_old, poisoned_rollout)))
    assert torch.equal(clean.weights, poisoned.weights) and torch.equal(clean.mask, poisoned.mask)
    assert clean.metrics == poisoned.metrics
    # log PPL_old - log PPL_rollout per sequence, averaged over sequences
    real = mask > 0
    per_sequence = [float(-(old[i] - rollout[i])[real[i]].double().mean()) for i in range(len(mask))]
    assert clean.metrics["rollout_corr/log_ppl_diff"] == pytest.approx(sum(per_sequence) / len(per_sequence))


def test_a_huge_ratio_stays_finite():
    old, rollout = torch.tensor([[0.0]]), torch.tensor([[-1000.0]])
    correction = compute_rollout_correction(old, rollout, torch.ones(1, 1), RolloutCorrectionConfig(rollout_is="token"))
    assert correction.weights.item() == 2.0 and math.isfinite(correction.metrics["rollout_corr/is_ratio_max"])


@pytest.mark.parametrize("is_level, rs_level", MODES)
def test_identical_policies_make_the_correction_a_no_op(is_level, rs_level):
    old, _, mask = batch(5)
    config = RolloutCorrectionConfig(rollout_is=is_level, rollout_rs=rs_level, rollout_rs_threshold=1.0001)
    correction = compute_rollout_correction(old, old.clone(), mask, config)
    assert torch.equal(correction.mask, mask) and torch.equal(correction.weights, mask)
    generator = torch.Generator().manual_seed(0)
    log_probs = old + 0.1 * torch.randn(old.shape, generator=generator)
    advantages = torch.randn(old.shape, generator=generator)
    actor = ActorConfig(entropy_coeff=0.0)
    scale = LossScale.from_response_masks([mask])
    plain = compute_actor_loss(old, log_probs, advantages, mask, actor, scale)
    corrected = compute_actor_loss(old, log_probs, advantages * correction.weights, correction.mask, actor, scale)
    assert torch.equal(plain.loss, corrected.loss)
    assert all(torch.equal(plain.metrics[key], corrected.metrics[key]) for key in plain.metrics)


def test_weighted_advantages_give_the_weighted_clipped_loss():
    """The actor gets w * A: for w > 0 that is exactly w times PPO's clipped (and dual-clipped) token loss."""
    old, rollout, mask = batch(7, spread=1.0)
    correction = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(rollout_is="token"))
    generator = torch.Generator().manual_seed(1)
    log_probs = old + 0.5 * torch.randn(old.shape, generator=generator)
    advantages = 2 * torch.randn(old.shape, generator=generator)
    actor = ActorConfig(entropy_coeff=0.0)
    scale = LossScale.from_response_masks([mask])
    loss = compute_actor_loss(old, log_probs, advantages * correction.weights, mask, actor, scale).loss
    total = 0.0
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            if mask[i, t] == 0:
                continue
            ratio, a = math.exp(float(log_probs[i, t]) - float(old[i, t])), float(advantages[i, t])
            clipped = min(max(ratio, 1 - actor.epsilon_low), 1 + actor.epsilon_high)
            token = max(-a * ratio, -a * clipped)
            if a < 0:
                token = min(token, -a * actor.clip_ratio_c)
            total += float(correction.weights[i, t]) * token
    assert float(loss) == pytest.approx(total / float(mask.sum()), rel=1e-5)


def test_the_trainer_leaves_the_batch_alone_when_the_correction_is_off():
    from engine.config import AlgorithmConfig
    from engine.roles import RolloutBatch
    from engine.trainer.ppo_trainer import _corrected_for_the_rollout_policy

    old, rollout, mask = batch(2)
    rows, length = mask.shape
    plain = RolloutBatch(torch.ones(rows, length + 2, dtype=torch.long), torch.ones(rows, length + 2), mask,
                         old_log_probs=old, advantages=torch.ones_like(old), rollout_log_probs=rollout)
    metrics: dict = {}
    assert _corrected_for_the_rollout_policy(plain, AlgorithmConfig(), metrics) is plain and not metrics
    algo = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="sequence"))
    corrected = _corrected_for_the_rollout_policy(plain, algo, metrics)
    assert "rollout_corr/kl_k3" in metrics
    expected = compute_rollout_correction(old, rollout, mask, algo.rollout_correction).weights
    assert torch.equal(corrected.advantages, expected) and torch.equal(corrected.old_log_probs, old)
    assert torch.equal(corrected.response_mask, mask)  # IS alone rejects nothing
    strict = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(rollout_rs="token", rollout_rs_threshold=1.0,
                                                                        rollout_rs_threshold_lower=1.0))
    with pytest.raises(ValueError, match="rejected every response token of the batch .*widen the bounds"):
        _corrected_for_the_rollout_policy(plain, strict, {})
