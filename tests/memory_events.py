"""The memory choreography a colocated run must record (``engine.rollout.memory``), rank by rank.

On a generation replica's leader: the engine starts and releases everything before any model is
built; then per weight sync (the first one, and one per step after the step's generation released
the engine) the cache is handed back, the weights resumed, pushed, and the KV cache and CUDA graphs
resumed. Every other rank builds its models and takes part in each sync the same way, without an
engine of its own. A step's checkpoint is saved between its training and its sync, on every rank,
while the engine sleeps, with the weights and optimizer state resident and nothing else brought back.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from engine.config import ExperimentConfig
from engine.rollout.memory import read_events
from parallel.hybrid_engine import GenerationLayout, HybridLayout, TrainingLayout

EVERYTHING = ["weights", "kv_cache", "cuda_graph"]


def intended_events(engine: str | None, models: Sequence[str], steps: int, save_steps: Sequence[int] = ()) -> list[dict]:
    """``engine``: the rollout engine's name on a replica leader, None on the other ranks; a
    checkpoint is saved after the training of each of ``save_steps``, before the engine wakes."""
    leader = engine is not None

    def weight_sync() -> list[dict]:
        return [{"event": "hand_back_cache", "reason": "before the engine resumes"},
                *([{"event": "resume", "tags": ["weights"]}] if leader else []),
                {"event": "push", "pushed": leader, "cache_handed_back_after_each": True},
                *([{"event": "resume", "tags": ["kv_cache", "cuda_graph"]}] if leader else [])]

    events = [{"event": "start_engine", "engine": engine}, {"event": "release", "tags": EVERYTHING}] if leader else []
    events += [{"event": "build_model", "role": role} for role in models]
    events += weight_sync()
    for step in range(1, steps + 1):
        events += [{"event": "release", "tags": EVERYTHING}] if leader else []
        events += [{"event": "save"}] if step in save_steps else []
        events += weight_sync()
    return events


def recorded_events(log_file: Path, cfg: ExperimentConfig) -> list[dict]:
    """A rank's memory events, with each push's bucket count checked (> 0) and left out, and what
    each save found resident checked (``saved_with``) and left out."""
    events = [event for event in read_events(log_file) if event["event"] != "generate"]  # (check_invariants')
    for event in events:
        if event["event"] == "push":
            assert event.pop("buckets") > 0, event
        if event["event"] == "save":
            assert event.pop("resident") == saved_with(cfg), (log_file, event)
    return events


def saved_with(cfg: ExperimentConfig) -> dict[str, list[str]]:
    """What a save must find resident, per trained model: the weights and optimizer state it writes,
    and the parts that model never offloads; an offloaded gradient stays offloaded (issue 45, defect
    4: the save used to bring gradients back beside them)."""
    from engine.trainer.checkpoint import CHECKPOINTED_PARTS
    from parallel.offload import PARTS

    megatrons = {"actor": cfg.actor_rollout_ref.actor.megatron,
                 **({"critic": cfg.critic.megatron} if cfg.built_models().critic else {})}
    return {role: [part for part in PARTS if part in CHECKPOINTED_PARTS or part not in megatron.offloaded_parts()]
            for role, megatron in megatrons.items()}


def save_steps(cfg: ExperimentConfig, steps: int) -> list[int]:
    """The steps ``trainer.save_freq`` saves after (-1: the last only)."""
    every = cfg.trainer.save_freq
    return [step for step in range(1, steps + 1) if step == steps or (every > 0 and step % every == 0)]


def check_invariants(events: list[dict]) -> None:
    """What must hold on any path of a colocated run, over one rank's recorded events:

    - an engine sizes its KV pool with nothing of training on the device: it starts before any
      model is built, and restarts only between ``training_state_off_device`` (every part of every
      model on the host) and ``training_state_back``;
    - a checkpoint is saved while the engine's KV cache and CUDA graphs are released;
    - an engine generates (a step, each dynamic-sampling round, validation) only with its weights and
      KV cache resident."""
    engine: set[str] = set()  # the engine's tags resident on this rank's device (leaders only)
    built = off_device = started = False
    for event in events:
        name = event["event"]
        if name == "start_engine":
            assert not built, f"an engine started after a model was built: {events}"
            engine, started = set(EVERYTHING), True
        elif name == "build_model":
            built = True
        elif name in ("release", "resume"):
            engine = engine - set(event["tags"]) if name == "release" else engine | set(event["tags"])
        elif name == "training_state_off_device":
            assert all(parts == [] for parts in event["resident"].values()), event
            off_device = True
        elif name == "training_state_back":
            off_device = False
        elif name == "restart_engine":
            assert off_device, f"a server restarted beside the training state: {events}"
            engine = set(EVERYTHING)
        elif name == "save":
            assert not engine & {"kv_cache", "cuda_graph"}, f"a save beside the engine's {sorted(engine)}: {events}"
        elif name == "generate" and started:  # (a rank without an engine of its own takes part only)
            assert {"weights", "kv_cache"} <= engine, f"a generation with the engine's {sorted(engine)}: {events}"


def check_run(cfg: ExperimentConfig, logs: dict[int, Path], steps: int) -> None:
    """Every rank's recorded events equal the intended ones for ``cfg`` (colocated), and hold the
    invariants of ``check_invariants``."""
    megatron = cfg.actor_rollout_ref.actor.megatron
    layout = HybridLayout(TrainingLayout.from_parallel_layout(megatron, len(logs)),
                          GenerationLayout(cfg.actor_rollout_ref.rollout.tensor_model_parallel_size))
    built = cfg.built_models()
    models = ["actor", *(["reference"] if built.reference else []), *(["critic"] if built.critic else []),
              *(["reward_model"] if built.reward_model else [])]
    for rank, log in logs.items():
        leader = layout.generation_coordinates(rank).tensor == 0
        expected = intended_events(cfg.actor_rollout_ref.rollout.name if leader else None, models, steps,
                                   save_steps(cfg, steps))
        recorded = recorded_events(log, cfg)
        assert recorded == expected, (rank, recorded, expected)
        check_invariants(read_events(log))
