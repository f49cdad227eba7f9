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

    def built_models(self) -> "BuiltModels":
        """The models this experiment builds besides the actor (one decision, for the trainer,
        the checks before start-up and the planner)."""
        arr, judge = self.actor_rollout_ref, self.reward_model.judge
        kl_reference = self.algorithm.use_kl_in_reward or arr.actor.use_kl_loss
        return BuiltModels(critic=self.algorithm.uses_critic,
                           reference=kl_reference and not arr.model.lora_rank,
                           reference_is_actor_without_adapters=kl_reference and bool(arr.model.lora_rank),
                           reward_model=self.reward_model.enable,
                           judge_server=judge.enable and judge.url is None)


@dataclass(frozen=True)
class BuiltModels:
    """Which models a run builds besides the actor (``ExperimentConfig.built_models``).

    Attributes:
        critic: the value model (GAE's advantage estimator needs it).
        reference: a frozen copy of the actor's initial weights, for the KL term (in the reward or
            in the loss).
        reference_is_actor_without_adapters: with LoRA the KL reference is the actor with its
            adapters switched off: no second model.
        reward_model: a learned reward model on the actor's mesh (``reward_model.enable``).
        judge_server: an SGLang server of the LLM judge that Trident starts on global rank 0
            (``reward_model.judge`` enabled without a ``url``).
    """

    critic: bool
    reference: bool
    reference_is_actor_without_adapters: bool
    reward_model: bool
    judge_server: bool

    @property
    def kl_reference(self) -> bool:
        """Reference log-probs are computed (by a copy, or by the actor without adapters)."""
        return self.reference or self.reference_is_actor_without_adapters
