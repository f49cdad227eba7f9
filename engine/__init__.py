"""Trident's engine: config, algorithms, data, rewards, models, roles, rollout, weight sync, trainer.

Importing it first imports ``parallel`` (whose import hook must precede megatron-core's import).
"""
import parallel  # noqa: F401
