"""Glue between the actor's Megatron model and the rollout engine: the HybridEngine weight sync."""

from engine.sync.specs import owner_of, parameter_specs
from engine.sync.weight_sync import (
    WeightSynchronizer,
    WeightSyncReport,
    check_by_log_probs,
    check_engine_weights,
    check_rollout_log_probs,
    engine_weights,
    expected_log_prob_gap,
)

__all__ = [
    "WeightSyncReport", "WeightSynchronizer", "check_by_log_probs", "check_engine_weights",
    "check_rollout_log_probs", "engine_weights", "expected_log_prob_gap", "owner_of", "parameter_specs",
]
