"""Build the rollout engine ``rollout.name`` names: "torch" (embedded, the CPU default), "torch-process"
(embedded in a process of its own) or "sglang" (servers)."""
from __future__ import annotations

from typing import Any

from engine.config.actor_rollout_ref import RolloutConfig
from engine.rollout.base import RolloutEngine

ROLLOUT_ENGINE_NAMES = ("torch", "torch-process", "sglang")


def create_rollout_engine(rollout: RolloutConfig, model_path: str, **launch: Any) -> RolloutEngine:
    """The engine for ``rollout`` (``actor_rollout_ref.rollout``) serving ``model_path``.

    ``launch``: how this process runs it, the keyword arguments of ``TorchRolloutEngine``
    (``max_batch_size``, ``device``, ...) or the fields of ``SGLangRolloutConfig`` (``run_dir``,
    ``replica_gpus``, ``random_seed``, ...).
    """
    if rollout.name == "torch":
        from engine.rollout.torch_engine import TorchRolloutEngine

        try:
            return TorchRolloutEngine(model_path, rollout, **launch)
        except TypeError as error:
            raise TypeError(f"bad settings for the 'torch' rollout engine: {error}") from None
    if rollout.name == "torch-process":
        from engine.rollout.process_engine import ProcessRolloutEngine

        try:
            return ProcessRolloutEngine(model_path, rollout, **launch)
        except TypeError as error:
            raise TypeError(f"bad settings for the 'torch-process' rollout engine: {error}") from None
    if rollout.name == "sglang":
        # Imported only here: the SGLang tier (requests, sglang) is optional on CPU machines.
        from engine.rollout.sglang_engine import SGLangRolloutConfig, SGLangRolloutEngine

        try:
            config = SGLangRolloutConfig(model_path=model_path, rollout=rollout, **launch)
        except TypeError as error:
            raise TypeError(f"bad settings for the 'sglang' rollout engine (SGLangRolloutConfig): {error}") from None
        return SGLangRolloutEngine(config)
    raise ValueError(f"rollout engine {rollout.name!r} is not one of {ROLLOUT_ENGINE_NAMES}")
