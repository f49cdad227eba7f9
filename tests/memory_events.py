"""The memory choreography a colocated run must record (``engine.rollout.memory``), rank by rank.

On a generation replica's leader: the engine starts and releases everything before any model is
built; then per weight sync (the first one, and one per step after the step's generation released
the engine) the cache is handed back, the weights resumed, pushed, and the KV cache and CUDA graphs
resumed. Every other rank builds its models and takes part in each sync the same way, without an
engine of its own.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from engine.config import ExperimentConfig
from engine.rollout.memory import read_events
from parallel.hybrid_engine import GenerationLayout, HybridLayout, TrainingLayout

EVERYTHING = ["weights", "kv_cache", "cuda_graph"]


def intended_events(engine: str | None, models: Sequence[str], steps: int) -> list[dict]:
    """``engine``: the rollout engine's name on a replica leader, None on the other ranks."""
    leader = engine is not None

    def weight_sync() -> list[dict]:
        return [{"event": "hand_back_cache", "reason": "before the engine resumes"},
                *([{"event": "resume", "tags": ["weights"]}] if leader else []),
                {"event": "push", "pushed": leader, "cache_handed_back_after_each": True},
                *([{"event": "resume", "tags": ["kv_cache", "cuda_graph"]}] if leader else [])]

    events = [{"event": "start_engine", "engine": engine}, {"event": "release", "tags": EVERYTHING}] if leader else []
    events += [{"event": "build_model", "role": role} for role in models]
    events += weight_sync()
    for _ in range(steps):
        events += [{"event": "release", "tags": EVERYTHING}] if leader else []
        events += weight_sync()
    return events


def recorded_events(log_file: Path) -> list[dict]:
    """A rank's memory events, with each push's bucket count checked (> 0) and left out."""
    events = read_events(log_file)
    for event in events:
        if event["event"] == "push":
            assert event.pop("buckets") > 0, event
    return events


def check_run(cfg: ExperimentConfig, logs: dict[int, Path], steps: int) -> None:
    """Every rank's recorded events equal the intended ones for ``cfg`` (colocated)."""
    megatron = cfg.actor_rollout_ref.actor.megatron
    layout = HybridLayout(TrainingLayout.from_parallel_layout(megatron, len(logs)),
                          GenerationLayout(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size))
    built = cfg.built_models()
    models = ["actor", *(["reference"] if built.reference else []), *(["critic"] if built.critic else []),
              *(["reward_model"] if built.reward_model else [])]
    for rank, log in logs.items():
        leader = layout.generation_coordinates(rank).tensor == 0
        expected = intended_events(cfg.actor_rollout_ref.rollout.name if leader else None, models, steps)
        assert recorded_events(log) == expected, (rank, recorded_events(log), expected)
