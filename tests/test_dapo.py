"""DAPO's reward side: dynamic sampling (``algorithm.filter_groups``) and overlong reward shaping
(``reward_model.overlong_buffer``), on one process against references written independently."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.algo.dapo import groups_with_spread, overlong_penalty
from engine.config import ConfigError, load_config
from engine.config.algorithm import FilterGroupsConfig
from engine.rewards.combine import RewardScores
from engine.trainer.dynamic_sampling import GroupsExhausted, ScoredRollout, fill_with_groups_with_spread
from engine.roles.batch import SampleInfo
from engine.rollout.agentic.trajectory import Trajectory, TrajectoryStats
from engine.trainer.rollout import to_rollout_batch

DEMO = Path(__file__).resolve().parents[1] / "yaml" / "demo_cpu.yaml"
GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "algorithm.use_kl_in_reward=false"]


def test_overlong_penalty_equals_a_float64_reference_on_crafted_lengths():
    max_length, buffer, factor = 20, 6, 0.7
    lengths = torch.tensor([0, 1, 13, 14, 15, 17, 19, 20])

    def reference(length: int) -> float:  # DAPO eq. 13, piecewise
        if length <= max_length - buffer:
            return 0.0
        return (max_length - buffer - length) / buffer * factor

    expected = torch.tensor([reference(int(n)) for n in lengths], dtype=torch.float64)
    got = overlong_penalty(lengths, max_length, buffer, factor)
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-7)
    assert got[-1].item() == pytest.approx(-factor) and (got[:4] == 0).all() and (got[4:].diff() < 0).all()
    # A buffer of the whole length penalises from the first token.
    assert overlong_penalty(torch.tensor([10]), 20, 20, 1.0).item() == pytest.approx(-0.5)


def test_groups_with_spread_keeps_groups_whose_responses_differ():
    values = torch.tensor([1., 1., 0., 0., 0., 0., 0.5, 0.5, 0.5, 0.2, 0.7, 0.2])
    assert groups_with_spread(values, 3).tolist() == [True, False, False, True]
    assert groups_with_spread(torch.tensor([1., 1e-9]), 2).tolist() == [True]  # any spread counts
    with pytest.raises(ValueError, match="multiple of the group size 3"):
        groups_with_spread(torch.zeros(4), 3)


def scored_round(round_index: int, correct: list[list[int]], prompt_length: int) -> ScoredRollout:
    """One generated round: a group per entry of ``correct`` (its responses' rule scores), prompts
    of ``prompt_length`` tokens; every token names its round, group and row."""
    prompts, responses, uids = [], [], []
    for group, rule in enumerate(correct):
        for row, _ in enumerate(rule):
            tag = 1000 * round_index + 10 * group + row
            prompts.append([tag] * prompt_length)
            responses.append(Trajectory([tag, tag + 1][: 1 + row % 2], [-0.5, -0.25][: 1 + row % 2], [1] * (1 + row % 2),
                                        routed_experts=torch.full((prompt_length + 1 + row % 2, 2, 1), tag % 8,
                                                                  dtype=torch.int16)))
            uids.append(group)  # prompt uids repeat across rounds, as when the data wraps around
    batch = to_rollout_batch(prompts, responses, response_length=3, pad_id=0)
    samples = [SampleInfo("d", str(tag), {}, [], TrajectoryStats(turns=1)) for tag in range(len(prompts))]
    batch = dataclasses.replace(batch, uids=torch.tensor(uids), samples=samples, policy_version=3, generation_s=1.0)
    rule = torch.tensor([score for group in correct for score in group], dtype=torch.float32)
    return ScoredRollout(batch, rule * 2 - 0.5,
                         RewardScores(rule=rule), {"reward/rule/mean": rule.mean().item()})


def test_dynamic_sampling_fills_exactly_the_batch_with_groups_that_have_a_spread():
    rounds = [scored_round(0, [[1, 1], [0, 1], [0, 0]], prompt_length=2),
              scored_round(1, [[1, 1], [0, 0], [0, 0]], prompt_length=4),
              scored_round(2, [[1, 0], [1, 1], [0, 1], [1, 0]], prompt_length=3)]
    more = iter(rounds[1:])
    batch, metrics = fill_with_groups_with_spread(rounds[0], lambda: next(more), FilterGroupsConfig(enable=True),
                                                  groups_wanted=3, group_size=2, pad_id=0)
    # Kept, in order: round 0 group 1, round 2 groups 0 and 2 (round 2's group 3 is surplus).
    origin = [(0, 1), (2, 0), (2, 2)]
    assert len(batch.scores) == 6 and next(more, None) is None
    rule = batch.sources.rule.view(3, 2)
    assert (rule.amax(dim=1) > rule.amin(dim=1)).all()
    assert batch.rollout.uids.tolist() == [0, 0, 1, 1, 2, 2]  # a group id each, whatever the prompt
    ids = batch.rollout.input_ids
    assert ids.shape == (6, 3 + 3)  # prompts left-padded to round 2's width
    for row, (round_index, group) in enumerate(x for x in origin for _ in range(2)):
        source = rounds[round_index]
        source_row = 2 * group + row % 2
        tag = 1000 * round_index + 10 * group + row % 2
        width = source.rollout.input_ids.shape[1]
        assert ids[row, -width:].tolist() == source.rollout.input_ids[source_row].tolist()
        assert ids[row, :-width].tolist() == [0] * (6 - width)
        assert batch.rollout.attention_mask[row].sum() == source.rollout.attention_mask[source_row].sum()
        assert batch.rollout.rollout_log_probs[row].tolist() == source.rollout.rollout_log_probs[source_row].tolist()
        assert batch.rollout.samples[row].ground_truth == source.rollout.samples[source_row].ground_truth
        assert batch.scores[row] == source.scores[source_row]
        experts = batch.rollout.routed_experts[row]
        assert (experts[-width:] == source.rollout.routed_experts[source_row]).all()
        assert (experts[:-width] == -1).all() and (experts[-width:][experts[-width:] >= 0] == tag % 8).all()
    assert metrics == {"rollout/num_gen_batches": 3.0, "rollout/filtered_groups/fraction": 1 - 4 / 10}
    assert batch.metrics["reward/rule/mean"] == pytest.approx((3 / 6 + 2 / 6 + 5 / 8) / 3)  # every round
    assert batch.rollout.generation_s == 3.0


def test_dynamic_sampling_stops_with_a_message_when_the_rounds_run_out():
    first = scored_round(0, [[1, 1], [0, 1], [0, 0]], prompt_length=2)
    config = FilterGroupsConfig(enable=True, max_num_gen_batches=2)
    with pytest.raises(GroupsExhausted) as error:
        fill_with_groups_with_spread(first, lambda: scored_round(1, [[0, 0]] * 3, 2), config, 3, 2, pad_id=0)
    message = str(error.value)
    assert "found 1 of the 3 prompt groups it needs (data.train_batch_size) in 2 round(s)" in message
    assert "algorithm.filter_groups.max_num_gen_batches (now 2" in message and "same acc" in message
    # "score" filters on the combined reward; "acc" needs rule scores.
    first.sources = RewardScores(model=first.scores)
    with pytest.raises(ConfigError, match="metric=acc counts correct responses by their rule score"):
        fill_with_groups_with_spread(first, lambda: first, config, 1, 2, pad_id=0)
    kept, _ = fill_with_groups_with_spread(first, lambda: first, FilterGroupsConfig(metric="score"), 1, 2, pad_id=0)
    assert kept.scores.tolist() == [-0.5, 1.5]


def error_of(overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, overrides, world_size=2)
    return str(info.value)


def test_settings_out_of_range_or_not_built_are_refused():
    on = [*GRPO, "algorithm.filter_groups.enable=true"]
    load_config(DEMO, on, world_size=2)
    assert "algorithm.filter_groups.metric='accuracy' is not a valid choice. Did you mean 'acc'?" in error_of(
        [*on, "algorithm.filter_groups.metric=accuracy"])
    assert "max_num_gen_batches=-1: must be >= 0" in error_of([*on, "algorithm.filter_groups.max_num_gen_batches=-1"])
    assert "rollout.n=1: must be >= 2 with algorithm.filter_groups.enable=true" in error_of(
        ["algorithm.filter_groups.enable=true"])
    assert "adv_estimator=remax (dynamic sampling with its greedy baselines is not built)" in error_of(
        [*on, "algorithm.adv_estimator=remax"])
    message = error_of([*on, "reward_model.enable=true", "reward_model.model.path=.cache/models/demo-arith-reward"])
    assert "mode=colocated" in message and "not built" in message
    key = "reward_model.overlong_buffer"
    assert f"{key}.len=9: must be in [1, data.max_response_length=8]" in error_of([f"{key}.enable=true", f"{key}.len=9"])
    assert f"{key}.len=0: must be in [1" in error_of([f"{key}.enable=true"])
    assert f"{key}.penalty_factor=-1.0: must be >= 0" in error_of(
        [f"{key}.enable=true", f"{key}.len=2", f"{key}.penalty_factor=-1"])
