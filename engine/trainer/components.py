"""Everything the PPO loop needs, built from the experiment config on every rank (SPMD).

Order matters only where the hardware does: process groups first, then models (each rank reads
only its slices of the HF checkpoint), then the rollout engine (one per generation replica, on
the replica's leader rank) and the weight synchroniser between them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.algo.kl import build_kl_controller
from engine.config import ExperimentConfig, MegatronConfig, ModelConfig
from engine.data import PromptDataLoader, PromptDataset
from engine.rewards.manager import RewardManager
from engine.rewards.spmd import reward_manager_for_this_rank
from engine.roles import MegatronActor, MegatronCritic, MicroBatchConfig, ReferencePolicy
from engine.rollout.base import RolloutEngine
from engine.sync import WeightSynchronizer
from engine.trainer.checkpoint import CheckpointManager, CheckpointTarget
from engine.trainer.loggers import write_prometheus_target
from engine.trainer.run_dir import RunDirectory
from parallel.hybrid_engine import HybridLayout

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


def _build_model(model: ModelConfig, megatron: MegatronConfig, value_head: bool, trained: bool = True):
    """This rank's chunks of ``model.path`` in ``megatron.param_dtype``, HF weights loaded.

    The model is initialised under its own ``megatron.seed`` (only the critic's value head keeps its
    initial values), without disturbing the loop's random streams (``trainer.seed``).
    ``model.enable_gradient_checkpointing`` recomputes activations in the backward pass, so it
    applies to trained models only."""
    from megatron.core import tensor_parallel

    from engine.models.checkpoint import load_hf_weights
    from engine.models.gpt import build_model_chunks, recompute_settings

    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(megatron.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(megatron.seed)
        # initialize_weights=True marks TP-split weights for megatron's grad-norm; the HF load then
        # overwrites every value (value head excepted on a fresh critic).
        chunks = build_model_chunks(model.path, megatron.layout(), value_head=value_head, initialize_weights=True,
                                    params_dtype=getattr(torch, megatron.param_dtype),
                                    **recompute_settings(trained and model.enable_gradient_checkpointing))
    load_hf_weights(chunks, model.path)
    return chunks


def build_components(cfg: ExperimentConfig, run: RunDirectory) -> PPOComponents:
    """Build the PPO run's pieces on this rank; collective (every rank calls it). Each component
    gets its own section of the experiment (``cfg.data``, ``cfg.actor_rollout_ref.actor``, ...)."""
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    arr, data = cfg.actor_rollout_ref, cfg.data
    tokenizer = AutoTokenizer.from_pretrained(arr.model.tokenizer_path, trust_remote_code=arr.model.trust_remote_code)

    # Data: each data-parallel rank loads its share of every global batch.
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    train_set = PromptDataset.from_config(data, tokenizer, "train")
    train_loader = PromptDataLoader.for_training(train_set, data, data_parallel_rank=dp_rank, data_parallel_size=dp_size)
    val_loader = None
    if data.val_files:
        val_set = PromptDataset.from_config(data, tokenizer, "val")
        val_loader = PromptDataLoader.for_validation(val_set, data, data_parallel_rank=dp_rank, data_parallel_size=dp_size)
    rewards = reward_manager_for_this_rank(cfg.reward_model)
    rewards.check_data_sources(train_set.data_sources)

    batches_per_epoch = len(train_set) // data.train_batch_size
    if batches_per_epoch == 0:
        raise ValueError(f"data.train_files has {len(train_set)} usable prompts, fewer than "
                         f"data.train_batch_size={data.train_batch_size}")
    total_steps = cfg.trainer.total_training_steps or batches_per_epoch * cfg.trainer.total_epochs
    # The actor sits out the critic's warm-up iterations; its LR schedule spans the ones it trains.
    actor_iterations = max(1, total_steps - (cfg.critic.warmup_steps if cfg.algorithm.uses_critic else 0))

    n, seed, actor = arr.rollout.n, cfg.trainer.seed, arr.actor
    actor_role = MegatronActor(
        _build_model(arr.model, actor.megatron, value_head=False), actor,
        log_prob_batches=MicroBatchConfig.of(arr.rollout.log_prob_micro_batch_size_per_gpu, actor.use_dynamic_bsz,
                                             arr.rollout.log_prob_max_token_len_per_gpu),
        samples_per_prompt=n, total_optimizer_steps=_optimizer_steps(actor_iterations, actor, data), seed=seed,
        use_remove_padding=arr.model.use_remove_padding)

    reference = None
    if cfg.algorithm.use_kl_in_reward or actor.use_kl_loss:
        reference = ReferencePolicy(_build_model(arr.model, actor.megatron, value_head=False, trained=False), arr.ref,
                                    use_dynamic_bsz=actor.use_dynamic_bsz, use_remove_padding=arr.model.use_remove_padding)

    critic = None
    if cfg.algorithm.uses_critic:
        critic = MegatronCritic(_build_model(cfg.critic.model, cfg.critic.megatron, value_head=True), cfg.critic,
                                samples_per_prompt=n, total_optimizer_steps=_optimizer_steps(total_steps, cfg.critic, data),
                                seed=seed)

    weight_sync = WeightSynchronizer(actor_role.model_chunks, actor.megatron.layout(), arr.rollout)
    engine = _build_engine(cfg, run, weight_sync.layout) if weight_sync.is_replica_leader else None
    dist.barrier()

    return PPOComponents(
        tokenizer=tokenizer, train_loader=train_loader, val_loader=val_loader, actor=actor_role, reference=reference,
        critic=critic, engine=engine, weight_sync=weight_sync, rewards=rewards,
        kl_controller=build_kl_controller(cfg.algorithm.kl_ctrl),
        checkpoints=CheckpointManager(run.checkpoints_dir, max_ckpt_to_keep=cfg.trainer.max_ckpt_to_keep),
        total_training_steps=total_steps, data_parallel_group=parallel_state.get_data_parallel_group(),
    )


def _optimizer_steps(iterations: int, role, data) -> int:
    """Optimizer steps of a role over ``iterations`` PPO iterations: epochs x mini-batches per batch."""
    return iterations * role.ppo_epochs * (data.train_batch_size // role.ppo_mini_batch_size)


def _build_engine(cfg: ExperimentConfig, run: RunDirectory, layout: HybridLayout) -> RolloutEngine:
    """This generation replica's engine, on its leader rank; an SGLang server gets exactly the GPUs
    of the replica's ranks (``HybridLayout.replica_placements``)."""
    from engine.rollout.factory import create_rollout_engine

    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    if rollout.name == "torch":
        return create_rollout_engine(rollout, model.path, trust_remote_code=model.trust_remote_code)
    gpus: tuple[int, ...] = ()
    if torch.cuda.is_available():
        replica = layout.generation_coordinates(dist.get_rank()).replica
        gpus = layout.replica_placements(cfg.trainer.n_gpus_per_node)[replica].local_devices
    metrics = cfg.trainer.prometheus_port is not None
    engine = create_rollout_engine(rollout, model.path, run_dir=str(run.rollout_dir), replica_gpus=(gpus,),
                                   random_seed=cfg.trainer.seed + dist.get_rank(),
                                   trust_remote_code=model.trust_remote_code,
                                   extra_server_args=("--enable-metrics",) if metrics else ())
    if metrics:  # SGLang's own /metrics (queue, throughput, KV-cache use) beside the trainer's, for Prometheus
        for server in engine.servers:
            write_prometheus_target(run.prometheus_dir / f"sglang_{server.port}.json", f"{server.config.host}:{server.port}",
                                    {"job": "sglang", "project": cfg.trainer.project_name,
                                     "experiment": cfg.trainer.experiment_name})
    return engine

