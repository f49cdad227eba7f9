"""Build a rollout engine by name: ``"torch"`` (embedded, the CPU default) or ``"sglang"`` (servers)."""
from __future__ import annotations

from typing import Any

from engine.rollout.base import RolloutEngine

ROLLOUT_ENGINE_NAMES = ("torch", "sglang")


def create_rollout_engine(name: str, **config: Any) -> RolloutEngine:
    """``create_rollout_engine("torch", model_path=...)`` or ``("sglang", model_path=..., run_dir=...)``.

    Keyword arguments are the fields of ``TorchRolloutConfig`` / ``SGLangRolloutConfig``.
    """
    if name == "torch":
        from engine.rollout.torch_engine import TorchRolloutConfig, TorchRolloutEngine

        config_class, engine_class = TorchRolloutConfig, TorchRolloutEngine
    elif name == "sglang":
        # Imported only here: the SGLang tier (requests, sglang) is optional on CPU machines.
        from engine.rollout.sglang_engine import SGLangRolloutConfig, SGLangRolloutEngine

        config_class, engine_class = SGLangRolloutConfig, SGLangRolloutEngine
    else:
        raise ValueError(f"rollout engine {name!r} is not one of {ROLLOUT_ENGINE_NAMES}")
    try:
        engine_config = config_class(**config)
    except TypeError as error:
        raise TypeError(f"bad settings for the {name!r} rollout engine ({config_class.__name__}): {error}") from None
    return engine_class(engine_config)
