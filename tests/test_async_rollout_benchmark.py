"""The overlap arithmetic of ``benchmarks.async_rollout`` (its jobs are the ones
tests/test_disaggregated_rollout.py runs; the benchmark itself is run by hand, see the README)."""
from __future__ import annotations

import pytest

from benchmarks.async_rollout import overlap


def side(step_s: float, generation_s: float, trainer_idle_s: float) -> dict:
    return {"step_s": step_s, "generation_s": generation_s, "trainer_idle_s": trainer_idle_s}


def test_overlap_is_measured_against_the_longer_side():
    # On-policy: 1 s generating (the trainer waits for it) + 2 s of training; ideal overlap = 2 s.
    on_policy = side(3.0, 1.0, 1.0)
    assert overlap(on_policy, side(2.0, 1.0, 0.0))["achieved"] == pytest.approx(1.0)
    assert overlap(on_policy, side(2.5, 1.0, 0.0))["achieved"] == pytest.approx(0.5)
    assert overlap(on_policy, side(3.0, 1.0, 0.0))["achieved"] == pytest.approx(0.0)
    # Generation longer than training: the ideal step is the generation.
    assert overlap(side(5.0, 4.0, 4.0), side(4.0, 4.0, 3.0))["ideal_step_s"] == pytest.approx(4.0)
