"""Scoring the global rollout batch once per job in an SPMD run, not once per rank.

After generation every rank holds the same global batch. Scoring it on every rank would repeat the
work world-size times and, for a reward that is not deterministic (a sampled judge, a timed
sandbox), give ranks different scores and so different advantages. Instead each response is scored
by exactly one rank and the results are shared:
- in-process scorers: rank r scores rows r, r + W, r + 2W, ... (strided, so long and short
  responses spread evenly) and the shares are all-gathered back into input order;
- a Ray pool (`reward_model.num_workers > 0`): only global rank 0 holds the job's pool, scores the
  whole batch there and broadcasts the results (one pool per job, not one per rank).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch.distributed as dist

from engine.config.reward_model import RewardConfig
from engine.rewards.manager import RewardManager, RewardResult, batch_items
from engine.rewards.scoring import ScoredSample
from parallel.state import control_group

T = TypeVar("T")
R = TypeVar("R")


def reward_manager_for_this_rank(config: RewardConfig) -> RewardManager:
    """The job's reward manager on this rank: the Ray pool, if configured, starts on global rank 0 only."""
    is_rank_zero = not dist.is_initialized() or dist.get_rank() == 0
    return RewardManager(config, start_pool=is_rank_zero)


def score_on_all_ranks(manager: RewardManager, responses: Sequence[str], data_sources: Sequence[str],
                       ground_truths: Sequence[Any], extra_infos: Sequence[dict | None] | None = None) -> RewardResult:
    """`manager.score` of the global batch that every rank holds, each response scored on one rank only.

    Every rank must call this with the same batch; all get the same `RewardResult`.
    """
    items = batch_items(responses, data_sources, ground_truths, extra_infos)
    if manager.config.num_workers > 0 and dist.is_initialized() and dist.get_world_size() > 1:
        box: list[list[ScoredSample] | None] = [manager.score_items(items) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0, group=control_group())  # the others wait while rank 0 scores
        scored = box[0]
    else:
        scored = strided_on_all_ranks(manager.score_items, items)
    return manager.collect(scored, data_sources)


def strided_on_all_ranks(work: Callable[[list[T]], list[R]], items: Sequence[T]) -> list[R]:
    """``work(items)`` for a batch every rank holds, each item done by one rank: rank r takes items
    r, r + W, ... (strided, so long and short ones spread evenly) and the shares are all-gathered
    back into input order on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work(list(items))
    rank, world = dist.get_rank(), dist.get_world_size()
    shares: list[list[R] | None] = [None] * world
    dist.all_gather_object(shares, work(list(items[rank::world])), group=control_group())
    results: list = [None] * len(items)
    for owner, share in enumerate(shares):
        results[owner::world] = share
    return results
