"""The whole experiment, assembled from each component's own settings class."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config.actor_rollout_ref import ActorRolloutRefConfig
from engine.config.algorithm import AlgorithmConfig
from engine.config.critic import CriticConfig, experiment_critic
from engine.config.data import DataConfig
from engine.config.reward_model import RewardConfig, experiment_reward_model
from engine.config.trainer import TrainerConfig


@dataclass
class ExperimentConfig:
    """A PPO experiment, as loaded by :func:`engine.config.load_config`.

    The sections and key names follow verl's PPO trainer: ``data``, ``actor_rollout_ref``
    (``model``, ``actor``, ``ref``, ``rollout``), ``critic``, ``algorithm``, ``reward_model``,
    ``trainer``. Every section is the settings class its component reads at run time, so a key
    reaches the code it names without a copy in between.
    """

    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=experiment_critic)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward_model: RewardConfig = field(default_factory=experiment_reward_model)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
