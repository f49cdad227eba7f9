"""DAPO's dynamic sampling (``algorithm.filter_groups``): generate and score rounds of
``data.train_batch_size`` prompts (off-policy: the batches generating ahead, in order) until that
many prompt groups with a spread of ``metric`` exist, and train on exactly that many (verl's
``recipe/dapo`` trainer does the same on its driver; here every rank holds the same scored global
batch, so every rank keeps the same groups with no communication).

The rounds run while the rollout engine holds its memory (releasing colocated weights would need a
push before the next round), which is why a learned reward model, whose forward would peak with the
engine, is refused with colocated engines (``engine.config.validation``).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from engine.algo.dapo import groups_with_spread
from engine.config.algorithm import FilterGroupsConfig
from engine.config.errors import ConfigError
from engine.rewards.combine import RewardScores
from engine.roles import RolloutBatch


class GroupsExhausted(ConfigError):
    """``algorithm.filter_groups.max_num_gen_batches`` rounds did not yield a full batch."""


@dataclasses.dataclass
class ScoredRollout:
    """A generated global batch with its rewards (``ppo_trainer._score``'s results)."""

    rollout: RolloutBatch
    scores: torch.Tensor  # [B] the reward of each response
    sources: RewardScores  # the scores of each source
    metrics: dict[str, float]  # reward/*

    def select(self, rows: torch.Tensor) -> "ScoredRollout":
        sources = _each_source([self], lambda scores: scores[0][rows])
        return ScoredRollout(self.rollout.select(rows), self.scores[rows], sources, self.metrics)

    @staticmethod
    def concat(parts: list["ScoredRollout"], pad_id: int, metrics: dict[str, float]) -> "ScoredRollout":
        """One batch of several rounds, with ``metrics``."""
        return ScoredRollout(RolloutBatch.concat([p.rollout for p in parts], pad_id), torch.cat([p.scores for p in parts]),
                             _each_source(parts, torch.cat), metrics)


def _each_source(parts: list[ScoredRollout], combine: Callable) -> RewardScores:
    """``combine`` applied to each reward source's scores of ``parts`` (a source that is off stays None)."""
    return RewardScores(**{field.name: None if getattr(parts[0].sources, field.name) is None
                           else combine([getattr(p.sources, field.name) for p in parts])
                           for field in dataclasses.fields(RewardScores)})


def filter_values(scored: ScoredRollout, metric: str) -> torch.Tensor:
    """The per-response values whose spread within a group decides it (``FilterGroupsConfig.metric``)."""
    if metric == "acc":
        if scored.sources.rule is None:
            raise ConfigError("algorithm.filter_groups.metric=acc counts correct responses by their rule score, and "
                              "this run has none (no data source with a scorer, no custom_reward_function); "
                              "use metric=score")
        return (scored.sources.rule >= 1.0).float()
    return scored.scores  # "score" and "seq_reward" (the token-level scores' sum is the score)


def fill_with_groups_with_spread(first: ScoredRollout, next_round: Callable[[], ScoredRollout],
                                 config: FilterGroupsConfig, groups_wanted: int, group_size: int,
                                 pad_id: int) -> tuple[ScoredRollout, dict[str, float]]:
    """Exactly ``groups_wanted`` groups of ``group_size`` responses with a spread, taken in order
    from ``first`` and as many rounds of ``next_round()`` as needed; and the rounds' metrics."""
    kept: list[ScoredRollout] = []
    reward_metrics: list[dict[str, float]] = []
    kept_groups = generated_groups = rounds = 0
    generation_s = 0.0
    scored = first
    while True:
        rounds += 1
        reward_metrics.append(scored.metrics)
        generation_s += scored.rollout.generation_s
        spread = groups_with_spread(filter_values(scored, config.metric), group_size)
        generated_groups += len(spread)
        rows = torch.arange(len(scored.scores)).view(-1, group_size)[spread].flatten()
        if len(rows):
            kept.append(scored.select(rows))
        kept_groups += int(spread.sum())
        if kept_groups >= groups_wanted:
            break
        if config.max_num_gen_batches and rounds >= config.max_num_gen_batches:
            raise GroupsExhausted(
                f"dynamic sampling found {kept_groups} of the {groups_wanted} prompt groups it needs "
                f"(data.train_batch_size) in {rounds} round(s) of generation: the other "
                f"{generated_groups - kept_groups} groups' {group_size} responses all had the same "
                f"{config.metric} (algorithm.filter_groups.metric). Raise algorithm.filter_groups.max_num_gen_batches "
                f"(now {config.max_num_gen_batches}; 0 = no limit), raise actor_rollout_ref.rollout.n, or use data "
                f"whose difficulty suits the model")
        scored = next_round()
    # A reward/* metric describes every generated response: the mean of the rounds' (equal sizes).
    batch = ScoredRollout.concat(kept, pad_id, {key: sum(m[key] for m in reward_metrics) / rounds
                                                for key in reward_metrics[0]})
    batch = batch.select(torch.arange(groups_wanted * group_size))  # the last round's surplus is discarded
    # Group ids for the estimators: a prompt drawn again in a later round (the data wrapped around)
    # is a group of its own, not one group of 2n. The generation time is every round's.
    batch.rollout = dataclasses.replace(batch.rollout, uids=torch.arange(groups_wanted).repeat_interleave(group_size),
                                        generation_s=generation_s)
    metrics = {"rollout/num_gen_batches": float(rounds),
               "rollout/filtered_groups/fraction": 1.0 - kept_groups / generated_groups}
    return batch, metrics
