"""``critic.*``: the value model of PPO with GAE (unused by critic-free estimators such as GRPO)."""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import II

from engine.config.model import MegatronSection, ModelSection, OptimSection


def _critic_model() -> ModelSection:
    # The critic starts from the policy's checkpoint unless told otherwise (a value head is added).
    return ModelSection(
        path=II("actor_rollout_ref.model.path"),
        tokenizer_path=II("actor_rollout_ref.model.tokenizer_path"),
        trust_remote_code=II("actor_rollout_ref.model.trust_remote_code"),
        use_remove_padding=II("actor_rollout_ref.model.use_remove_padding"),
    )


def _critic_optim() -> OptimSection:
    return OptimSection(lr=1e-5)


@dataclass
class CriticSection:
    """``critic.*``. Batch sizes count prompts, as the actor's do.

    Attributes:
        model: the value model's checkpoint; defaults to the actor's.
        ppo_epochs: passes over each rollout batch; defaults to the actor's.
        ppo_mini_batch_size: prompts per optimizer step; defaults to the actor's.
        ppo_micro_batch_size_per_gpu: sequences per forward/backward on one rank; defaults to the
            actor's.
        use_dynamic_bsz: token-count micro-batches; defaults to the actor's.
        ppo_max_token_len_per_gpu: token budget per dynamic micro-batch (no vocabulary logits, so
            larger than the actor's by default).
        cliprange_value: clip of the value update, |V - V_old| <= cliprange_value.
        loss_agg_mode: aggregation of the value loss; defaults to the actor's.
        warmup_steps: PPO iterations at the start that update only the critic (the actor is frozen).
    """

    model: ModelSection = field(default_factory=_critic_model)
    ppo_epochs: int = II("actor_rollout_ref.actor.ppo_epochs")
    ppo_mini_batch_size: int = II("actor_rollout_ref.actor.ppo_mini_batch_size")
    ppo_micro_batch_size_per_gpu: int | None = II("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")
    ppo_max_token_len_per_gpu: int = 32768
    cliprange_value: float = 0.5
    loss_agg_mode: str = II("actor_rollout_ref.actor.loss_agg_mode")
    warmup_steps: int = 0
    optim: OptimSection = field(default_factory=_critic_optim)
    megatron: MegatronSection = field(default_factory=MegatronSection)
