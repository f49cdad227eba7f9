"""The invariants ``tests.memory_events.check_invariants`` asserts on every recorded run refuse the
orders issue 45 found on the paths off the happy one (a server restarted beside the training state, a
save beside the engine's KV cache, an engine started after a model was built, a dynamic-sampling
round or a validation generating while the engine sleeps)."""
from __future__ import annotations

import pytest

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
