"""Everything the PPO loop needs, built from the experiment config on every rank (SPMD).

Order matters only where the hardware does: process groups first, then models (each rank reads
only its slices of the HF checkpoint), then the rollout engine (one per generation replica, on
the replica's leader rank) and the weight synchroniser between them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.algo.kl import build_kl_controller
from engine.config import ExperimentConfig
from engine.data import PromptDataLoader, PromptDataset
from engine.rewards.manager import RewardManager
from engine.rewards.spmd import reward_manager_for_this_rank
from engine.roles import (
    ActorConfig,
    CriticConfig,
    MegatronActor,
    MegatronCritic,
    OptimConfig,
    ReferencePolicy,
)
from engine.rollout.base import RolloutEngine
from engine.sync import WeightSyncConfig, WeightSynchronizer
from engine.trainer.checkpoint import CheckpointManager, CheckpointTarget
from engine.trainer.run_dir import RunDirectory
from parallel.hybrid_engine import HybridLayout
from parallel.state import ranks_per_node

logger = logging.getLogger(__name__)


@dataclass
class PPOComponents:
    """The built pieces of one PPO run on this rank."""

    tokenizer: Any
    train_loader: PromptDataLoader
    val_loader: PromptDataLoader | None
    actor: MegatronActor
    reference: ReferencePolicy | None
    critic: MegatronCritic | None
    engine: RolloutEngine | None  # only on generation-replica leaders
    weight_sync: WeightSynchronizer
    rewards: RewardManager
    kl_controller: Any
    checkpoints: CheckpointManager
    total_training_steps: int
    data_parallel_group: Any

    def checkpoint_targets(self) -> dict[str, CheckpointTarget]:
        targets = {"actor": CheckpointTarget(self.actor.ddp_chunks, self.actor.optimizer, self.actor.lr_scheduler)}
        if self.critic is not None:
            targets["critic"] = CheckpointTarget(self.critic.ddp_chunks, self.critic.optimizer, self.critic.lr_scheduler)
        return targets


def optim_config(section, megatron, total_optimizer_steps: int) -> OptimConfig:
    """``*.optim`` + ``*.megatron`` -> the roles' optimizer settings."""
    return OptimConfig(
        lr=section.lr, betas=tuple(section.betas), eps=section.eps, weight_decay=section.weight_decay,
        max_grad_norm=section.max_grad_norm, lr_warmup_steps=_warmup_steps(section, total_optimizer_steps),
        lr_decay_style=section.lr_decay_style, min_lr=section.min_lr,
        use_distributed_optimizer=megatron.use_distributed_optimizer,
    )


def _warmup_steps(section, total_optimizer_steps: int) -> int:
    # verl's convention: lr_warmup_steps < 0 means "use the ratio".
    if section.lr_warmup_steps >= 0:
        return section.lr_warmup_steps
    return int(section.lr_warmup_steps_ratio * total_optimizer_steps)


def _build_model(model, megatron, layout, value_head: bool, trained: bool = True):
    """This rank's chunks of ``model.path`` in ``megatron.param_dtype``, HF weights loaded.

    ``model.enable_gradient_checkpointing`` recomputes activations in the backward pass, so it
    applies to trained models only."""
    from engine.models.checkpoint import load_hf_weights
    from engine.models.gpt import build_model_chunks, recompute_settings

    # initialize_weights=True marks TP-split weights for megatron's grad-norm; the HF load then
    # overwrites every value (value head excepted on a fresh critic).
    chunks = build_model_chunks(model.path, layout, value_head=value_head, initialize_weights=True,
                                params_dtype=getattr(torch, megatron.param_dtype),
                                **recompute_settings(trained and model.enable_gradient_checkpointing))
    load_hf_weights(chunks, model.path)
    return chunks


def build_components(cfg: ExperimentConfig, run: RunDirectory) -> PPOComponents:
    """Build the PPO run's pieces on this rank; collective (every rank calls it)."""
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    arr = cfg.actor_rollout_ref
    layout = arr.actor.megatron.layout()
    n = arr.rollout.n
    model_path = arr.model.path
    tokenizer = AutoTokenizer.from_pretrained(arr.model.tokenizer_path or model_path,
                                              trust_remote_code=arr.model.trust_remote_code)

    # Data: each data-parallel rank loads its share of every global batch.
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    data_config = cfg.data.prompt_data_config()
    train_set = PromptDataset.from_config(data_config, tokenizer, "train")
    train_loader = PromptDataLoader.for_training(train_set, data_config, data_parallel_rank=dp_rank,
                                                 data_parallel_size=dp_size)
    val_loader = None
    if cfg.data.val_files:
        val_set = PromptDataset.from_config(data_config, tokenizer, "val")
        val_loader = PromptDataLoader.for_validation(val_set, data_config, data_parallel_rank=dp_rank,
                                                     data_parallel_size=dp_size)
    rewards = reward_manager_for_this_rank(cfg.reward_model)
    rewards.check_data_sources(train_set.data_sources)

    batches_per_epoch = len(train_set) // cfg.data.train_batch_size
    if batches_per_epoch == 0:
        raise ValueError(f"data.train_files has {len(train_set)} usable prompts, fewer than "
                         f"data.train_batch_size={cfg.data.train_batch_size}")
    total_steps = cfg.trainer.total_training_steps or batches_per_epoch * cfg.trainer.total_epochs

    # Roles count sequences; the config counts prompts (verl's convention).
    actor_mini = arr.actor.ppo_mini_batch_size * n
    optimizer_steps = total_steps * arr.actor.ppo_epochs * (cfg.data.train_batch_size // arr.actor.ppo_mini_batch_size)
    actor_config = ActorConfig(
        ppo_epochs=arr.actor.ppo_epochs, ppo_mini_batch_size=actor_mini,
        ppo_micro_batch_size_per_gpu=arr.actor.ppo_micro_batch_size_per_gpu or 1,
        use_dynamic_bsz=arr.actor.use_dynamic_bsz, ppo_max_token_len_per_gpu=arr.actor.ppo_max_token_len_per_gpu,
        log_prob_micro_batch_size_per_gpu=arr.rollout.log_prob_micro_batch_size_per_gpu or 1,
        log_prob_max_token_len_per_gpu=arr.rollout.log_prob_max_token_len_per_gpu,
        seed=cfg.trainer.seed, loss=arr.actor.loss_config(),
        temperature=arr.rollout.temperature if arr.rollout.do_sample and arr.rollout.temperature > 0 else 1.0,
        max_response_length=cfg.data.max_response_length,
    )
    actor_optim = optim_config(arr.actor.optim, arr.actor.megatron, optimizer_steps)
    remove_padding = arr.model.use_remove_padding
    actor = MegatronActor(_build_model(arr.model, arr.actor.megatron, layout, False), actor_config, actor_optim,
                          optimizer_steps, use_remove_padding=remove_padding)

    needs_reference = cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss
    reference = None
    if needs_reference:
        reference = ReferencePolicy(_build_model(arr.model, arr.actor.megatron, layout, False, trained=False),
                                    actor_config,
                                    use_remove_padding=remove_padding)

    critic = None
    if cfg.algorithm.uses_critic:
        section = cfg.critic
        critic_config = CriticConfig(
            ppo_epochs=section.ppo_epochs, ppo_mini_batch_size=section.ppo_mini_batch_size * n,
            ppo_micro_batch_size_per_gpu=section.ppo_micro_batch_size_per_gpu or 1,
            use_dynamic_bsz=section.use_dynamic_bsz, ppo_max_token_len_per_gpu=section.ppo_max_token_len_per_gpu,
            forward_micro_batch_size_per_gpu=section.ppo_micro_batch_size_per_gpu or 1,
            forward_max_token_len_per_gpu=section.ppo_max_token_len_per_gpu,
            cliprange_value=section.cliprange_value, loss_agg_mode=section.loss_agg_mode, seed=cfg.trainer.seed,
            max_response_length=cfg.data.max_response_length,
        )
        critic_steps = total_steps * section.ppo_epochs * (cfg.data.train_batch_size // section.ppo_mini_batch_size)
        critic_optim = optim_config(section.optim, section.megatron, critic_steps)
        if section.megatron.layout() != layout:
            raise NotImplementedError("critic.megatron must equal the actor's layout for now (one mesh)")
        critic = MegatronCritic(_build_model(section.model, section.megatron, layout, True), critic_config,
                                critic_optim, critic_steps, use_remove_padding=remove_padding)

    weight_sync = WeightSynchronizer(actor.model_chunks, layout, WeightSyncConfig(
        tensor_model_parallel_size=arr.rollout.tensor_model_parallel_size,
        update_weights_bucket_megabytes=arr.rollout.update_weights_bucket_megabytes,
        check_weight_sync=arr.rollout.check_weight_sync, dtype=arr.rollout.dtype,
    ))
    engine = _build_engine(cfg, run, weight_sync.layout) if weight_sync.is_replica_leader else None
    dist.barrier()

    return PPOComponents(
        tokenizer=tokenizer, train_loader=train_loader, val_loader=val_loader, actor=actor, reference=reference,
        critic=critic, engine=engine, weight_sync=weight_sync, rewards=rewards,
        kl_controller=build_kl_controller(cfg.algorithm.kl_ctrl.controller_config()),
        checkpoints=CheckpointManager(run.checkpoints_dir, max_ckpt_to_keep=cfg.trainer.max_ckpt_to_keep),
        total_training_steps=total_steps, data_parallel_group=parallel_state.get_data_parallel_group(),
    )


def _build_engine(cfg: ExperimentConfig, run: RunDirectory, layout: HybridLayout) -> RolloutEngine:
    """This generation replica's engine, on its leader rank; an SGLang server gets exactly the GPUs
    of the replica's ranks (``HybridLayout.replica_placements``)."""
    from engine.rollout.factory import create_rollout_engine

    rollout = cfg.actor_rollout_ref.rollout
    model_path = str(Path(cfg.actor_rollout_ref.model.path))
    if rollout.name == "torch":
        return create_rollout_engine("torch", model_path=model_path, dtype=rollout.dtype)
    gpus: tuple[int, ...] = ()
    if torch.cuda.is_available():
        replica = layout.generation_coordinates(dist.get_rank()).replica
        gpus = layout.replica_placements(ranks_per_node())[replica].local_devices
    return create_rollout_engine(
        "sglang", model_path=model_path, run_dir=str(run.rollout_dir),
        tensor_model_parallel_size=rollout.tensor_model_parallel_size, replica_gpus=(gpus,),
        gpu_memory_utilization=rollout.gpu_memory_utilization, dtype=rollout.dtype,
        colocated=rollout.mode == "colocated", random_seed=cfg.trainer.seed + dist.get_rank(),
    )

