"""Policy / value / entropy / KL losses and their aggregation, against float64 loop references;
micro-batch invariance of every aggregation mode."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.algo import registry
from engine.algo.losses import (
    LossScale,
    aggregate_loss,
    compute_actor_loss,
    compute_policy_loss,
    compute_value_loss,
    count_tokens_and_sequences,
    explained_variance,
)
from engine.config import ActorConfig, PolicyLossConfig
from tests import algo_reference as ref

AGG_MODES = registry.names("loss_agg_mode")
MAX_LEN = 16
PROPERTY = settings(max_examples=25, deadline=None)


def _rows(matrix, mask):
    return [{t: float(matrix[i, t]) for t in ref.valid_positions(mask, i)} for i in range(mask.shape[0])]


def _scale(mask):
    return LossScale.from_response_masks([mask], max_response_length=MAX_LEN)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_matches_reference(mode):
    batch = ref.ragged_batch(7, 9, seed=11)
    mask = batch["response_mask"].clone()
    mask[3] = 0  # an all-padding row counts for nothing
    scale = _scale(mask)
    assert scale.global_num_sequences == 6 and scale.global_num_tokens == float(mask.sum())
    loss = aggregate_loss(batch["values"], mask, mode, scale)
    rows = _rows(batch["values"], mask)
    expected = ref.reference_aggregate(rows, mode, float(mask.sum()), 6, MAX_LEN)
    assert float(loss) == pytest.approx(expected, rel=1e-12, abs=1e-14)


@pytest.mark.parametrize("clip", [(0.2, None, None, 3.0), (0.2, 0.1, 0.28, 3.0), (0.3, None, None, None)])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_vanilla_ppo_matches_reference(clip, mode):
    clip_ratio, low, high, clip_c = clip
    batch = ref.ragged_batch(8, 10, seed=13)
    # Large ratios so clipping and dual-clip happen.
    batch["log_probs"] = batch["old_log_probs"] + 1.5 * (batch["log_probs"] - batch["old_log_probs"]) * 3
    config = ActorConfig(clip_ratio=clip_ratio, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c, loss_agg_mode=mode)
    mask = batch["response_mask"]
    out = compute_policy_loss(batch["old_log_probs"], batch["log_probs"], batch["advantages"], mask, config, _scale(mask))

    eps_low, eps_high = (low or clip_ratio), (high or clip_ratio)
    losses, clipped, lower, approx_kl = [], [], [], []
    for i in range(8):
        row_loss = {}
        for t in ref.valid_positions(mask, i):
            new, old, adv = float(batch["log_probs"][i, t]), float(batch["old_log_probs"][i, t]), float(batch["advantages"][i, t])
            row_loss[t], is_clipped, is_lower = ref.reference_ppo_token(math.exp(new - old), adv, eps_low, eps_high, clip_c)
            clipped.append(is_clipped)
            lower.append(is_lower)
            approx_kl.append(old - new)
        losses.append(row_loss)
    n_tokens = float(mask.sum())
    assert float(out.loss) == pytest.approx(ref.reference_aggregate(losses, mode, n_tokens, 8, MAX_LEN), rel=1e-12)
    assert float(out.metrics["pg_loss"]) == float(out.loss)
    assert float(out.metrics["pg_clipfrac"]) == pytest.approx(sum(clipped) / n_tokens, rel=1e-12)
    assert float(out.metrics["pg_clipfrac_lower"]) == pytest.approx(sum(lower) / n_tokens, rel=1e-12, abs=1e-15)
    assert float(out.metrics["ppo_kl"]) == pytest.approx(sum(approx_kl) / n_tokens, rel=1e-12)
    assert 0 < sum(clipped) < n_tokens
    assert (sum(lower) > 0) == (clip_c is not None)


def test_gspo_matches_sequence_level_objective_and_gradient():
    batch = ref.ragged_batch(8, 10, seed=17)
    mask = batch["response_mask"]
    # GSPO's advantage is per sequence (group-relative), its epsilons small.
    advantage_per_sequence = batch["advantages"][:, 0]
    advantages = advantage_per_sequence.unsqueeze(-1).expand_as(mask).clone()
    log_probs = (batch["old_log_probs"] + 0.01 * batch["log_probs"]).requires_grad_(True)
    config = ActorConfig(policy_loss=PolicyLossConfig(loss_mode="gspo"), clip_ratio_low=3e-3, clip_ratio_high=4e-3,
                         loss_agg_mode="seq-mean-token-mean")
    out = compute_policy_loss(batch["old_log_probs"], log_probs, advantages, mask, config, _scale(mask))

    # Reference: J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) with
    # s_i = exp(mean_t log pi/pi_old), differentiated through s_i itself.
    reference_log_probs = log_probs.detach().clone().requires_grad_(True)
    objective, clipped_sequences = 0.0, 0
    for i in range(8):
        steps = ref.valid_positions(mask, i)
        log_ratio = sum(reference_log_probs[i, t] - batch["old_log_probs"][i, t] for t in steps) / len(steps)
        s = torch.exp(log_ratio)
        a = advantage_per_sequence[i]
        objective = objective + torch.minimum(s * a, s.clamp(1 - 3e-3, 1 + 4e-3) * a)
        clipped_sequences += int(bool((a > 0 and s > 1 + 4e-3) or (a < 0 and s < 1 - 3e-3)))
    reference_loss = -objective / 8
    reference_loss.backward()
    out.loss.backward()
    assert float(out.loss.detach()) == pytest.approx(float(reference_loss.detach()), rel=1e-12)
    torch.testing.assert_close(log_probs.grad, reference_log_probs.grad, rtol=1e-10, atol=1e-14)
    assert 0 < clipped_sequences < 8  # both branches exercised


@pytest.mark.parametrize("cliprange_value", [0.2, None])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_matches_reference(cliprange_value, mode):
    batch = ref.ragged_batch(6, 8, seed=19)
    mask = batch["response_mask"]
    out = compute_value_loss(batch["values"], batch["old_values"], batch["returns"], mask, cliprange_value, mode, _scale(mask))
    losses, clipped = [], 0
    for i in range(6):
        row = {}
        for t in ref.valid_positions(mask, i):
            v, v_old, ret = (float(batch[k][i, t]) for k in ("values", "old_values", "returns"))
            if cliprange_value is None:
                row[t] = 0.5 * (v - ret) ** 2
                continue
            v_clipped = min(max(v, v_old - cliprange_value), v_old + cliprange_value)
            row[t] = 0.5 * max((v - ret) ** 2, (v_clipped - ret) ** 2)
            clipped += (v_clipped - ret) ** 2 > (v - ret) ** 2
        losses.append(row)
    n_tokens = float(mask.sum())
    assert float(out.loss) == pytest.approx(ref.reference_aggregate(losses, mode, n_tokens, 6, MAX_LEN), rel=1e-12)
    assert float(out.metrics["vf_clipfrac"]) == pytest.approx(clipped / n_tokens, abs=1e-15)
    assert (clipped > 0) == (cliprange_value is not None)


def test_explained_variance():
    batch = ref.ragged_batch(6, 8, seed=23)
    mask = batch["response_mask"]
    returns, values = batch["returns"], batch["returns"] + 0.5 * batch["values"]
    r = [float(returns[i, t]) for i in range(6) for t in ref.valid_positions(mask, i)]
    d = [float(returns[i, t] - values[i, t]) for i in range(6) for t in ref.valid_positions(mask, i)]

    def variance(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)

    assert float(explained_variance(values, returns, mask)) == pytest.approx(1 - variance(d) / variance(r), rel=1e-12)
    assert float(explained_variance(returns, returns, mask)) == 1.0


def test_actor_loss_combines_terms():
    batch = ref.ragged_batch(6, 8, seed=29)
    mask = batch["response_mask"]
    scale = _scale(mask)
    config = ActorConfig(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                         kl_loss_type="low_var_kl")
    args = (batch["old_log_probs"], batch["log_probs"], batch["advantages"], mask)
    out = compute_actor_loss(*args, config, scale, entropy=batch["entropy"], ref_log_probs=batch["ref_log_probs"])
    kl_rows = [{t: ref.reference_kl(float(batch["log_probs"][i, t]), float(batch["ref_log_probs"][i, t]), "k3")
                for t in ref.valid_positions(mask, i)} for i in range(6)]
    n_tokens = float(mask.sum())
    kl_loss = ref.reference_aggregate(kl_rows, "seq-mean-token-mean", n_tokens, 6)
    entropy = ref.reference_aggregate(_rows(batch["entropy"], mask), "seq-mean-token-mean", n_tokens, 6)
    pg_loss = float(compute_policy_loss(*args, config, scale).loss)
    assert float(out.metrics["kl_loss"]) == pytest.approx(kl_loss, rel=1e-12)
    assert float(out.metrics["entropy"]) == pytest.approx(entropy, rel=1e-12)
    assert float(out.loss) == pytest.approx(pg_loss - 0.01 * entropy + 0.1 * kl_loss, rel=1e-12)
    with pytest.raises(ValueError, match="ref_log_probs"):
        compute_actor_loss(*args, config, scale, entropy=batch["entropy"])
    with pytest.raises(ValueError, match="entropy_coeff"):
        compute_actor_loss(*args, config, scale, ref_log_probs=batch["ref_log_probs"])


def test_bad_inputs_are_named():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate_loss(torch.ones(2, 3), mask, "seq-mean-token-sum-norm", LossScale(6, 2))
    with pytest.raises(ValueError, match="global_num_tokens"):
        LossScale.from_response_masks([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="response_len"):
        compute_policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), mask, ActorConfig(), LossScale(6, 2))


# --- Properties ------------------------------------------------------------------------------

batch_shapes = st.tuples(st.integers(1, 8), st.integers(1, 10), st.integers(0, 10_000))


@PROPERTY
@given(batch_shapes, st.sampled_from(["vanilla", "gspo"]), st.sampled_from(AGG_MODES))
def test_first_ppo_step_has_zero_kl_and_clipfrac(shape, loss_mode, mode):
    batch = ref.ragged_batch(*shape, dtype=torch.float32)
    mask = batch["response_mask"]
    log_probs = batch["old_log_probs"].clone()
    config = ActorConfig(policy_loss=PolicyLossConfig(loss_mode=loss_mode), loss_agg_mode=mode, clip_ratio_low=1e-4,
                         clip_ratio_high=1e-4)
    out = compute_policy_loss(batch["old_log_probs"], log_probs, batch["advantages"], mask, config, _scale(mask))
    assert out.metrics["ppo_kl"].item() == 0.0
    assert out.metrics["pg_clipfrac"].item() == 0.0
    assert out.metrics["pg_clipfrac_lower"].item() == 0.0


@PROPERTY
@given(batch_shapes, st.sampled_from(AGG_MODES), st.integers(1, 5))
def test_padding_and_masked_tokens_never_change_losses(shape, mode, extra_columns):
    batch = ref.ragged_batch(*shape)
    batch_size, response_len, seed = shape
    mask = batch["response_mask"]
    generator = torch.Generator().manual_seed(seed + 1)
    padded_mask = torch.cat([mask, torch.zeros(batch_size, extra_columns, dtype=mask.dtype)], dim=1)
    padded_mask = torch.cat([padded_mask, torch.zeros(1, padded_mask.shape[1], dtype=mask.dtype)])  # a padding row

    def padded(x):
        x = torch.cat([x, torch.zeros(batch_size, extra_columns, dtype=x.dtype)], dim=1)
        x = torch.cat([x, torch.zeros(1, x.shape[1], dtype=x.dtype)])
        return torch.where(padded_mask > 0, x, 5 * torch.randn(x.shape, generator=generator, dtype=x.dtype))

    def all_losses(b, m):
        scale = _scale(m)
        results = {}
        for loss_mode in ("vanilla", "gspo"):
            config = ActorConfig(policy_loss=PolicyLossConfig(loss_mode=loss_mode), loss_agg_mode=mode, entropy_coeff=0.01,
                                 use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3+")
            out = compute_actor_loss(b["old_log_probs"], b["log_probs"], b["advantages"], m, config, scale,
                                     entropy=b["entropy"], ref_log_probs=b["ref_log_probs"])
            results.update({f"{loss_mode}/{k}": v for k, v in out.metrics.items()}, **{loss_mode: out.loss})
        value = compute_value_loss(b["values"], b["old_values"], b["returns"], m, 0.2, mode, scale)
        results.update(value.metrics)
        return results

    reference = all_losses(batch, mask)
    with_padding = all_losses({k: padded(v) for k, v in batch.items() if k != "response_mask"}, padded_mask)
    for key, value in reference.items():
        torch.testing.assert_close(with_padding[key], value, rtol=1e-12, atol=1e-12, msg=key)


def _split(batch, sizes):
    """Consecutive micro-batches of the given sizes, each cut to its own longest response (ragged
    widths, as a dynamic-batching data loader produces)."""
    pieces, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        width = int(max(int(batch["response_mask"][rows].nonzero()[:, 1].max()) + 1, 1))
        pieces.append({k: v[rows, :width] for k, v in batch.items()})
        start += size
    return pieces


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_split_gives_same_loss_and_gradient(mode):
    batch = ref.ragged_batch(8, 12, seed=31, holes=True)
    # Random lengths: each micro-batch gets a different padded width.
    leaves = {k: batch[k].clone().requires_grad_(True) for k in ("log_probs", "values", "entropy")}
    outcomes = {}
    for split in ([8], [3, 5], [2, 1, 4, 1]):
        for leaf in leaves.values():
            leaf.grad = None
        full = dict(batch, **leaves)
        micro_batches = _split(full, split)
        scale = LossScale.from_counts(count_tokens_and_sequences(m["response_mask"] for m in micro_batches), MAX_LEN)
        totals: dict[str, torch.Tensor] = {}
        for micro in micro_batches:
            for loss_mode in ("vanilla", "gspo"):
                config = ActorConfig(policy_loss=PolicyLossConfig(loss_mode=loss_mode), loss_agg_mode=mode,
                                     entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl")
                out = compute_actor_loss(micro["old_log_probs"], micro["log_probs"], micro["advantages"], micro["response_mask"],
                                         config, scale, entropy=micro["entropy"], ref_log_probs=micro["ref_log_probs"])
                value = compute_value_loss(micro["values"], micro["old_values"], micro["returns"], micro["response_mask"], 0.3, mode, scale)
                (out.loss + value.loss).backward()
                for key, metric in {**out.metrics, **value.metrics, "loss": out.loss.detach()}.items():
                    totals[f"{loss_mode}/{key}"] = totals.get(f"{loss_mode}/{key}", 0) + metric
        outcomes[len(split)] = (totals, {k: leaf.grad.clone() for k, leaf in leaves.items()})

    reference_totals, reference_grads = outcomes[1]
    assert all(g.abs().sum() > 0 for g in reference_grads.values())
    for count in (2, 4):
        totals, grads = outcomes[count]
        for key, value in reference_totals.items():
            torch.testing.assert_close(totals[key], value, rtol=0, atol=1e-6, msg=key)
        for key, grad in reference_grads.items():
            torch.testing.assert_close(grads[key], grad, rtol=0, atol=1e-6, msg=key)
