"""The invariants ``tests.memory_events.check_invariants`` asserts on every recorded run refuse the
orders issue 45 found on the paths off the happy one (a server restarted beside the training state, a
save beside the engine's KV cache, an engine started after a model was built, a dynamic-sampling
round or a validation generating while the engine sleeps), a part on the device that the planner does
not count in that phase or beside the engine's KV cache, and a push to servers generating ahead; and
the loop, the record and the planner share one vocabulary of phases."""
from __future__ import annotations

import pytest

import inspect
import re

from engine.trainer import phases, ppo_trainer
from engine.trainer.tracking import phase as timed_phase
from launch import memory_model
from tests.memory_events import EVERYTHING, check_invariants

START = [{"event": "start_engine", "engine": "sglang"}, {"event": "release", "tags": EVERYTHING},
         {"event": "build_model", "role": "actor"}]
OFF = {"event": "training_state_off_device", "resident": {"0": [], "1": []}}
WAKE = [{"event": "resume", "tags": ["weights"]}, {"event": "resume", "tags": ["kv_cache", "cuda_graph"]}]


def test_the_orders_a_run_takes_pass():
    generate = {"event": "generate", "prompts": 2}
    check_invariants([*START, *WAKE, generate, generate, {"event": "release", "tags": EVERYTHING}, {"event": "save"},
                      *WAKE, generate, OFF, {"event": "restart_engine", "servers": 1}, {"event": "training_state_back"},
                      generate])
    check_invariants([generate])  # a rank without an engine of its own


@pytest.mark.parametrize("events, message", [
    ([{"event": "build_model", "role": "actor"}, {"event": "start_engine", "engine": "sglang"}],
     "an engine started after a model was built"),
    ([*START, *WAKE, {"event": "restart_engine", "servers": 1}], "a server restarted beside the training state"),
    ([*START, *WAKE, {"event": "save"}], "a save beside the engine's"),
    ([*START, *WAKE, {"event": "release", "tags": ["weights"]}, {"event": "save"}], "a save beside the engine's"),
    ([*START, *WAKE, {"event": "release", "tags": EVERYTHING}, {"event": "generate", "prompts": 2}],
     "a generation with the engine's"),  # a dynamic-sampling round after the engine slept
    ([*START, {"event": "generate", "prompts": 2}], "a generation with the engine's"),
])
def test_each_broken_order_is_refused(events, message):
    with pytest.raises(AssertionError, match=message):
        check_invariants(events)


def test_a_restart_with_a_part_left_on_the_device_is_refused():
    with pytest.raises(AssertionError, match="training_state_off_device"):
        check_invariants([*START, {"event": "training_state_off_device", "resident": {"0": ["params"]}}])


# The actor keeps its gradients and optimizer state on the host outside their phases (grad_offload,
# optimizer_offload), the critic keeps everything on the device.
PLACED = [*START, {"event": "resident", "model": "actor", "parts": ["params"], "offloaded": ["grads", "optimizer"]},
          {"event": "resident", "model": "critic", "parts": ["params", "grads", "optimizer"], "offloaded": []}]
UPDATE = [{"event": "phase", "name": "update_actor"}, {"event": "onload", "model": "actor", "parts": ["grads", "optimizer"]},
          {"event": "offload", "model": "actor", "parts": ["grads", "optimizer"]}]


def test_every_move_in_its_phase_passes():
    check_invariants([*PLACED, *WAKE, {"event": "phase", "name": "gen"}, {"event": "generate", "prompts": 2},
                      {"event": "release", "tags": EVERYTHING}, *UPDATE,
                      {"event": "phase", "name": "save"}, {"event": "onload", "model": "actor", "parts": ["optimizer"]},
                      {"event": "save"}, {"event": "offload", "model": "actor", "parts": ["optimizer"]},
                      {"event": "phase", "name": "update_weights"}, *WAKE])


@pytest.mark.parametrize("events, message", [
    # the actor's optimizer brought in for a phase that does not use it
    ([*PLACED, {"event": "phase", "name": "old_log_prob"}, {"event": "onload", "model": "actor", "parts": ["optimizer"]}],
     r"actor's \['optimizer'\] on the device where the planner's phase 'old_log_prob'"),
    # left on the device after its update, into the next step's generation beside the KV cache
    ([*PLACED, *UPDATE[:2], {"event": "phase", "name": "update_weights"}, *WAKE],
     r"actor's \['grads', 'optimizer'\] on the device where the planner's phase 'update_weights'"),
    # brought in while the engine holds its KV cache (a scorer's offloaded model inside generation)
    ([*PLACED, *WAKE, {"event": "onload", "model": "actor", "parts": ["grads"]}],
     r"phase 'gen' counts .*beside the engine's \['cuda_graph', 'kv_cache', 'weights'\]"),
    ([*PLACED, OFF, {"event": "onload", "model": "critic", "parts": []}, {"event": "restart_engine", "servers": 1}],
     "a server restarted beside"),
    ([{"event": "generate_ahead", "prompts": 4}, {"event": "push", "pushed": True}],
     "a weight push to servers generating ahead"),
    ([{"event": "generate_ahead", "prompts": 4}, {"event": "servers_idle_for_push", "how": "paused"},
      {"event": "push", "pushed": True}, {"event": "generate", "prompts": 4}],
     "a generation while the servers were paused"),
])
def test_each_misplaced_part_or_push_is_refused(events, message):
    with pytest.raises(AssertionError, match=message):
        check_invariants(events)


def test_a_paused_push_that_continues_passes():
    check_invariants([{"event": "generate_ahead", "prompts": 4}, {"event": "servers_idle_for_push", "how": "paused"},
                      {"event": "push", "pushed": True}, {"event": "continue_generation"},
                      {"event": "generate", "prompts": 4}, {"event": "generate_ahead", "prompts": 4},
                      {"event": "servers_idle_for_push", "how": "waited"}, {"event": "push", "pushed": True}])


def test_the_loop_the_record_and_the_planner_share_one_vocabulary_of_phases():
    """The loop's phases are the timing names and the record's; the planner estimates those of them
    that move memory, and counts a part resident exactly where the record's check does."""
    timed = set(re.findall(r'phase\("(\w+)"', inspect.getsource(ppo_trainer)))
    assert timed == set(phases.PHASES)
    assert set(memory_model.ESTIMATED_PHASES) == {phases.GEN, *phases.PHASE_USES} <= set(phases.PHASES)
    policy = memory_model.OffloadPolicy(grad_offload=True, optimizer_offload=True)
    model = memory_model.ModelMemoryConfig(role="actor", architecture=None, layout=None, data_parallel_size=1,
                                           trainable=True, offload=policy)
    for phase in memory_model.ESTIMATED_PHASES:
        for part in ("params", "grads", "optimizer"):
            assert memory_model._resident(model, part, phase) == phases.resident_in_phase(
                phase, "actor", part, ["grads", "optimizer"])
    with pytest.raises(ValueError, match="is not one of"):
        with timed_phase("rollout", {}):
            pass
