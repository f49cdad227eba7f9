"""Rewards: rule functions by data_source (GSM8K, reasoning-gym, user file) with a crash-proof manager;
the reward model's inputs (``reward_model``), the LLM judge (``judge``) and how scores combine
(``combine``), which import torch and are imported by name.

Names are imported lazily (PEP 562) so a Ray reward worker, which needs only the scorers, does not
pay for importing torch.
"""
import importlib

_EXPORTS = {
    "CustomRewardFunctionConfig": "engine.config.reward_model", "RewardConfig": "engine.config.reward_model",
    "RewardFunctionError": "engine.rewards.manager", "RewardManager": "engine.rewards.manager",
    "RewardResult": "engine.rewards.manager",
    "decode_responses": "engine.rewards.manager", "token_level_scores": "engine.rewards.manager",
    "default_compute_score": "engine.rewards.registry", "load_custom_reward_function": "engine.rewards.registry",
    "resolve_compute_score": "engine.rewards.registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.rewards' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
