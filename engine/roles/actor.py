"""The actor (and the frozen reference): policy log-probs on the Megatron mesh and the PPO update.

Actor loss (``engine.algo.losses.compute_actor_loss``):
``pg_loss - entropy_coeff * entropy + kl_loss_coef * KL(pi_theta || pi_ref)``, every term a
micro-batch share of the mini-batch loss under the global token/sequence normaliser, so the
update does not depend on how the mini-batch is split over micro-batches or data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.algo.losses import ActorLossConfig, LossOutput, LossScale, compute_actor_loss
from engine.roles.batch import RolloutBatch
from engine.roles.optim import OptimConfig
from engine.roles.vocab_parallel import vocab_parallel_log_probs
from engine.roles.worker import (
    MegatronWorker,
    MicroBatchConfig,
    ModelInputs,
    TrainableWorker,
    UpdateSchedule,
    response_columns,
)


@dataclass(frozen=True)
class ActorConfig:
    """``actor_rollout_ref.actor.*`` (and the log-prob batching of ``rollout`` / ``ref``).

    Attributes:
        ppo_epochs, ppo_mini_batch_size, shuffle, seed: see ``UpdateSchedule``
            (``ppo_mini_batch_size`` in sequences over all data-parallel ranks).
        ppo_micro_batch_size_per_gpu: sequences per micro-batch in the update.
        use_dynamic_bsz: micro-batches by token budget (update and log-prob passes).
        ppo_max_token_len_per_gpu: token budget of an update micro-batch.
        log_prob_micro_batch_size_per_gpu, log_prob_max_token_len_per_gpu: the same for
            forward-only passes (old / reference log-probs).
        loss: policy/KL/entropy settings of the algorithm library.
        temperature: the rollout's sampling temperature (log-probs of softmax(logits / T)).
        max_response_length: ``data.max_response_length`` (Dr.GRPO normaliser).
    """

    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: int = 1
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    log_prob_micro_batch_size_per_gpu: int = 1
    log_prob_max_token_len_per_gpu: int = 16384
    shuffle: bool = True
    seed: int = 0
    loss: ActorLossConfig = field(default_factory=ActorLossConfig)
    temperature: float = 1.0
    max_response_length: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"actor temperature must be > 0 (greedy rollouts use 1), got {self.temperature}")

    def update_schedule(self) -> UpdateSchedule:
        return UpdateSchedule(
            ppo_epochs=self.ppo_epochs,
            ppo_mini_batch_size=self.ppo_mini_batch_size,
            micro_batches=MicroBatchConfig(
                self.ppo_micro_batch_size_per_gpu, self.use_dynamic_bsz, self.ppo_max_token_len_per_gpu
            ),
            shuffle=self.shuffle,
            seed=self.seed,
            max_response_length=self.max_response_length,
        )

    def log_prob_micro_batches(self) -> MicroBatchConfig:
        return MicroBatchConfig(
            self.log_prob_micro_batch_size_per_gpu, self.use_dynamic_bsz, self.log_prob_max_token_len_per_gpu
        )


class _PolicyMixin:
    """Per-token log-probs (and entropy) of a policy model, from vocab-parallel logits."""

    def policy_log_probs(
        self: MegatronWorker,
        output: torch.Tensor,
        inputs: ModelInputs,
        micro_batch: RolloutBatch,
        temperature: float,
        compute_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[b, R]`` log pi(response token) and entropy, from logits ``[rows, width, V/TP]``."""
        log_probs, entropy = vocab_parallel_log_probs(
            output, inputs.labels, temperature=temperature,
            vocab_size=self.model_chunks[0].hf_architecture.vocab_size,
            tensor_parallel_group=self.tp_group, compute_entropy=compute_entropy,
        )
        response_length = micro_batch.response_length
        log_probs = response_columns(inputs.layout.unpack(log_probs), response_length)
        if entropy is not None:
            entropy = response_columns(inputs.layout.unpack(entropy), response_length)
        return log_probs, entropy

    def compute_log_probs(
        self: MegatronWorker,
        batch: RolloutBatch,
        micro_batches: MicroBatchConfig,
        temperature: float = 1.0,
        compute_entropy: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Forward-only ``{"log_probs": [B, R]}`` (plus ``"entropy"``), float32, every rank."""
        keys = ["log_probs"] + (["entropy"] if compute_entropy else [])

        def outputs(output, inputs, micro_batch):
            log_probs, entropy = self.policy_log_probs(output, inputs, micro_batch, temperature, compute_entropy)
            return {"log_probs": log_probs, "entropy": entropy} if compute_entropy else {"log_probs": log_probs}

        return self.forward_per_token(batch, micro_batches, outputs, keys, "log_prob_max_token_len_per_gpu")


class MegatronActor(_PolicyMixin, TrainableWorker):
    """The policy being trained.

    Args:
        model_chunks: ``engine.models.build_model_chunks(hf_config, layout)`` of this rank,
            weights loaded.
        config: the actor settings.
        optim_config: AdamW / LR schedule / clipping.
        total_training_steps: optimizer steps over the run (for the LR decay).
        use_remove_padding: THD sequence packing (``model.use_remove_padding``).
    """

    def __init__(
        self,
        model_chunks,
        config: ActorConfig,
        optim_config: OptimConfig,
        total_training_steps: int,
        *,
        use_remove_padding: bool = True,
    ) -> None:
        super().__init__(model_chunks, optim_config, total_training_steps, use_remove_padding=use_remove_padding)
        self.config = config

    def compute_old_log_probs(self, batch: RolloutBatch, compute_entropy: bool = False) -> dict[str, torch.Tensor]:
        """log pi_old of the responses with the current weights (before the update)."""
        return self.compute_log_probs(batch, self.config.log_prob_micro_batches(), self.config.temperature, compute_entropy)

    def update_policy(self, batch: RolloutBatch) -> dict[str, float]:
        """PPO update on ``batch`` (needs ``old_log_probs``, ``advantages``; ``ref_log_probs``
        with ``use_kl_loss``). Returns ``actor/*`` metrics averaged over optimizer steps."""
        loss_config = self.config.loss
        needed = ["old_log_probs", "advantages"] + (["ref_log_probs"] if loss_config.use_kl_loss else [])
        batch.require(*needed, role="MegatronActor.update_policy")
        compute_entropy = loss_config.entropy_coeff != 0

        def loss_fn(output, inputs, micro_batch: RolloutBatch, scale: LossScale) -> LossOutput:
            log_probs, entropy = self.policy_log_probs(
                output, inputs, micro_batch, self.config.temperature, compute_entropy
            )
            dev = log_probs.device
            return compute_actor_loss(
                micro_batch.old_log_probs.to(dev), log_probs, micro_batch.advantages.to(dev),
                micro_batch.response_mask.to(dev), loss_config, scale, entropy=entropy,
                ref_log_probs=micro_batch.ref_log_probs.to(dev) if loss_config.use_kl_loss else None,
            )

        return self.run_updates(batch, self.config.update_schedule(), loss_fn, "actor")


class ReferencePolicy(_PolicyMixin, MegatronWorker):
    """The frozen reference policy, in its own layout; forward-only (no optimizer, no grads)."""

    def __init__(self, model_chunks, config: ActorConfig, *, use_remove_padding: bool = True) -> None:
        for chunk in model_chunks:
            chunk.requires_grad_(False)
        super().__init__(model_chunks, use_remove_padding=use_remove_padding)
        self.config = config

    def compute_ref_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        """log pi_ref of the responses, ``[B, R]`` float32 on every rank."""
        return self.compute_log_probs(batch, self.config.log_prob_micro_batches(), self.config.temperature)["log_probs"]
