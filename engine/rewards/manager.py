"""`RewardManager`: scores a batch of decoded responses, in-process or in a Ray CPU pool, without ever crashing."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from engine.config.reward_model import RewardConfig
from engine.rewards.registry import has_builtin_scorer, resolve_compute_score
from engine.rewards.scoring import ScoredSample, score_one

logger = logging.getLogger(__name__)


@dataclass
class RewardResult:
    """Scores of one batch.

    Attributes:
        scores: [batch] float32 sequence-level scores (0 where the reward function failed).
        extras: extra keys of dict results, one list per key aligned with the batch (None where a
            sample did not return that key).
        errors: per sample, the error text or None.
        metrics: `reward/errors` (count of failed calls) and `reward/<key>/mean` of numeric extras.
    """

    scores: torch.Tensor
    extras: dict[str, list[Any]]
    errors: list[str | None]
    metrics: dict[str, float]


class RewardFunctionError(RuntimeError):
    """The reward function kept failing; the message quotes its first error."""


class RewardManager:
    """Scores responses with the configured compute_score; a raising call scores 0 and is counted.

    The compute_score function is resolved (and a custom file imported) in the constructor, so a bad
    `reward_model.custom_reward_function` fails at start-up. With `reward_model.num_workers > 0`
    scoring goes to a Ray pool, started here unless `start_pool` is False (in an SPMD job one rank
    holds the job's pool: `engine.rewards.spmd`).
    """

    def __init__(self, config: RewardConfig, *, start_pool: bool = True):
        self.config = config
        self.compute_score = resolve_compute_score(config)
        self.failing_steps = 0  # training steps in a row with too many failed reward calls
        self.pool = None
        if config.num_workers > 0 and start_pool:
            from engine.rewards.ray_pool import RewardWorkerPool

            self.pool = RewardWorkerPool(config)

    def check_data_sources(self, data_sources: Iterable[str]) -> None:
        """Raise now, naming them, if the built-in scorers cannot score some data sources."""
        if self.config.custom_reward_function.path:
            return  # a user function decides what it accepts
        unknown = sorted(source for source in set(data_sources) if not has_builtin_scorer(source))
        if unknown:
            raise ValueError(f"no built-in reward for data_source {unknown} (built-in: 'openai/gsm8k', "
                             f"'reasoning_gym/<task>'); set reward_model.custom_reward_function.path")

    def score(self, responses: Sequence[str], data_sources: Sequence[str], ground_truths: Sequence[Any],
              extra_infos: Sequence[dict[str, Any] | None] | None = None) -> RewardResult:
        """Score decoded responses against their rows' ground truth; results are in input order."""
        items = batch_items(responses, data_sources, ground_truths, extra_infos)
        return self.collect(self.score_items(items), data_sources)

    def score_items(self, items: Sequence[tuple[str, str, Any, dict | None]]) -> list[ScoredSample]:
        """Score (data_source, solution_str, ground_truth, extra_info) tuples, in the pool if there is one."""
        if self.pool is not None:
            return self.pool.score(items)
        return [score_one(self.compute_score, *item) for item in items]

    @staticmethod
    def collect(scored: list[ScoredSample], data_sources: Sequence[str]) -> RewardResult:
        errors = [sample.error for sample in scored]
        failed = [i for i, error in enumerate(errors) if error is not None]
        if failed:
            first = failed[0]
            logger.warning("reward function failed on %d of %d responses; first (data_source %r): %s",
                           len(failed), len(scored), data_sources[first], errors[first])
        keys = sorted({key for sample in scored for key in sample.extras})
        extras = {key: [sample.extras.get(key) for sample in scored] for key in keys}
        metrics = {"reward/errors": float(len(failed))}
        for key, values in extras.items():
            numbers = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(float(v))]
            if numbers:
                metrics[f"reward/{key}/mean"] = sum(numbers) / len(numbers)
        scores = torch.tensor([sample.score for sample in scored], dtype=torch.float32)
        return RewardResult(scores=scores, extras=extras, errors=errors, metrics=metrics)

    def check_training_step(self, result: RewardResult, data_sources: Sequence[str]) -> None:
        """Count a training step's failed reward calls; raise ``RewardFunctionError`` once
        ``max_failed_steps`` steps in a row failed on at least ``max_failed_fraction`` of the batch.

        Every rank holds the same result (``engine.rewards.spmd``), so every rank stops at once."""
        failed = [i for i, error in enumerate(result.errors) if error is not None]
        config = self.config
        if len(failed) < config.max_failed_fraction * len(result.errors):
            self.failing_steps = 0
            return
        self.failing_steps += 1
        if config.max_failed_steps and self.failing_steps >= config.max_failed_steps:
            first = failed[0]
            raise RewardFunctionError(
                f"the reward function failed on {len(failed)} of {len(result.errors)} responses, and on at least "
                f"reward_model.max_failed_fraction={config.max_failed_fraction} of the batch in each of the last "
                f"{self.failing_steps} steps (reward_model.max_failed_steps={config.max_failed_steps}); the run "
                f"stops rather than train on zeros. First error (data_source {data_sources[first]!r}): "
                f"{result.errors[first]}")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def batch_items(responses: Sequence[str], data_sources: Sequence[str], ground_truths: Sequence[Any],
                extra_infos: Sequence[dict[str, Any] | None] | None = None) -> list[tuple[str, str, Any, dict | None]]:
    """The batch's fields as (data_source, solution_str, ground_truth, extra_info) tuples, checked for equal length."""
    extra_infos = list(extra_infos) if extra_infos is not None else [None] * len(responses)
    if not len(responses) == len(data_sources) == len(ground_truths) == len(extra_infos):
        raise ValueError(f"batch fields differ in length: {len(responses)} responses, {len(data_sources)} "
                         f"data_sources, {len(ground_truths)} ground_truths, {len(extra_infos)} extra_infos")
    return list(zip(data_sources, responses, ground_truths, extra_infos))


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's score on its last response token: [batch] + [batch, response_len] -> [batch, response_len].

    "Last" is the last position where `response_mask` is 1 (masks may have holes, e.g. tool
    output). A row without any response token gets no reward.
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"expected scores [batch] and response_mask [batch, response_len], got "
                         f"{tuple(scores.shape)} and {tuple(response_mask.shape)}")
    mask = response_mask.bool()
    response_len = mask.shape[1]
    positions = torch.arange(response_len, device=mask.device).expand_as(mask)
    last_index = torch.where(mask, positions, -1).max(dim=1).values
    has_token = last_index >= 0
    token_scores = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.nonzero(has_token).squeeze(1)
    token_scores[rows, last_index[rows]] = scores[rows]
    return token_scores


def decode_responses(tokenizer: Any, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """Decode the masked response tokens of each row, dropping special tokens (EOS, padding)."""
    return [tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
            for ids, mask in zip(response_ids, response_mask)]
