"""Advantage estimators against the float64 loop references, and their invariants."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from engine.algo.advantages import (
    GRPO_EPSILON,
    AdvantageInputs,
    compute_advantages,
    compute_gae,
    group_index_from_uids,
)
from engine.algo.stats import masked_whiten
from engine.config import AlgorithmConfig
from tests import algo_reference as ref

PROPERTY = settings(max_examples=25, deadline=None)
ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")


def _inputs(batch: dict, group_size: int = 4) -> AdvantageInputs:
    batch_size = batch["response_mask"].shape[0]
    return AdvantageInputs(
        token_level_rewards=batch["token_level_rewards"],
        response_mask=batch["response_mask"],
        values=batch["values"],
        group_index=torch.arange(batch_size) // group_size,
        baseline_scores=batch["returns"][:, 0],
    )


def _expected(name: str, inputs: AdvantageInputs, config: AlgorithmConfig):
    rewards, mask = inputs.token_level_rewards, inputs.response_mask
    if name == "gae":
        advantages, returns = ref.reference_gae(rewards, inputs.values, mask, config.gamma, config.lam)
        return ref.reference_whiten(advantages, mask), returns
    if name == "grpo":
        advantages = ref.reference_grpo(rewards, mask, inputs.group_index, config.norm_adv_by_std_in_grpo, GRPO_EPSILON)
        return advantages, advantages
    if name == "rloo":
        advantages = ref.reference_rloo(rewards, mask, inputs.group_index)
        return advantages, advantages
    if name == "reinforce_plus_plus":
        return ref.reference_reinforce_plus_plus(rewards, mask, config.gamma)
    if name == "reinforce_plus_plus_baseline":
        advantages = ref.reference_reinforce_plus_plus_baseline(rewards, mask, inputs.group_index)
        return advantages, advantages
    return ref.reference_remax(rewards, mask, inputs.baseline_scores, config.gamma)


@pytest.mark.parametrize("name", ESTIMATORS)
@pytest.mark.parametrize("seed", [0, 1])
def test_estimator_matches_loop_reference(name, seed):
    inputs = _inputs(ref.ragged_batch(12, 9, seed))
    config = AlgorithmConfig(adv_estimator=name, gamma=0.97, lam=0.9)
    output = compute_advantages(inputs, config)
    expected_advantages, expected_returns = _expected(name, inputs, config)
    torch.testing.assert_close(output.advantages, expected_advantages, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(output.returns, expected_returns, rtol=1e-10, atol=1e-10)


def test_dr_grpo_and_ragged_groups_match_reference():
    batch = ref.ragged_batch(10, 7, seed=3)
    # Groups of sizes 3, 1, 4, 2 in shuffled order; the singleton gets advantage 0.
    group_index = torch.tensor([5, 9, 5, 2, 2, 7, 2, 5, 7, 2])
    inputs = AdvantageInputs(batch["token_level_rewards"], batch["response_mask"], group_index=group_index)
    for norm in (True, False):
        output = compute_advantages(inputs, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=norm))
        expected = ref.reference_grpo(batch["token_level_rewards"], batch["response_mask"], group_index, norm, 1e-6)
        torch.testing.assert_close(output.advantages, expected, rtol=1e-10, atol=1e-10)
    assert torch.all(output.advantages[1] == 0)
    rloo = compute_advantages(inputs, AlgorithmConfig(adv_estimator="rloo")).advantages
    torch.testing.assert_close(rloo, ref.reference_rloo(batch["token_level_rewards"], batch["response_mask"], group_index))


def test_group_index_from_uids_keeps_first_appearance_order():
    assert group_index_from_uids(["b", "a", "b", "c", "a"]).tolist() == [0, 1, 0, 2, 1]


def test_whiten_keep_mean():
    batch = ref.ragged_batch(6, 5, seed=4)
    x, mask = batch["values"], batch["response_mask"]
    shifted = masked_whiten(x, mask, shift_mean=False)
    mean = x[mask > 0].mean()
    torch.testing.assert_close(shifted[mask > 0].mean(), mean)
    torch.testing.assert_close(shifted[mask > 0].std(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_bad_group_index_is_named():
    batch = ref.ragged_batch(4, 3, seed=0)
    inputs = AdvantageInputs(batch["token_level_rewards"], batch["response_mask"], group_index=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages(inputs, AlgorithmConfig(adv_estimator="grpo"))


# --- Properties ------------------------------------------------------------------------------

batch_shapes = st.tuples(st.integers(2, 8), st.integers(1, 8), st.integers(0, 10_000))


@PROPERTY
@given(batch_shapes, st.sampled_from(ESTIMATORS), st.integers(1, 5))
def test_padding_and_masked_tokens_never_change_advantages(shape, name, extra_columns):
    batch_size, response_len, seed = shape
    batch = ref.ragged_batch(batch_size * 2, response_len, seed)
    inputs = _inputs(batch, group_size=2)
    config = AlgorithmConfig(adv_estimator=name, gamma=0.95, lam=0.8)
    if int(inputs.response_mask.sum()) < 2:
        return  # whitening needs two tokens
    reference = compute_advantages(inputs, config)

    # Garbage at masked positions and in extra right-padding columns.
    generator = torch.Generator().manual_seed(seed + 1)
    mask = torch.cat([inputs.response_mask, torch.zeros(batch_size * 2, extra_columns, dtype=torch.float64)], dim=1)

    def pad_with_garbage(x):
        padded = torch.cat([x, torch.zeros(x.shape[0], extra_columns, dtype=x.dtype)], dim=1)
        garbage = 1e3 * torch.randn(padded.shape, generator=generator, dtype=x.dtype)
        return torch.where(mask > 0, padded, garbage)

    padded_inputs = AdvantageInputs(
        pad_with_garbage(inputs.token_level_rewards), mask, pad_with_garbage(inputs.values),
        inputs.group_index, inputs.baseline_scores,
    )
    padded = compute_advantages(padded_inputs, config)
    torch.testing.assert_close(padded.advantages[:, :response_len], reference.advantages, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(padded.returns[:, :response_len], reference.returns, rtol=1e-9, atol=1e-9)
    assert torch.all(padded.advantages[mask == 0] == 0) and torch.all(padded.returns[mask == 0] == 0)


@PROPERTY
@given(batch_shapes)
def test_gae_with_unit_gamma_and_lambda_is_reward_to_go_minus_value(shape):
    batch = ref.ragged_batch(*shape)
    rewards, values, mask = batch["token_level_rewards"], batch["values"], batch["response_mask"]
    advantages, returns = compute_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # Reward-to-go as a flipped cumulative sum of the masked rewards (holes carry no reward).
    reward_to_go = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(advantages, (reward_to_go - values) * mask, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(returns, reward_to_go * mask, rtol=1e-10, atol=1e-10)


@PROPERTY
@given(batch_shapes, st.integers(1, 4), st.booleans())
def test_grpo_advantages_sum_to_zero_within_each_group(shape, group_size, norm):
    batch_size, response_len, seed = shape
    batch = ref.ragged_batch(batch_size * group_size, response_len, seed)
    group_index = torch.randperm(batch_size * group_size, generator=torch.Generator().manual_seed(seed)) % batch_size
    inputs = AdvantageInputs(batch["token_level_rewards"], batch["response_mask"], group_index=group_index)
    advantages = compute_advantages(inputs, AlgorithmConfig(adv_estimator="grpo", norm_adv_by_std_in_grpo=norm)).advantages
    per_sequence = advantages.sum(-1) / batch["response_mask"].sum(-1)
    for group in range(batch_size):
        assert abs(float(per_sequence[group_index == group].sum())) < 1e-9
