"""A pool of Ray CPU actors that score responses, for reward functions too slow for the trainer process."""
from __future__ import annotations

import logging
import math
import os
from typing import Any, Sequence

from engine.config.reward_model import RewardConfig
from engine.rewards.registry import resolve_compute_score
from engine.rewards.scoring import ScoredSample, score_one

logger = logging.getLogger(__name__)

# Several chunks per worker so one slow chunk does not leave the other workers idle at the end.
CHUNKS_PER_WORKER = 4
WORKER_START_TIMEOUT_S = 300


class _RewardWorker:
    """Ray actor body: rebuilds compute_score from the config (a user file is re-imported in the worker)."""

    def __init__(self, config: RewardConfig):
        self.compute_score = resolve_compute_score(config)

    def score_chunk(self, items: Sequence[tuple[str, str, Any, dict | None]]) -> list[ScoredSample]:
        return [score_one(self.compute_score, *item) for item in items]

    def ready(self) -> bool:
        return True


def ensure_ray_initialized(num_cpus: float) -> None:
    """Join the Ray cluster in RAY_ADDRESS if any, else start a local one with `num_cpus` CPUs."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)


class RewardWorkerPool:
    """`config.num_workers` Ray actors scoring contiguous chunks of a batch; results come back in input order.

    Create one pool per job (e.g. in the driver or on one rank): without RAY_ADDRESS every process
    that builds a pool starts its own local Ray instance.
    """

    def __init__(self, config: RewardConfig):
        import ray

        if config.num_workers <= 0:
            raise ValueError("RewardWorkerPool needs reward_model.num_workers > 0")
        ensure_ray_initialized(num_cpus=max(1, math.ceil(config.num_workers * config.num_cpus_per_worker)))
        actor_class = ray.remote(num_cpus=config.num_cpus_per_worker, max_restarts=3)(_RewardWorker)
        self.workers = [actor_class.remote(config) for _ in range(config.num_workers)]
        # Surfaces a bad custom reward file in a worker now, not at the first training step.
        try:
            ray.get([worker.ready.remote() for worker in self.workers], timeout=WORKER_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as error:
            raise RuntimeError(f"{config.num_workers} reward workers did not start within {WORKER_START_TIMEOUT_S} s; "
                               f"does the Ray cluster have {config.num_cpus_per_worker} free CPU(s) per worker "
                               f"(reward_model.num_workers / num_cpus_per_worker)?") from error

    def score(self, items: Sequence[tuple[str, str, Any, dict | None]]) -> list[ScoredSample]:
        """Score (data_source, solution_str, ground_truth, extra_info) tuples; a lost chunk scores 0 with errors."""
        import ray

        num_chunks = min(len(items), len(self.workers) * CHUNKS_PER_WORKER)
        if num_chunks == 0:
            return []
        bounds = [len(items) * i // num_chunks for i in range(num_chunks + 1)]
        chunks = [list(items[bounds[i]:bounds[i + 1]]) for i in range(num_chunks)]
        futures = [self.workers[i % len(self.workers)].score_chunk.remote(chunk) for i, chunk in enumerate(chunks)]
        results: list[ScoredSample] = []
        for chunk, future in zip(chunks, futures):
            try:
                results.extend(ray.get(future))
            except ray.exceptions.RayError as error:  # a worker died (e.g. segfault in user code)
                logger.error("reward worker failed on %d responses: %s", len(chunk), error)
                results.extend(ScoredSample(0.0, error=f"reward worker failed: {type(error).__name__}")
                               for _ in chunk)
        return results

    def close(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
