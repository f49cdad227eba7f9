"""Scoring one response with error containment (shared by the in-process path and the Ray workers)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class ScoredSample:
    """The outcome of one compute_score call: the score (0 on error), dict extras and the error if any."""

    score: float
    extras: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def score_one(compute_score: Callable[..., Any], data_source: str, solution_str: str, ground_truth: Any,
              extra_info: dict[str, Any] | None) -> ScoredSample:
    """Call `compute_score`; an exception, a dict without "score" or a non-finite score becomes score 0 + error."""
    try:
        result = compute_score(data_source, solution_str, ground_truth, extra_info)
        extras: dict[str, Any] = {}
        if isinstance(result, dict):
            if "score" not in result:
                raise KeyError(f"the returned dict has no 'score' key (keys: {sorted(result)})")
            extras = {key: value for key, value in result.items() if key != "score"}
            result = result["score"]
        score = float(result)
        if not math.isfinite(score):
            raise ValueError(f"score {score} is not finite")
        return ScoredSample(score=score, extras=extras)
    except Exception as error:  # a user's reward bug must not stop a multi-hour run; it is counted
        return ScoredSample(score=0.0, error=f"{type(error).__name__}: {error}")
