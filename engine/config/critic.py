"""``critic.*``: the value model of PPO with GAE (unused by critic-free estimators such as GRPO)."""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import II

from engine.config.model import MegatronConfig, ModelConfig, OptimConfig


@dataclass
class CriticConfig:
    """``critic.*``: the one settings class of the critic role. Batch sizes count prompts, as the
    actor's do.

    Attributes:
        model: the value model's checkpoint; defaults to the actor's.
        ppo_epochs: passes over each rollout batch; defaults to the actor's.
        ppo_mini_batch_size: prompts per optimizer step; defaults to the actor's.
        ppo_micro_batch_size_per_gpu: sequences per forward/backward on one rank; defaults to the
            actor's.
        use_dynamic_bsz: token-count micro-batches; defaults to the actor's.
        ppo_max_token_len_per_gpu: token budget per dynamic micro-batch (no vocabulary logits, so
            larger than the actor's by default).
        shuffle: reshuffle each rollout batch into mini-batches every epoch; defaults to the actor's.
        forward_micro_batch_size_per_gpu: sequences per forward of the value pass (V_old); defaults
            to ``ppo_micro_batch_size_per_gpu``.
        forward_max_token_len_per_gpu: the value pass's token budget; defaults to
            ``ppo_max_token_len_per_gpu``.
        cliprange_value: clip of the value update, |V - V_old| <= cliprange_value; null = plain
            squared error.
        loss_agg_mode: aggregation of the value loss; defaults to the actor's.
        warmup_steps: PPO iterations at the start that update only the critic (the actor is frozen).
        optim: the critic's optimizer.
        megatron: the critic's layout and precision; the layout defaults to (and must equal) the
            actor's.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    shuffle: bool = True
    forward_micro_batch_size_per_gpu: int | None = None
    forward_max_token_len_per_gpu: int = 32768
    cliprange_value: float | None = 0.5
    loss_agg_mode: str = "token-mean"
    warmup_steps: int = 0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    megatron: MegatronConfig = field(default_factory=MegatronConfig)


def experiment_critic() -> CriticConfig:
    """The critic of an experiment: the policy's checkpoint (a value head is added), the actor's
    batching and layout, unless the YAML says otherwise (one mesh: the config check refuses a layout
    other than the actor's)."""
    actor = "actor_rollout_ref.actor"
    megatron = MegatronConfig(**{name: II(f"{actor}.megatron.{name}") for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "cp_comm_type", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "sequence_parallel", "use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
        "param_dtype")})
    model = ModelConfig(**{name: II(f"actor_rollout_ref.model.{name}") for name in (
        "path", "use_remove_padding", "enable_gradient_checkpointing")})
    return CriticConfig(
        model=model, megatron=megatron,
        **{name: II(f"{actor}.{name}") for name in (
            "ppo_epochs", "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "shuffle",
            "loss_agg_mode")},
        forward_micro_batch_size_per_gpu=II("critic.ppo_micro_batch_size_per_gpu"),
        forward_max_token_len_per_gpu=II("critic.ppo_max_token_len_per_gpu"),
    )
