"""Settings shared by the trained and frozen models: the HF checkpoint, the optimizer, the layout."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from parallel.layout import ParallelLayout

# megatron-core's OptimizerParamScheduler decay styles.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
PARAM_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class ModelConfig:
    """``critic.model.*`` (and the common part of ``actor_rollout_ref.model.*``): the checkpoint.

    Attributes:
        path: HF model folder (``config.json`` + safetensors).
        use_remove_padding: pack the sequences of a micro-batch without padding (THD layout).
        enable_gradient_checkpointing: recompute activations in the backward pass (megatron's full
            recompute of every layer: less memory, one more forward).
        lora_rank: LoRA rank (Hu et al. 2021); 0 trains all weights. With a rank > 0 only the
            adapters train (``engine.models.lora``), the reference is the actor with its adapters
            off, and the rollout engine receives the merged weights (or the adapters alone:
            ``actor_rollout_ref.rollout.lora_sync=adapters``). Built for the actor only.
        lora_alpha: LoRA scaling numerator (the update is scaled by lora_alpha / lora_rank).
        target_modules: the adapted projections, PEFT's names: "all-linear" or a list of q_proj,
            k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (megatron fuses q/k/v and gate/up,
            which are adapted together).
    """

    path: str = MISSING
    use_remove_padding: bool = True
    enable_gradient_checkpointing: bool = False
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"

    def lora_settings(self, seed: int):
        """``engine.models.lora.LoRASettings`` of this model (None without LoRA); ``seed`` draws A."""
        from engine.models.lora import LoRASettings

        if self.lora_rank == 0:
            return None
        targets = self.target_modules
        if isinstance(targets, str):
            targets = (targets,)
        elif not (isinstance(targets, Sequence) and all(isinstance(name, str) for name in targets)):
            raise ValueError(f"model.target_modules={targets!r}: a module name, 'all-linear' or a list of names")
        return LoRASettings(self.lora_rank, self.lora_alpha, tuple(targets), seed)


@dataclass
class PolicyModelConfig(ModelConfig):
    """``actor_rollout_ref.model.*``: the policy's checkpoint, which also tokenizes the prompts.

    Attributes:
        tokenizer_path: tokenizer folder; null = ``path``.
        trust_remote_code: let transformers (tokenizer, embedded engine) and SGLang run code shipped
            with the checkpoint.
    """

    tokenizer_path: str | None = None
    trust_remote_code: bool = False


@dataclass
class OptimConfig:
    """``*.optim.*``: AdamW (Loshchilov & Hutter 2019) and its learning-rate schedule.

    Attributes:
        lr: peak learning rate.
        betas: Adam's (beta1, beta2).
        eps: Adam's epsilon.
        weight_decay: decoupled weight decay (megatron skips biases and norm weights).
        lr_warmup_steps: linear warm-up from 0 over this many optimizer steps; negative = use
            ``lr_warmup_steps_ratio`` of the total steps.
        lr_warmup_steps_ratio: warm-up as a fraction of the total optimizer steps.
        lr_decay_style: one of ``LR_DECAY_STYLES`` after the warm-up.
        min_lr: the learning rate the decay ends at.
        max_grad_norm: clip the global gradient norm to this (verl: ``grad_clip``); 0 disables
            clipping (the norm is still reported).
    """

    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.01
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    max_grad_norm: float = 1.0

    def warmup_steps(self, total_optimizer_steps: int) -> int:
        """The warm-up length in optimizer steps (verl's convention: negative = use the ratio)."""
        if self.lr_warmup_steps >= 0:
            return min(self.lr_warmup_steps, total_optimizer_steps)
        return int(self.lr_warmup_steps_ratio * total_optimizer_steps)


@dataclass
class FrozenMegatronConfig(ParallelLayout):
    """``reward_model.megatron.*`` (and the first part of every ``*.megatron.*``): the Megatron 3D
    layout of one model (this section *is* its ``parallel.layout.ParallelLayout``, whose attributes
    are the layout keys) and its precision.

    Attributes:
        param_dtype: precision of the weights: "bfloat16" (trained models keep fp32 main weights and
            gradients), "float16" (also dynamic loss scaling) or "float32".
        seed: seed of this model's initialisation (the critic's value head) and of megatron's
            model-parallel RNG streams while it is built.
    """

    param_dtype: str = "bfloat16"
    seed: int = 42


@dataclass
class MegatronConfig(FrozenMegatronConfig):
    """``actor_rollout_ref.actor.megatron.*``, ``critic.megatron.*``: the layout and precision of a
    trained model (see ``FrozenMegatronConfig``), and how its optimizer is laid out.

    Attributes:
        use_distributed_optimizer: shard the optimizer state over the data-parallel ranks (ZeRO-1).
        overlap_grad_reduce: start each gradient bucket's data-parallel reduce(-scatter) as soon as
            the backward pass has filled it, during the rest of the backward (megatron DDP's
            ``overlap_grad_reduce``); off, the whole reduce runs after the last micro-batch.
        overlap_param_gather: with the distributed optimizer, all-gather the updated weights bucket
            by bucket during the next mini-batch's forward pass instead of after each optimizer step
            (megatron DDP's ``overlap_param_gather``); the last update of a PPO step still gathers
            them before the weight sync reads them. null: on with ``use_distributed_optimizer``;
            true without it is a config error (there is nothing to gather).
        moe_aux_loss_coeff: weight of the Switch-Transformer load-balancing loss (Fedus et al. 2022,
            megatron-core's ``aux_loss``) added to the loss of an MoE model; 0 adds nothing. The loss
            (unweighted, mean over MoE layers) is reported as ``<role>/moe_load_balancing_loss``
            for every MoE model either way; > 0 needs an MoE model (checked at start-up).
        param_offload: keep the weights in host memory outside this model's phases (forward passes,
            updates, the weight sync, checkpoints), as verl does (``parallel.offload``).
        grad_offload: free the gradient buffers outside the updates (they are zeroed before each
            mini-batch, so nothing is copied).
        optimizer_offload: keep the Adam state and fp32 main weights in host memory outside the
            updates.
        moe_router_replay: R3 (``engine.roles.routing``): an MoE actor's routers take the experts the
            rollout engine routed each token to, in the old-log-prob pass and the update (the
            engine must report them: the embedded engine does, SGLang on CUDA). Actor only.
    """

    use_distributed_optimizer: bool = True
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool | None = None
    moe_aux_loss_coeff: float = 0.0
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    moe_router_replay: bool = False

    def param_gather_overlapped(self) -> bool:
        """``overlap_param_gather`` resolved (null: on with the distributed optimizer)."""
        return self.use_distributed_optimizer if self.overlap_param_gather is None else self.overlap_param_gather

    def offloaded_parts(self) -> tuple[str, ...]:
        """The ``parallel.offload.PARTS`` this model offloads between its phases."""
        flags = {"params": self.param_offload, "grads": self.grad_offload, "optimizer": self.optimizer_offload}
        return tuple(part for part, offloaded in flags.items() if offloaded)
