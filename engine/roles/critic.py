"""The critic: token values V(s_t) on the Megatron mesh and its clipped value-loss update."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.algo import registry
from engine.algo.losses import LossOutput, LossScale, compute_value_loss
from engine.roles.batch import RolloutBatch
from engine.roles.optim import OptimConfig
from engine.roles.worker import MicroBatchConfig, ModelInputs, TrainableWorker, UpdateSchedule, response_columns


@dataclass(frozen=True)
class CriticConfig:
    """``critic.*``.

    Attributes:
        ppo_epochs, ppo_mini_batch_size, ppo_micro_batch_size_per_gpu, use_dynamic_bsz,
            ppo_max_token_len_per_gpu, shuffle, seed: as for the actor (``UpdateSchedule``).
        forward_micro_batch_size_per_gpu, forward_max_token_len_per_gpu: batching of the
            forward-only value pass.
        cliprange_value: PPO value clipping around the old values; None = plain squared error.
        loss_agg_mode: aggregation of the per-token value loss.
        max_response_length: ``data.max_response_length`` (Dr.GRPO normaliser).
    """

    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: int = 1
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    forward_micro_batch_size_per_gpu: int = 1
    forward_max_token_len_per_gpu: int = 16384
    cliprange_value: float | None = 0.5
    loss_agg_mode: str = "token-mean"
    shuffle: bool = True
    seed: int = 0
    max_response_length: int | None = None

    def __post_init__(self) -> None:
        registry.get("loss_agg_mode", self.loss_agg_mode, "critic.loss_agg_mode")
        if self.cliprange_value is not None and self.cliprange_value < 0:
            raise ValueError(f"critic.cliprange_value must be >= 0, got {self.cliprange_value}")


class MegatronCritic(TrainableWorker):
    """The value model (``build_model_chunks(..., value_head=True)``), trained with PPO's clipped
    value loss. Same arguments as ``MegatronActor``."""

    def __init__(
        self,
        model_chunks,
        config: CriticConfig,
        optim_config: OptimConfig,
        total_training_steps: int,
        *,
        use_remove_padding: bool = True,
    ) -> None:
        super().__init__(model_chunks, optim_config, total_training_steps, use_remove_padding=use_remove_padding)
        self.config = config

    def _values(self, output: torch.Tensor, inputs: ModelInputs, micro_batch: RolloutBatch) -> torch.Tensor:
        # The value head gives [rows, width, 1], replicated over TP ranks.
        per_position = inputs.layout.unpack(output[..., 0].float())
        return response_columns(per_position, micro_batch.response_length)

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        """V(s_t) for every response token, ``[B, R]`` float32 on every rank."""
        micro = MicroBatchConfig(
            self.config.forward_micro_batch_size_per_gpu, self.config.use_dynamic_bsz,
            self.config.forward_max_token_len_per_gpu,
        )
        outputs = lambda output, inputs, micro_batch: {"values": self._values(output, inputs, micro_batch)}
        return self.forward_per_token(batch, micro, outputs, ["values"], "forward_max_token_len_per_gpu")["values"]

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

        schedule = UpdateSchedule(
            ppo_epochs=config.ppo_epochs,
            ppo_mini_batch_size=config.ppo_mini_batch_size,
            micro_batches=MicroBatchConfig(
                config.ppo_micro_batch_size_per_gpu, config.use_dynamic_bsz, config.ppo_max_token_len_per_gpu
            ),
            shuffle=config.shuffle,
            seed=config.seed,
            max_response_length=config.max_response_length,
        )
        return self.run_updates(batch, schedule, loss_fn, "critic")
