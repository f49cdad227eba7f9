"""The phases of a PPO step: one vocabulary for the loop, the memory record and the planner.

The loop times each phase under its name (``engine.trainer.tracking.phase``: ``timing_s/<phase>``,
verl's names) and records its start in the memory record (``engine.rollout.memory``); the planner
(``launch.memory_model``) estimates each phase's peak under the same name; the record's checks
(``tests/memory_events.py``) hold every recorded move to what the planner counted for the phase it
happened in. No torch here: the planner imports it.

A model's parts (``parallel.offload.PARTS``) are on its GPUs in a phase when the phase computes with
them (``PHASE_USES``) or when its config does not offload them (``*_offload``): the planner's
``_resident`` and the record's check are :func:`resident_in_phase`.
"""
from __future__ import annotations

from typing import Iterable

GEN = "gen"  # generation (and the engine's release after it); validation generates here too
OLD_LOG_PROB = "old_log_prob"
REF = "ref"
VALUES = "values"
REWARD = "reward"
ADV = "adv"
UPDATE_CRITIC = "update_critic"
UPDATE_ACTOR = "update_actor"
SAVE = "save"
UPDATE_WEIGHTS = "update_weights"  # the engine wakes, takes the actor's weights, and its KV cache
PHASES = (GEN, OLD_LOG_PROB, REF, VALUES, REWARD, ADV, UPDATE_CRITIC, UPDATE_ACTOR, SAVE, UPDATE_WEIGHTS)

# Which parts of which model each phase computes with (models by their names in the run: actor,
# reference, critic, reward_model); a phase not listed computes with none. The save writes the
# checkpointed parts (engine.trainer.checkpoint.CHECKPOINTED_PARTS) of the trained models.
PHASE_USES: dict[str, dict[str, tuple[str, ...]]] = {
    OLD_LOG_PROB: {"actor": ("params",)},
    REF: {"reference": ("params",)},
    VALUES: {"critic": ("params",)},
    REWARD: {"reward_model": ("params",)},
    UPDATE_CRITIC: {"critic": ("params", "grads", "optimizer")},
    UPDATE_ACTOR: {"actor": ("params", "grads", "optimizer")},
    SAVE: {"actor": ("params", "optimizer"), "critic": ("params", "optimizer")},
    UPDATE_WEIGHTS: {"actor": ("params",)},
}
# The model each phase runs forward (or trains), for the planner's activations.
FORWARD_PHASES = {OLD_LOG_PROB: "actor", REF: "reference", VALUES: "critic", REWARD: "reward_model"}
TRAIN_PHASES = {UPDATE_CRITIC: "critic", UPDATE_ACTOR: "actor"}


def resident_in_phase(phase: str, model: str, part: str, offloaded: Iterable[str]) -> bool:
    """Whether ``part`` of ``model`` is on its GPUs during ``phase``, for a model that keeps its
    ``offloaded`` parts in host memory outside the phases that use them."""
    return part in PHASE_USES.get(phase, {}).get(model, ()) or part not in set(offloaded)
