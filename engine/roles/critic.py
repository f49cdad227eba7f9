"""The critic: token values V(s_t) on the Megatron mesh and its clipped value-loss update."""

from __future__ import annotations

import torch

from engine.algo.losses import LossOutput, LossScale, compute_value_loss
from engine.config.critic import CriticConfig
from engine.roles.batch import RolloutBatch
from engine.roles.worker import MicroBatchConfig, ModelInputs, TrainableWorker, UpdateSchedule, response_columns


class MegatronCritic(TrainableWorker):
    """The value model (``build_model_chunks(..., value_head=True)``), trained with PPO's clipped
    value loss.

    Args:
        model_chunks: this rank's value-model chunks, weights loaded.
        config: ``critic``: batching of the value pass and the update, the loss, the optimizer.
        samples_per_prompt: ``rollout.n`` (the config counts prompts, batches count sequences).
        total_optimizer_steps: optimizer steps over the run (for the LR schedule).
        seed: base seed of the mini-batch shuffles (``trainer.seed``).
    """

    def __init__(self, model_chunks, config: CriticConfig, *, samples_per_prompt: int, total_optimizer_steps: int,
                 seed: int) -> None:
        super().__init__(model_chunks, config.optim, total_optimizer_steps,
                         use_distributed_optimizer=config.megatron.use_distributed_optimizer,
                         overlap_grad_reduce=config.megatron.overlap_grad_reduce,
                         overlap_param_gather=config.megatron.param_gather_overlapped(),
                         use_remove_padding=config.model.use_remove_padding, offload=config.megatron.offloaded_parts())
        self.config = config
        self.forward_batches = MicroBatchConfig.of(config.forward_micro_batch_size_per_gpu, config.use_dynamic_bsz,
                                                   config.forward_max_token_len_per_gpu)
        self.schedule = UpdateSchedule(
            ppo_epochs=config.ppo_epochs, ppo_mini_batch_size=config.ppo_mini_batch_size * samples_per_prompt,
            micro_batches=MicroBatchConfig.of(config.ppo_micro_batch_size_per_gpu, config.use_dynamic_bsz,
                                              config.ppo_max_token_len_per_gpu),
            shuffle=config.shuffle, seed=seed,
        )

    def _values(self, output: torch.Tensor, inputs: ModelInputs, micro_batch: RolloutBatch) -> torch.Tensor:
        # The value head gives [rows, width, 1], replicated over TP ranks.
        per_position = inputs.unpack(output[..., 0].float())
        return response_columns(per_position, micro_batch.response_length)

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """V(s_t) for every response token, ``[B, R]`` float32 on every rank."""
        outputs = lambda output, inputs, micro_batch: {"values": self._values(output, inputs, micro_batch)}
        return self.forward_per_token(batch, self.forward_batches, outputs, ["values"],
                                      "forward_max_token_len_per_gpu")["values"]

    def update_critic(self, batch: RolloutBatch) -> dict[str, float]:
        """Value update on ``batch`` (needs ``values`` = V_old and ``returns``); ``critic/*`` metrics."""
        batch.require("values", "returns", role="MegatronCritic.update_critic")
        config = self.config

        def loss_fn(output, inputs, micro_batch: RolloutBatch, scale: LossScale) -> LossOutput:
            values = self._values(output, inputs, micro_batch)
            dev = values.device
            return compute_value_loss(
                values, micro_batch.values.to(dev), micro_batch.returns.to(dev),
                micro_batch.response_mask.to(dev), config.cliprange_value, config.loss_agg_mode, scale,
            )

        return self.run_updates(batch, self.schedule, loss_fn, "critic")
