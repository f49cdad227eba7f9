"""Configuration of rule-based rewards (the `reward_model.*` keys)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CustomRewardFunctionConfig:
    """`reward_model.custom_reward_function.*`: a user `compute_score` loaded from a Python file.

    Attributes:
        path: the .py file; None uses the built-in scorers (chosen by `data_source`).
        name: the function in that file, called as
            `name(data_source, solution_str, ground_truth, extra_info) -> float | dict`.
    """

    path: str | None = None
    name: str = "compute_score"


@dataclass
class RewardConfig:
    """`reward_model.*` settings.

    Attributes:
        custom_reward_function: optional user function (see `CustomRewardFunctionConfig`).
        reward_kwargs: extra keyword arguments passed to every compute_score call (the built-in
            one takes `gsm8k_format_score`: the score of a well-formed but wrong GSM8K answer).
        num_workers: 0 scores in the trainer process; > 0 scores in that many Ray CPU workers.
        num_cpus_per_worker: CPUs Ray reserves for each worker.
        max_failed_fraction: a training step in which at least this fraction of the reward calls
            failed (raised, or returned a non-numeric or non-finite score; such responses score 0)
            counts as a failing step.
        max_failed_steps: stop the run, with the function's first error, after this many failing
            steps in a row (training on zeros wastes the run); 0 never stops.
    """

    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    num_workers: int = 0
    num_cpus_per_worker: float = 1.0
    max_failed_fraction: float = 0.5
    max_failed_steps: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.custom_reward_function, dict):
            self.custom_reward_function = CustomRewardFunctionConfig(**self.custom_reward_function)
        if self.num_workers < 0:
            raise ValueError(f"reward_model.num_workers={self.num_workers}: must be >= 0")
        if not 0 < self.max_failed_fraction <= 1:
            raise ValueError(f"reward_model.max_failed_fraction={self.max_failed_fraction}: must be in (0, 1]")
        if self.max_failed_steps < 0:
            raise ValueError(f"reward_model.max_failed_steps={self.max_failed_steps}: must be >= 0 (0 never stops)")
