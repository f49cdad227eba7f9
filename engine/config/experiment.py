"""The whole experiment: one dataclass per top-level YAML section."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config.actor_rollout_ref import ActorRolloutRefSection
from engine.config.algorithm import AlgorithmSection
from engine.config.critic import CriticSection
from engine.config.data import DataSection
from engine.config.trainer import TrainerSection
# The reward pool's own settings class is the `reward_model` section (plain dataclasses, no torch).
from engine.rewards.config import RewardConfig


@dataclass
class ExperimentConfig:
    """A PPO experiment, as loaded by :func:`engine.config.load_config`.

    The sections and key names follow verl's PPO trainer: ``data``, ``actor_rollout_ref``
    (``model``, ``actor``, ``ref``, ``rollout``), ``critic``, ``algorithm``, ``reward_model``,
    ``trainer``.
    """

    data: DataSection = field(default_factory=DataSection)
    actor_rollout_ref: ActorRolloutRefSection = field(default_factory=ActorRolloutRefSection)
    critic: CriticSection = field(default_factory=CriticSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    reward_model: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
