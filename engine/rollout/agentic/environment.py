"""Environments (verl's "interactions"): who answers the model when it answers without a tool call.

An environment is made per trajectory: ``reset(row)`` with the prompt's row, then ``step(text)``
with each final assistant message; it returns the messages to append (a simulated user's turn),
an optional reward and whether the conversation is over. Its rewards are summed into the
trajectory's ``env_reward``, which the trainer adds to the rule/model/judge score.

``interaction_config_path`` (verl's format)::

    interaction:
      - name: guess
        class_name: my_package.envs.GuessEnvironment
        config: {max_guesses: 3}

One entry serves every row; with several, a row names its own in
``extra_info.interaction_kwargs.name`` (verl's key).
"""
from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class EnvironmentConfigError(ValueError):
    """A bad ``interaction_config_path``: the message names the file and the entry."""


@dataclass
class EnvironmentStep:
    messages: list[dict] = field(default_factory=list)  # appended after the assistant's message
    reward: float | None = None
    done: bool = True


class Environment(abc.ABC):
    def __init__(self, config: dict | None = None) -> None:
        self.config = dict(config or {})

    async def reset(self, row: dict) -> None:
        """A new conversation on ``row`` (messages, data_source, ground_truth, extra_info)."""

    @abc.abstractmethod
    async def step(self, assistant_message: str) -> EnvironmentStep:
        """The reply to the model's final message of a turn."""


@dataclass(frozen=True)
class EnvironmentFactory:
    """Makes the environment a row asks for."""

    makers: dict[str, Callable[[], Environment]]
    path: str

    def for_row(self, row: dict) -> Environment:
        if len(self.makers) == 1:
            return next(iter(self.makers.values()))()
        extra = row.get("extra_info") or {}
        name = (extra.get("interaction_kwargs") or {}).get("name") if isinstance(extra, dict) else None
        if name not in self.makers:
            raise EnvironmentConfigError(f"{self.path}: the row's extra_info.interaction_kwargs.name is {name!r}; "
                                         f"this file has {sorted(self.makers)}")
        return self.makers[name]()


def load_environments(path: str) -> EnvironmentFactory:
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise EnvironmentConfigError(f"actor_rollout_ref.rollout.multi_turn.interaction_config_path: {path} does not exist")
    entries = OmegaConf.to_container(OmegaConf.load(path)).get("interaction")
    if not isinstance(entries, list) or not entries:
        raise EnvironmentConfigError(f"{path}: expected a non-empty list under 'interaction'")
    makers: dict[str, Callable[[], Environment]] = {}
    for index, entry in enumerate(entries):
        where = f"{path}, interaction[{index}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise EnvironmentConfigError(f"{where}: expected a mapping with class_name (and name, config)")
        module, _, name = str(entry["class_name"]).rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as error:
            raise EnvironmentConfigError(f"{where}: cannot import {entry['class_name']!r}: {error}") from None
        if not (isinstance(cls, type) and issubclass(cls, Environment)):
            raise EnvironmentConfigError(f"{where}: {entry['class_name']} is not an "
                                         f"engine.rollout.agentic.environment.Environment")
        key = str(entry.get("name", name))
        if key in makers:
            raise EnvironmentConfigError(f"{where}: a second environment named {key!r}")
        config: Any = entry.get("config") or {}
        makers[key] = lambda cls=cls, config=config: cls(config)
    return EnvironmentFactory(makers, path)
