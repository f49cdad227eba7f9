"""Everything the PPO loop needs, built from the experiment config on every rank (SPMD).

Order matters where the hardware does: process groups first; then a colocated rollout engine (one
per generation replica, on the replica's leader rank), which releases all its memory at once,
before any training model exists (SGLang sizes its KV cache from the memory free when it starts:
``engine.rollout.memory``); then the models (each rank reads only its slices of the HF checkpoint)
and the weight synchroniser between actor and engine.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.algo.kl import build_kl_controller
from engine.config import ExperimentConfig, MegatronConfig, ModelConfig
from engine.config.errors import ConfigError
from engine.config.loader import ulysses_meaning
from engine.data import PromptDataLoader, PromptDataset
from engine.rollout.agentic.tools import tool_schemas
from engine.rollout.agentic.trajectory import Agent
from engine.models.lora import describe as describe_lora
from engine.rewards.judge import JudgeClient
from engine.rewards.manager import RewardManager
from engine.rewards.reward_model import RewardModelScorer
from engine.rewards.spmd import reward_manager_for_this_rank
from engine.roles import MegatronActor, MegatronCritic, MicroBatchConfig, ReferencePolicy
from engine.rollout.memory import hand_back_cache, record
from engine.rollout.sglang_server import SGLangServer
from engine.trainer.checkpoint import CHECKPOINTED_PARTS, CheckpointManager, CheckpointTarget, optimizer_format_problem
from engine.trainer.console import say
from engine.trainer.rollout import Rollout
from engine.trainer.run_dir import RunDirectory
from parallel.offload import PARTS as OFFLOAD_PARTS
from parallel.offload import ModelOffloader
from parallel.state import control_group, control_group_like

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
    # The engine, where it runs, the weights it serves and the batches it generates ahead.
    rollout: Rollout
    rewards: RewardManager
    scores_rules: bool  # rule scores are computed (in the reward, or logged beside it)
    reward_model: RewardModelScorer | None
    judge: JudgeClient | None
    judge_server: SGLangServer | None  # the judge's server, on global rank 0 when Trident started it
    kl_controller: Any
    checkpoints: CheckpointManager
    total_training_steps: int

    @contextlib.contextmanager
    def checkpointed_parts_resident(self):
        """The actor's and critic's weights and optimizer state on the device inside the block (a
        checkpoint's save or load), whatever they offload between phases; their gradients stay
        where they are (a checkpoint holds none)."""
        with contextlib.ExitStack() as stack:
            for role in (self.actor, self.critic):
                if role is not None:
                    stack.enter_context(role.offloader.resident(*CHECKPOINTED_PARTS))
            yield

    def resident_parts(self) -> dict[str, list[str]]:
        """Which parts of each trained model are on the device now (the memory record's view)."""
        return {name: role.offloader.resident_parts() for name, role in (("actor", self.actor), ("critic", self.critic))
                if role is not None}

    def checkpoint_targets(self) -> dict[str, CheckpointTarget]:
        targets = {"actor": CheckpointTarget(self.actor.ddp_chunks, self.actor.optimizer, self.actor.lr_scheduler)}
        if self.critic is not None:
            targets["critic"] = CheckpointTarget(self.critic.ddp_chunks, self.critic.optimizer, self.critic.lr_scheduler)
        return targets


def _build_model(model: ModelConfig, megatron: MegatronConfig, value_head: bool, trained: bool = True, *, role: str):
    """This rank's chunks of ``model.path`` in ``megatron.param_dtype``, HF weights loaded.

    The model is initialised under its own ``megatron.seed`` (only the critic's value head keeps its
    initial values), without disturbing the loop's random streams (``trainer.seed``).
    ``model.enable_gradient_checkpointing`` recomputes activations in the backward pass, so it
    applies to trained models only."""
    from megatron.core import tensor_parallel

    from engine.models.checkpoint import CheckpointError, load_hf_weights
    from engine.models.gpt import build_model_chunks, fused_weight_gradients, recompute_settings
    from engine.models.lora import add_lora

    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(megatron.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(megatron.seed)
        # initialize_weights=True marks TP-split weights for megatron's grad-norm; the HF load then
        # overwrites every value (value head excepted on a fresh critic).
        chunks = build_model_chunks(model.path, megatron, value_head=value_head, initialize_weights=True,
                                    params_dtype=getattr(torch, megatron.param_dtype),
                                    moe_aux_loss_coeff=megatron.moe_aux_loss_coeff if trained else 0.0,
                                    gradient_accumulation_fusion=trained and fused_weight_gradients(),
                                    **recompute_settings(trained and model.enable_gradient_checkpointing))
    missing = load_hf_weights(chunks, model.path)
    lora = model.lora_settings(megatron.seed) if trained else None
    if lora is not None:
        add_lora(chunks, lora)  # targets checked by engine.trainer.preflight
    # A frozen scorer (the reward model) needs its trained head; HF's has no bias (ours stays 0).
    if value_head and not trained and "output_layer.weight" in missing:
        raise CheckpointError(f"{model.path} has no score head (score.weight): the reward model must be a "
                              f"*ForSequenceClassification checkpoint with num_labels=1")
    record("build_model", role=role)
    return chunks


def build_components(cfg: ExperimentConfig, run: RunDirectory) -> PPOComponents:
    """Build the PPO run's pieces on this rank; collective (every rank calls it). Each component
    gets its own section of the experiment (``cfg.data``, ``cfg.actor_rollout_ref.actor``, ...)."""
    from megatron.core import parallel_state
    from transformers import AutoTokenizer

    arr, data = cfg.actor_rollout_ref, cfg.data
    if arr.actor.ulysses_sequence_parallel_size > 1:
        say(f"[trident] {ulysses_meaning(arr.actor.ulysses_sequence_parallel_size)}")
    tokenizer = AutoTokenizer.from_pretrained(arr.model.tokenizer_path, trust_remote_code=arr.model.trust_remote_code)
    agent = Agent.from_config(arr.rollout.multi_turn, tokenizer)
    tools = tool_schemas(agent.tools) if agent is not None and agent.tools else None  # for the prompts' template

    # Data: each data-parallel rank loads its share of every global batch.
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    train_set = PromptDataset.from_config(data, tokenizer, "train", tools=tools)
    train_loader = PromptDataLoader.for_training(train_set, data, data_parallel_rank=dp_rank, data_parallel_size=dp_size)
    val_loader = None
    if data.val_files:
        val_set = PromptDataset.from_config(data, tokenizer, "val", tools=tools)
        val_loader = PromptDataLoader.for_validation(val_set, data, data_parallel_rank=dp_rank, data_parallel_size=dp_size)
    rewards = reward_manager_for_this_rank(cfg.reward_model)
    scores_rules = _rule_scores_available(cfg, rewards, train_set.data_sources)

    batches_per_epoch = len(train_set) // data.train_batch_size
    if batches_per_epoch == 0:
        raise ValueError(f"data.train_files has {len(train_set)} usable prompts, fewer than "
                         f"data.train_batch_size={data.train_batch_size}")
    total_steps = cfg.trainer.total_training_steps or batches_per_epoch * cfg.trainer.total_epochs
    # The actor sits out the critic's warm-up iterations; its LR schedule spans the ones it trains.
    built = cfg.built_models()
    actor_iterations = max(1, total_steps - (cfg.critic.warmup_steps if built.critic else 0))

    n, seed, actor = arr.rollout.n, cfg.trainer.seed, arr.actor
    rollout = Rollout(cfg, run, agent, tokenizer.pad_token_id or 0,  # a colocated engine starts here, released
                      control_group_like(parallel_state.get_data_parallel_group()))
    actor_role = MegatronActor(
        _build_model(arr.model, actor.megatron, value_head=False, role="actor"), actor,
        log_prob_batches=MicroBatchConfig.of(arr.rollout.log_prob_micro_batch_size_per_gpu, actor.use_dynamic_bsz,
                                             arr.rollout.log_prob_max_token_len_per_gpu),
        samples_per_prompt=n, total_optimizer_steps=_optimizer_steps(actor_iterations, actor, data), seed=seed,
        use_remove_padding=arr.model.use_remove_padding)

    if arr.model.lora_rank:
        say(f"[trident] actor: {describe_lora(actor_role.model_chunks)}")
    reference = None
    if built.kl_reference:
        # With LoRA the reference is the actor with its adapters off: no second copy of the base.
        chunks = actor_role.model_chunks if not built.reference else _build_model(
            arr.model, actor.megatron, value_head=False, trained=False, role="reference")
        reference = ReferencePolicy(chunks, arr.ref, use_dynamic_bsz=actor.use_dynamic_bsz,
                                    use_remove_padding=arr.model.use_remove_padding,
                                    actor_offloader=actor_role.offloader if arr.model.lora_rank else None)

    critic = None
    if built.critic:
        critic = MegatronCritic(_build_model(cfg.critic.model, cfg.critic.megatron, value_head=True, role="critic"),
                                cfg.critic,
                                samples_per_prompt=n, total_optimizer_steps=_optimizer_steps(total_steps, cfg.critic, data),
                                seed=seed)

    reward_model = None
    if built.reward_model:
        reward_model = _build_reward_model(cfg, tokenizer)

    trained_and_frozen = {"actor": actor_role, "reference": reference, "critic": critic}
    offloaders = _offloaders({**trained_and_frozen, "reward_model": reward_model.model if reward_model else None})
    for name, offloader in offloaders.items():  # from here on every move of every part is recorded
        record("resident", model=name, parts=offloader.resident_parts(), offloaded=list(offloader.enabled))
        offloader.observer = functools.partial(_record_move, name)
    # the weight sync, and where a restarting server finds the training state; servers of their own start here
    rollout.connect(actor_role, training_state_off_device=lambda: training_state_off_device(offloaders))
    judge, judge_server = _start_judge(cfg, run) if cfg.reward_model.judge.enable else (None, None)
    dist.barrier(group=control_group())
    _report_offload(_offloaders(trained_and_frozen))

    parts = PPOComponents(
        tokenizer=tokenizer, train_loader=train_loader, val_loader=val_loader, actor=actor_role, reference=reference,
        critic=critic, rollout=rollout, rewards=rewards, scores_rules=scores_rules,
        reward_model=reward_model, judge=judge, judge_server=judge_server,
        kl_controller=build_kl_controller(cfg.algorithm.kl_ctrl),
        checkpoints=CheckpointManager(run.checkpoints_dir, max_ckpt_to_keep=cfg.trainer.max_ckpt_to_keep,
                                      async_save=cfg.trainer.checkpoint.async_save,
                                      optimizer_format=cfg.trainer.checkpoint.optimizer_format),
        total_training_steps=total_steps,
    )
    # at start rather than at the first save, hours in
    problem = optimizer_format_problem(cfg.trainer.checkpoint.optimizer_format, parts.checkpoint_targets())
    if problem is not None:
        raise ConfigError(problem)
    return parts


def _record_move(model: str, move: str, parts: list[str]) -> None:
    record(move, model=model, parts=parts)


def _offloaders(roles: dict[str, Any]) -> dict[str, ModelOffloader]:
    """Each model's offloader once, by the first name it has (the LoRA reference shares the actor's)."""
    found: dict[int, tuple[str, ModelOffloader]] = {}
    for name, role in roles.items():
        if role is not None:
            found.setdefault(id(role.offloader), (name, role.offloader))
    return dict(found.values())


@contextlib.contextmanager
def training_state_off_device(offloaders: dict[str, ModelOffloader]):
    """Every part of every model on the host inside the block, and this rank's cached memory handed
    back: the device as the colocated engine first found it, nothing of training on it. Afterwards
    each model is as between its phases (its enabled parts offloaded, the rest resident; gradients
    come back zeroed, as before every mini-batch)."""
    for offloader in offloaders.values():
        offloader.offload(*OFFLOAD_PARTS)
    hand_back_cache("training state off the device")
    record("training_state_off_device", resident={name: o.resident_parts() for name, o in offloaders.items()})
    try:
        yield
    finally:
        record("training_state_back")
        for offloader in offloaders.values():
            offloader.reload(*OFFLOAD_PARTS)
            offloader.offload_enabled()


def _report_offload(offloaders: dict[str, ModelOffloader]) -> None:
    """One line naming what each model keeps in host memory between its phases, if anything."""
    parts = "; ".join(f"{name} {', '.join(offloader.enabled)}" for name, offloader in offloaders.items()
                      if offloader.enabled)
    if parts:
        say(f"[trident] kept in host memory outside their phases: {parts}")


def _rule_scores_available(cfg: ExperimentConfig, rewards: RewardManager, data_sources: set[str]) -> bool:
    """Rule scores are needed when they weigh in the reward or gate it; with ``rule_weight: 0``
    they are still computed for the metrics if every data source has a scorer."""
    try:
        rewards.check_data_sources(data_sources)
    except ValueError as error:
        if cfg.reward_model.combine.needs_rule_scores:
            raise
        logger.info("reward_model.combine.rule_weight=0 and no rule scores are logged: %s", error)
        return False
    return True


def _build_reward_model(cfg: ExperimentConfig, policy_tokenizer) -> RewardModelScorer:
    """The frozen reward model on the actor's mesh, with its own tokenizer (``reward_model.model``)."""
    from transformers import AutoTokenizer

    from engine.rewards.reward_model import RewardModelInputs
    from engine.roles.reward_model import MegatronRewardModel

    section = cfg.reward_model
    chunks = _build_model(section.model, section.megatron, value_head=True, trained=False, role="reward_model")
    tokenizer = AutoTokenizer.from_pretrained(section.model.tokenizer_path,
                                              trust_remote_code=section.model.trust_remote_code)
    return RewardModelScorer(MegatronRewardModel(chunks, section), RewardModelInputs(policy_tokenizer, tokenizer))


def _start_judge(cfg: ExperimentConfig, run: RunDirectory) -> tuple[JudgeClient, SGLangServer | None]:
    """The judge's client on every rank; with no ``judge.url``, global rank 0 first starts an SGLang
    server from ``judge.model.path`` (on its own GPUs' share, ``judge.model.gpu_memory_utilization``)."""
    from engine.config.actor_rollout_ref import RolloutConfig
    from engine.rollout.sglang_server import SGLangServerConfig

    judge = cfg.reward_model.judge
    server, box = None, [judge.url, None]
    if judge.url is None and dist.get_rank() == 0:
        settings = RolloutConfig(tensor_model_parallel_size=judge.model.tensor_model_parallel_size, dtype=judge.model.dtype,
                                 gpu_memory_utilization=judge.model.gpu_memory_utilization,
                                 startup_timeout_s=judge.model.startup_timeout_s)
        server = SGLangServer(SGLangServerConfig(model_path=judge.model.path, log_path=run.rollout_dir / "judge.log",
                                                 rollout=settings, skip_tokenizer_init=False))
        server.start()
        server.wait_until_ready()
        box = [server.url, str(server.log_path)]
    if judge.url is None:
        dist.broadcast_object_list(box, src=0, group=control_group())
    say(f"[trident] LLM judge: {box[0]}" + (f" (SGLang server, log {box[1]})" if box[1] else ""))
    return JudgeClient(judge, box[0], server_log=box[1]), server


def _optimizer_steps(iterations: int, role, data) -> int:
    """Optimizer steps of a role over ``iterations`` PPO iterations: epochs x mini-batches per batch."""
    return iterations * role.ppo_epochs * (data.train_batch_size // role.ppo_mini_batch_size)
