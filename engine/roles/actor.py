"""The actor (and the frozen reference): policy log-probs on the Megatron mesh and the PPO update.

Actor loss (``engine.algo.losses.compute_actor_loss``):
``pg_loss - entropy_coeff * entropy + kl_loss_coef * KL(pi_theta || pi_ref)``, every term a
micro-batch share of the mini-batch loss under the global token/sequence normaliser, so the
update does not depend on how the mini-batch is split over micro-batches or data-parallel ranks.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from engine.algo.losses import LossOutput, LossScale, compute_actor_loss
from engine.config.actor_rollout_ref import ActorConfig, RefConfig
from engine.config.errors import ConfigError
from engine.models.lora import adapters_disabled, has_lora
from engine.roles.batch import RolloutBatch
from engine.roles.routing import RoutingComparison, RoutingReplay
from engine.roles.vocab_parallel import vocab_parallel_log_probs
from engine.roles.worker import (
    MegatronWorker,
    MicroBatchConfig,
    ModelInputs,
    TrainableWorker,
    UpdateSchedule,
    response_columns,
)
from parallel.state import device


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
        log_probs = response_columns(inputs.unpack(log_probs), response_length)
        if entropy is not None:
            entropy = response_columns(inputs.unpack(entropy), response_length)
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
        config: ``actor_rollout_ref.actor``: the update, the loss, the optimizer.
        log_prob_batches: how the old-log-prob pass is cut (``rollout.log_prob_*``).
        samples_per_prompt: ``rollout.n`` (the config counts prompts, batches count sequences).
        total_optimizer_steps: optimizer steps over the run (for the LR schedule).
        seed: base seed of the mini-batch shuffles (``trainer.seed``).
        use_remove_padding: THD sequence packing (``model.use_remove_padding``).
    """

    def __init__(
        self,
        model_chunks,
        config: ActorConfig,
        *,
        log_prob_batches: MicroBatchConfig,
        samples_per_prompt: int,
        total_optimizer_steps: int,
        seed: int,
        use_remove_padding: bool = True,
    ) -> None:
        super().__init__(model_chunks, config.optim, total_optimizer_steps,
                         use_distributed_optimizer=config.megatron.use_distributed_optimizer,
                         overlap_grad_reduce=config.megatron.overlap_grad_reduce,
                         overlap_param_gather=config.megatron.param_gather_overlapped(),
                         use_remove_padding=use_remove_padding, offload=config.megatron.offloaded_parts())
        self.config = config
        self.log_prob_batches = log_prob_batches
        self.schedule = UpdateSchedule(
            ppo_epochs=config.ppo_epochs, ppo_mini_batch_size=config.ppo_mini_batch_size * samples_per_prompt,
            micro_batches=MicroBatchConfig.of(config.ppo_micro_batch_size_per_gpu, config.use_dynamic_bsz,
                                              config.ppo_max_token_len_per_gpu),
            shuffle=config.shuffle, seed=seed,
        )

    def compute_old_log_probs(self, batch: RolloutBatch, temperature: float, metrics: dict | None = None
                              ) -> torch.Tensor:
        """log pi_old of the responses with the current weights (before the update), ``[B, R]``;
        ``temperature``: the rollout's log-prob temperature (``SamplingParams.log_prob_temperature``).
        With the rollout's routing of an MoE model (``batch.routed_experts``), ``metrics`` gets
        ``rollout/routed_experts_mismatch`` (``engine.roles.routing``)."""
        with self._rollout_routing(batch, compare=metrics is not None) as comparison:
            log_probs = self.compute_log_probs(batch, self.log_prob_batches, temperature)["log_probs"]
        if comparison is not None:
            metrics["rollout/routed_experts_mismatch"] = comparison.mismatch(device())
        return log_probs

    @contextlib.contextmanager
    def _rollout_routing(self, batch: RolloutBatch, compare: bool) -> Iterator[RoutingComparison | None]:
        """Within: the rollout's routing replayed (``megatron.moe_router_replay``) and, with
        ``compare``, compared with the routing the passes use (yielded; None without routes)."""
        if not self.model_config.num_moe_experts:
            yield None
            return
        replay = self.config.megatron.moe_router_replay
        if batch.routed_experts is None:
            if replay:
                raise ConfigError("actor_rollout_ref.actor.megatron.moe_router_replay=true, but the rollout engine "
                                  "reported no routed experts for this batch (the embedded engines report them, and "
                                  "SGLang servers started with --enable-return-routed-experts)")
            yield None
            return
        active = [RoutingReplay(self.model_chunks, self.tp_rank, self.tp_size)] if replay else []
        if compare:
            active.append(RoutingComparison(self.model_chunks, self.tp_rank, self.tp_size))
        self.rollout_routing = active
        try:
            yield active[-1] if compare else None
        finally:
            self.rollout_routing = []
            for routing in active:
                routing.close()

    def update_policy(self, batch: RolloutBatch, temperature: float) -> dict[str, float]:
        """PPO update on ``batch`` (needs ``old_log_probs``, ``advantages``; ``ref_log_probs``
        with ``use_kl_loss``). Returns ``actor/*`` metrics averaged over optimizer steps, the
        policy's entropy among them (in the loss only with ``entropy_coeff``)."""
        config = self.config
        needed = ["old_log_probs", "advantages"] + (["ref_log_probs"] if config.use_kl_loss else [])
        batch.require(*needed, role="MegatronActor.update_policy")

        def loss_fn(output, inputs, micro_batch: RolloutBatch, scale: LossScale) -> LossOutput:
            log_probs, entropy = self.policy_log_probs(output, inputs, micro_batch, temperature, compute_entropy=True)
            if config.entropy_coeff == 0:
                entropy = entropy.detach()  # a metric only: no backward through it
            dev = log_probs.device
            return compute_actor_loss(
                micro_batch.old_log_probs.to(dev), log_probs, micro_batch.advantages.to(dev),
                micro_batch.response_mask.to(dev), config, scale, entropy=entropy,
                ref_log_probs=micro_batch.ref_log_probs.to(dev) if config.use_kl_loss else None,
            )

        with self._rollout_routing(batch, compare=False):
            return self.run_updates(batch, self.schedule, loss_fn, "actor")


class ReferencePolicy(_PolicyMixin, MegatronWorker):
    """The frozen reference policy on the actor's layout; forward-only (no optimizer, no grads).

    Args:
        model_chunks: the reference's chunks (the actor's initial weights); with LoRA, the actor's own
            chunks, whose adapters are switched off for the reference's pass (no second copy of the base).
        config: ``actor_rollout_ref.ref``: the log-prob pass's micro-batches.
        use_dynamic_bsz: batch by token budget, as the actor does (``actor.use_dynamic_bsz``).
        use_remove_padding: THD sequence packing.
        actor_offloader: with LoRA, the actor's ``ModelOffloader`` (the reference's weights are the
            actor's); else the reference offloads by ``config.megatron.param_offload``.
    """

    def __init__(self, model_chunks, config: RefConfig, *, use_dynamic_bsz: bool, use_remove_padding: bool = True,
                 actor_offloader=None) -> None:
        if not has_lora(model_chunks):
            for chunk in model_chunks:
                chunk.requires_grad_(False)
        super().__init__(model_chunks, use_remove_padding=use_remove_padding, offloader=actor_offloader,
                         offload=("params",) if config.megatron.param_offload else ())
        self.log_prob_batches = MicroBatchConfig.of(config.log_prob_micro_batch_size_per_gpu, use_dynamic_bsz,
                                                    config.log_prob_max_token_len_per_gpu)

    def compute_ref_log_probs(self, batch: RolloutBatch, temperature: float) -> torch.Tensor:
        """log pi_ref of the responses, ``[B, R]`` float32 on every rank."""
        with adapters_disabled(self.model_chunks):
            return self.compute_log_probs(batch, self.log_prob_batches, temperature)["log_probs"]
