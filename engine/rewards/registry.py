"""Choosing the compute_score function: built-in scorers by `data_source`, or a user function from a file."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable

from engine.rewards import gsm8k, reasoning_gym_tasks
from engine.config.reward_model import RewardConfig

ComputeScore = Callable[..., "float | dict[str, Any]"]
GSM8K_DATA_SOURCES = ("openai/gsm8k", "gsm8k")


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None,
                          gsm8k_format_score: float = 0.0) -> float:
    """Built-in scorers: the GSM8K rule for "openai/gsm8k", reasoning-gym's scorer for "reasoning_gym/<task>"."""
    if data_source in GSM8K_DATA_SOURCES:
        return gsm8k.compute_score(solution_str, ground_truth, format_score=gsm8k_format_score)
    if data_source.startswith(reasoning_gym_tasks.DATA_SOURCE_PREFIX):
        return reasoning_gym_tasks.compute_score(data_source, solution_str, extra_info or {})
    raise ValueError(f"no built-in reward for data_source {data_source!r}")


def has_builtin_scorer(data_source: str) -> bool:
    return data_source in GSM8K_DATA_SOURCES or data_source.startswith(reasoning_gym_tasks.DATA_SOURCE_PREFIX)


def load_custom_reward_function(path: str, name: str = "compute_score") -> ComputeScore:
    """Import `name` from the Python file `path`; any problem is an error naming the path, at start-up."""
    file = Path(path).expanduser()
    key = "reward_model.custom_reward_function"
    if not file.is_file():
        raise FileNotFoundError(f"{key}.path={path!r}: no such file")
    # A unique module name per file, so two reward files with the same stem do not collide.
    module_name = f"trident_custom_reward_{hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{key}.path={path!r}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise ImportError(f"{key}.path={path!r}: importing the file failed: {type(error).__name__}: {error}"
                          ) from error
    function = getattr(module, name, None)
    if function is None:
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise AttributeError(f"{key}.path={path!r} defines no {name!r} ({key}.name); callables in it: {available}")
    if not callable(function):
        raise TypeError(f"{key}.path={path!r}: {name!r} is a {type(function).__name__}, not a function")
    return function


def _check_signature(function: ComputeScore, reward_kwargs: dict[str, Any], where: str) -> None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # some builtins have no signature; nothing to check
        return
    try:
        signature.bind("data_source", "solution_str", "ground_truth", {}, **reward_kwargs)
    except TypeError as error:
        raise TypeError(f"{where} cannot be called as f(data_source, solution_str, ground_truth, extra_info"
                        f"{''.join(', ' + k + '=...' for k in reward_kwargs)}): {error}") from error


def resolve_compute_score(config: RewardConfig) -> ComputeScore:
    """The function the reward manager calls, with `reward_kwargs` bound; validated at start-up."""
    custom = config.custom_reward_function
    if custom.path:
        function = load_custom_reward_function(custom.path, custom.name)
        where = f"{custom.name} from {custom.path}"
    else:
        function, where = default_compute_score, "the built-in compute_score"
    _check_signature(function, config.reward_kwargs, where)
    return functools.partial(function, **config.reward_kwargs) if config.reward_kwargs else function
