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
from engine.trainer.phases import GEN, resident_in_phase
from parallel.hybrid_engine import GenerationLayout, HybridLayout, TrainingLayout
from parallel.offload import PARTS

EVERYTHING = ["weights", "kv_cache", "cuda_graph"]
# Events the invariants read and the intended order leaves out: where each part of each model is,
# the phase the moves happen in, and the servers generating ahead (rollout.partial_rollout).
PLACEMENT_EVENTS = ("resident", "offload", "onload", "phase", "generate", "generate_ahead", "servers_idle_for_push",
                    "continue_generation")


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
    events = [event for event in read_events(log_file) if event["event"] not in PLACEMENT_EVENTS]
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
    """What must hold on any path of a run, over one rank's recorded events:

    - an engine sizes its KV pool with nothing of training on the device, as the planner counts
      its start (``launch.memory_model``: the memory free beside two CUDA contexts): it starts before
      any model is built, and restarts only between ``training_state_off_device`` and
      ``training_state_back``, with every part of every model offloaded;
    - in each phase every model has on the device exactly what the planner counts for that phase
      or less (``engine.trainer.phases.resident_in_phase``: the parts the phase uses, and those its
      config does not offload), after every move (each offload and onload of each part);
    - while the engine's KV cache or CUDA graphs are resident, the models hold no more than the
      planner counts beside them (its ``gen`` phase): no gradient or optimizer state it offloads;
    - a checkpoint is saved while the engine's KV cache and CUDA graphs are released;
    - an engine generates (a step, each dynamic-sampling round, validation) only with its weights and
      KV cache resident;
    - no weight push reaches servers generating ahead (``trainer.max_staleness``) until they are
      idle (finished, waited for, or paused with ``rollout.partial_rollout``), and paused ones
      continue before the next generation."""
    engine: set[str] = set()  # the engine's tags resident on this rank's device (leaders only)
    built = off_device = started = False
    resident: dict[str, set[str]] = {}  # each model's parts on the device
    offloaded: dict[str, list[str]] = {}  # each model's parts kept on the host outside their phases
    phase = None
    ahead = paused = False  # generations sent ahead and not yet made idle for a push; paused for it
    for index, event in enumerate(events):
        name = event["event"]
        where = f"event {index} {event} in phase {phase}: {events[max(0, index - 8):index + 1]}"
        if name == "start_engine":
            assert not built, f"an engine started after a model was built: {events}"
            engine, started = set(EVERYTHING), True
        elif name == "build_model":
            built = True
        elif name == "resident":
            resident[event["model"]], offloaded[event["model"]] = set(event["parts"]), event["offloaded"]
        elif name in ("offload", "onload"):
            parts = resident[event["model"]]
            resident[event["model"]] = parts - set(event["parts"]) if name == "offload" else parts | set(event["parts"])
        elif name == "phase":
            phase = event["name"]
        elif name in ("release", "resume"):
            engine = engine - set(event["tags"]) if name == "release" else engine | set(event["tags"])
        elif name == "training_state_off_device":
            assert all(parts == [] for parts in event["resident"].values()), event
            off_device = True
        elif name == "training_state_back":
            off_device = False
        elif name == "restart_engine":
            assert off_device, f"a server restarted beside the training state: {events}"
            assert not any(resident.values()), f"a server restarted beside {resident}: {where}"
            engine = set(EVERYTHING)
        elif name == "save":
            assert not engine & {"kv_cache", "cuda_graph"}, f"a save beside the engine's {sorted(engine)}: {events}"
        elif name == "generate" and started:  # (a rank without an engine of its own takes part only)
            assert {"weights", "kv_cache"} <= engine, f"a generation with the engine's {sorted(engine)}: {events}"
        elif name == "generate_ahead":
            assert not paused, f"a generation sent while the servers were paused: {where}"
            ahead = True
        elif name == "servers_idle_for_push":
            ahead, paused = False, event["how"] == "paused"
        elif name == "continue_generation":
            paused = False
        elif name == "push":
            assert not ahead, f"a weight push to servers generating ahead: {where}"
        if name == "generate":
            assert not paused, f"a generation while the servers were paused: {where}"
        if phase is not None:
            _check_phase(phase, resident, offloaded, where)
        if engine & {"kv_cache", "cuda_graph"}:
            _check_phase(GEN, resident, offloaded, f"beside the engine's {sorted(engine)}: {where}")


def _check_phase(phase: str, resident: dict[str, set[str]], offloaded: dict[str, list[str]], where: str) -> None:
    for model, parts in resident.items():
        counted = {part for part in PARTS if resident_in_phase(phase, model, part, offloaded[model])}
        assert parts <= counted, (f"{model}'s {sorted(parts - counted)} on the device where the planner's "
                                  f"phase {phase!r} counts {sorted(counted)}: {where}")


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
