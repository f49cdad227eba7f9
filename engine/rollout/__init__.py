"""Rollout engines behind one interface (``RolloutEngine``): embedded torch or SGLang servers."""
from engine.rollout.base import (
    RolloutEngine,
    RolloutError,
    RolloutSample,
    SamplingParams,
    WeightUpdateError,
    WeightUpdateStats,
    iter_weight_buckets,
)
from engine.rollout.factory import ROLLOUT_ENGINE_NAMES, create_rollout_engine

__all__ = [
    "ROLLOUT_ENGINE_NAMES",
    "RolloutEngine",
    "RolloutError",
    "RolloutSample",
    "SamplingParams",
    "WeightUpdateError",
    "WeightUpdateStats",
    "create_rollout_engine",
    "iter_weight_buckets",
]
