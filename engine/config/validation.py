"""Cross-field checks of a typed :class:`ExperimentConfig`, run by :func:`load_config`.

Each check raises :class:`ConfigError` with the numbers in conflict and a way out. Nothing here
starts a process group: everything is decided from the config, the world size and, when the model
folder exists locally, its HF ``config.json`` (read as plain JSON).

Names of algorithm parts come from :mod:`engine.algo.registry`, rollout engines from
:mod:`engine.rollout.factory`; both are imported here, lazily, because they pull in torch.
"""
from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from engine.config.actor_rollout_ref import LORA_SYNCS, ROLLOUT_DTYPES, ROLLOUT_MODES, ULYSSES_KEY, WEIGHT_SYNC_TARGETS
from engine.config.algorithm import FILTER_GROUP_METRICS, GROUP_ESTIMATORS
from engine.config.data import TRUNCATION_MODES
from engine.config.errors import ConfigError
from engine.config.experiment import ExperimentConfig
from engine.config.model import LR_DECAY_STYLES, PARAM_DTYPES, MegatronConfig, OptimConfig
from engine.config.reward_model import COMBINE_MODES
from engine.config.trainer import LOGGER_EXTRAS, LOGGERS, OPTIMIZER_FORMATS, PROFILE_TOOLS, RESUME_MODES
from parallel.device import DEVICES

logger = logging.getLogger(__name__)

ACTOR = "actor_rollout_ref.actor"
ROLLOUT = "actor_rollout_ref.rollout"


def validate(config: ExperimentConfig, world_size: int | None = None) -> None:
    """Raise :class:`ConfigError` on the first inconsistency of ``config``.

    Args:
        config: the typed experiment.
        world_size: ranks of the job; None uses ``trainer.nnodes * trainer.n_gpus_per_node``.
    """
    _check_not_built(config)
    _check_choices(config)
    _check_ranges(config)
    training_world, training_text = _world_size(config, world_size)
    actor_megatron = config.actor_rollout_ref.actor.megatron
    actor_dp = _data_parallel_size(f"{ACTOR}.megatron", actor_megatron, training_world, training_text)
    _check_model_shape("actor_rollout_ref.model.path", config.actor_rollout_ref.model.path,
                       f"{ACTOR}.megatron", actor_megatron,
                       rollout_tensor_parallel_size=config.actor_rollout_ref.rollout.tensor_model_parallel_size)
    _check_rollout(config, training_world)
    _check_actor_batches(config, actor_dp)
    if config.built_models().critic:
        _check_critic_layout(config)
        _check_model_shape("critic.model.path", config.critic.model.path, "critic.megatron", config.critic.megatron)
        _check_critic_batches(config, actor_dp)
    _check_reward_sources(config)
    _check_dapo(config)
    _check_packed_rows_under_context_parallel(config)


# ----------------------------------------------------------------------------- names


def _check_choices(config: ExperimentConfig) -> None:
    from engine.algo import registry
    from engine.rollout.factory import ROLLOUT_ENGINE_NAMES

    arr, algorithm, trainer = config.actor_rollout_ref, config.algorithm, config.trainer
    choices: list[tuple[str, Any, Sequence[str]]] = [
        ("data.truncation", config.data.truncation, TRUNCATION_MODES),
        (f"{ROLLOUT}.name", arr.rollout.name, ROLLOUT_ENGINE_NAMES),
        (f"{ROLLOUT}.mode", arr.rollout.mode, ROLLOUT_MODES),
        (f"{ROLLOUT}.dtype", arr.rollout.dtype, ROLLOUT_DTYPES),
        (f"{ROLLOUT}.weight_sync_target", arr.rollout.weight_sync_target, WEIGHT_SYNC_TARGETS),
        (f"{ROLLOUT}.lora_sync", arr.rollout.lora_sync, LORA_SYNCS),
        ("algorithm.adv_estimator", algorithm.adv_estimator, registry.names("adv_estimator")),
        ("algorithm.kl_penalty", algorithm.kl_penalty, registry.names("kl_estimator")),
        ("algorithm.kl_ctrl.type", algorithm.kl_ctrl.type, registry.names("kl_controller")),
        ("algorithm.filter_groups.metric", algorithm.filter_groups.metric, FILTER_GROUP_METRICS),
        (f"{ACTOR}.kl_loss_type", arr.actor.kl_loss_type, registry.names("kl_estimator")),
        (f"{ACTOR}.policy_loss.loss_mode", arr.actor.policy_loss.loss_mode, registry.names("policy_loss")),
        (f"{ACTOR}.loss_agg_mode", arr.actor.loss_agg_mode, registry.names("loss_agg_mode")),
        ("critic.loss_agg_mode", config.critic.loss_agg_mode, registry.names("loss_agg_mode")),
        (f"{ACTOR}.optim.lr_decay_style", arr.actor.optim.lr_decay_style, LR_DECAY_STYLES),
        ("critic.optim.lr_decay_style", config.critic.optim.lr_decay_style, LR_DECAY_STYLES),
        (f"{ACTOR}.megatron.param_dtype", arr.actor.megatron.param_dtype, PARAM_DTYPES),
        ("critic.megatron.param_dtype", config.critic.megatron.param_dtype, PARAM_DTYPES),
        ("reward_model.megatron.param_dtype", config.reward_model.megatron.param_dtype, PARAM_DTYPES),
        ("reward_model.combine.mode", config.reward_model.combine.mode, COMBINE_MODES),
        ("reward_model.judge.model.dtype", config.reward_model.judge.model.dtype, ROLLOUT_DTYPES),
        ("trainer.resume_mode", trainer.resume_mode, RESUME_MODES),
        ("trainer.checkpoint.optimizer_format", trainer.checkpoint.optimizer_format, OPTIMIZER_FORMATS),
        ("trainer.device", trainer.device, DEVICES),
        ("trainer.profile.tool", trainer.profile.tool, PROFILE_TOOLS),
    ]
    choices += [(f"trainer.logger[{i}]", name, LOGGERS) for i, name in enumerate(trainer.logger)]
    for key, value, valid in choices:
        if value not in valid:
            close = difflib.get_close_matches(str(value), list(valid), n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{key}={value!r} is not a valid choice.{hint} Valid values: {', '.join(valid)}.")
    if len(set(trainer.logger)) != len(trainer.logger):
        raise ConfigError(f"trainer.logger={trainer.logger} names a logger twice; list each once.")
    for name in trainer.logger:
        modules, extra = LOGGER_EXTRAS.get(name, ((), ""))
        missing = [module for module in modules if importlib.util.find_spec(module) is None]
        if missing:
            raise ConfigError(f"trainer.logger includes {name!r}, but {', '.join(missing)} is not installed; "
                              f"pip install 'trident-ppo[{extra}]' (or drop {name!r} from trainer.logger).")
    _check_sglang_installed(config)


def _check_sglang_installed(config: ExperimentConfig) -> None:
    """SGLang runs the rollout servers and a judge Trident starts; the trainers also use its
    weight-update helpers. Without it, say how to install it rather than fail at start-up."""
    users = [f"{ROLLOUT}.name='sglang'"] if config.actor_rollout_ref.rollout.name == "sglang" else []
    users += ["reward_model.judge (a server of judge.model.path)"] if config.built_models().judge_server else []
    if users and importlib.util.find_spec("sglang") is None:
        raise ConfigError(
            f"{' and '.join(users)} need(s) SGLang, which is not installed in this Python ({sys.executable}). "
            "On a GPU machine: pip install -e '.[gpu]' (SGLang and transformer-engine); on a machine without "
            "GPUs: make sglang (SGLang's CPU tier, as make test installs it). Or generate with the embedded "
            f"engine: {ROLLOUT}.name=torch.")


_LORA = "LoRA is built for the actor only (actor_rollout_ref.model.lora_rank); the critic trains all its weights"
_ROUTER_REPLAY = ("router replay is built for the actor's passes (actor_rollout_ref.actor.megatron."
                  "moe_router_replay); the critic routes its values itself")
# Keys of features that are not built yet: the only value each accepts, and why. Anything else is
# refused here, never accepted and ignored (tests/test_config_liveness.py holds every other key to
# a run-time read).
NOT_BUILT: dict[str, tuple[Any, str]] = {
    "critic.model.lora_rank": (0, _LORA),
    "critic.model.lora_alpha": (16, _LORA),
    "critic.model.target_modules": ("all-linear", _LORA),
    "critic.megatron.moe_router_replay": (False, _ROUTER_REPLAY),
}


def _check_not_built(config: ExperimentConfig) -> None:
    """Switches of features that are not built yet: refused, never accepted and ignored."""
    for key, (built, reason) in NOT_BUILT.items():
        value: Any = config
        for part in key.split("."):
            value = getattr(value, part)
        if value != built:
            raise ConfigError(f"{key}={value!r}: {reason}.")


# ----------------------------------------------------------------------------- single values


def _require(condition: bool, key: str, value: Any, requirement: str) -> None:
    if not condition:
        raise ConfigError(f"{key}={value!r}: must be {requirement}.")


def _check_positive(owner: Any, prefix: str, names: Sequence[str], allow_none: bool = False) -> None:
    for name in names:
        value = getattr(owner, name)
        if value is None and allow_none:
            continue
        _require(value is not None and value >= 1, f"{prefix}.{name}", value,
                 ">= 1" + (" or null" if allow_none else ""))


def _check_optim(prefix: str, optim: OptimConfig) -> None:
    _require(optim.lr >= 0, f"{prefix}.lr", optim.lr, ">= 0")
    _require(len(optim.betas) == 2 and all(0 <= beta < 1 for beta in optim.betas), f"{prefix}.betas",
             optim.betas, "two numbers in [0, 1), e.g. [0.9, 0.999]")
    _require(optim.eps > 0, f"{prefix}.eps", optim.eps, "> 0")
    _require(optim.weight_decay >= 0, f"{prefix}.weight_decay", optim.weight_decay, ">= 0")
    _require(0 <= optim.lr_warmup_steps_ratio <= 1, f"{prefix}.lr_warmup_steps_ratio",
             optim.lr_warmup_steps_ratio, "in [0, 1]")
    _require(0 <= optim.min_lr <= optim.lr, f"{prefix}.min_lr", optim.min_lr, f"in [0, lr={optim.lr}]")
    _require(optim.max_grad_norm >= 0, f"{prefix}.max_grad_norm", optim.max_grad_norm, ">= 0 (0 disables clipping)")


def _check_sampling(prefix: str, sampling: Any) -> None:
    _check_positive(sampling, prefix, ("n",))
    _require(sampling.temperature >= 0, f"{prefix}.temperature", sampling.temperature, ">= 0")
    _require(0 < sampling.top_p <= 1, f"{prefix}.top_p", sampling.top_p, "in (0, 1]")
    _require(sampling.top_k == -1 or sampling.top_k >= 1, f"{prefix}.top_k", sampling.top_k, "-1 (off) or >= 1")


def _check_ranges(config: ExperimentConfig) -> None:
    data, arr, critic = config.data, config.actor_rollout_ref, config.critic
    actor, rollout, algorithm, trainer = arr.actor, arr.rollout, config.algorithm, config.trainer
    _require(len(data.train_files) > 0, "data.train_files", data.train_files, "at least one Parquet file")
    _check_positive(data, "data", ("train_batch_size", "max_prompt_length", "max_response_length"))
    _check_positive(data, "data", ("val_batch_size",), allow_none=True)
    for prefix, model in (("actor_rollout_ref.model", arr.model), ("critic.model", critic.model)):
        _require(model.lora_rank >= 0, f"{prefix}.lora_rank", model.lora_rank, ">= 0 (0 disables LoRA)")
        _require(model.lora_rank == 0 or model.lora_alpha > 0, f"{prefix}.lora_alpha", model.lora_alpha, "> 0")
    if arr.model.lora_rank:
        try:
            arr.model.lora_settings(seed=0).megatron_layers()
        except ValueError as error:
            raise ConfigError(f"actor_rollout_ref.{error}") from None
        _require(not arr.ref.megatron.param_offload, "actor_rollout_ref.ref.megatron.param_offload", True,
                 "false with LoRA: the reference is the actor with its adapters off; offload its weights "
                 f"with {ACTOR}.megatron.param_offload")
    _check_positive(actor, ACTOR, ("ppo_epochs", "ppo_mini_batch_size", "ppo_max_token_len_per_gpu"))
    _check_positive(actor, ACTOR, ("ppo_micro_batch_size_per_gpu",), allow_none=True)
    _require(actor.clip_ratio > 0, f"{ACTOR}.clip_ratio", actor.clip_ratio, "> 0")
    for name in ("clip_ratio_low", "clip_ratio_high"):
        value = getattr(actor, name)
        _require(value is None or value > 0, f"{ACTOR}.{name}", value, "> 0 or null (= clip_ratio)")
    low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    _require(low < 1, f"{ACTOR}.clip_ratio_low", low, "< 1 (the ratio is clipped below at 1 - clip_ratio_low)")
    _require(actor.clip_ratio_c is None or actor.clip_ratio_c > 1, f"{ACTOR}.clip_ratio_c", actor.clip_ratio_c,
             "> 1 (the dual-clip bound) or null to disable dual-clip")
    _require(actor.kl_loss_coef >= 0, f"{ACTOR}.kl_loss_coef", actor.kl_loss_coef, ">= 0")
    for prefix, megatron in ((f"{ACTOR}.megatron", actor.megatron), ("critic.megatron", critic.megatron)):
        _require(megatron.moe_aux_loss_coeff >= 0, f"{prefix}.moe_aux_loss_coeff", megatron.moe_aux_loss_coeff,
                 ">= 0 (0 adds no load-balancing loss)")
        _require(not (megatron.overlap_param_gather and not megatron.use_distributed_optimizer),
                 f"{prefix}.overlap_param_gather", True,
                 f"false or null with {prefix}.use_distributed_optimizer=false (without the distributed optimizer "
                 "every rank holds the whole updated weights: there is nothing to gather)")
    _require(not (actor.megatron.moe_router_replay and arr.model.enable_gradient_checkpointing
                  and actor.megatron.pipeline_model_parallel_size > 1), f"{ACTOR}.megatron.moe_router_replay", True,
             "false with actor_rollout_ref.model.enable_gradient_checkpointing=true and pipeline parallelism: a layer "
             "recomputed in a backward pass that does not directly follow its forward would replay another "
             "micro-batch's routing (not built)")
    _check_optim(f"{ACTOR}.optim", actor.optim)
    _check_positive(arr.ref, "actor_rollout_ref.ref", ("log_prob_max_token_len_per_gpu",))
    _check_positive(arr.ref, "actor_rollout_ref.ref", ("log_prob_micro_batch_size_per_gpu",), allow_none=True)
    _check_positive(rollout, ROLLOUT, ("tensor_model_parallel_size", "update_weights_bucket_megabytes",
                                       "log_prob_max_token_len_per_gpu"))
    _check_positive(rollout, ROLLOUT, ("log_prob_micro_batch_size_per_gpu",), allow_none=True)
    _require(0 < rollout.gpu_memory_utilization <= 1, f"{ROLLOUT}.gpu_memory_utilization",
             rollout.gpu_memory_utilization, "in (0, 1]")
    for name in ("startup_timeout_s", "request_timeout_s", "weight_update_timeout_s"):
        _require(getattr(rollout, name) > 0, f"{ROLLOUT}.{name}", getattr(rollout, name), "> 0 seconds")
    _require(rollout.max_server_restarts >= 0, f"{ROLLOUT}.max_server_restarts", rollout.max_server_restarts,
             ">= 0 (0 stops the run at the first server death)")
    _require(rollout.check_weight_sync_tolerance > 0, f"{ROLLOUT}.check_weight_sync_tolerance",
             rollout.check_weight_sync_tolerance, "> 0")
    _require(not (arr.actor.use_rollout_log_probs and rollout.check_weight_sync and rollout.name != "torch"),
             f"{ACTOR}.use_rollout_log_probs", True,
             f"false with {ROLLOUT}.check_weight_sync (the check compares the engine's log-probs with the "
             "actor's recomputed ones, which use_rollout_log_probs skips)")
    if rollout.lora_sync == "adapters":
        _require(arr.model.lora_rank > 0, f"{ROLLOUT}.lora_sync", "adapters",
                 "merged without LoRA (actor_rollout_ref.model.lora_rank=0: there are no adapters to push)")
        _require(rollout.name in ("sglang", "torch"), f"{ROLLOUT}.lora_sync", "adapters",
                 f"merged with {ROLLOUT}.name={rollout.name!r} (adapters-only sync is built for 'sglang' and 'torch')")
        _require(rollout.mode == "colocated", f"{ROLLOUT}.lora_sync", "adapters",
                 "merged with servers of their own (mode=disaggregated): SGLang takes adapters as tensors only "
                 "through host shared memory, which servers elsewhere cannot open (not built)")
    _check_sampling(ROLLOUT, rollout)
    _check_sampling(f"{ROLLOUT}.val_kwargs", rollout.val_kwargs)
    if algorithm.uses_critic:
        _check_positive(critic, "critic", ("ppo_epochs", "ppo_mini_batch_size", "ppo_max_token_len_per_gpu"))
        _check_positive(critic, "critic", ("ppo_micro_batch_size_per_gpu", "forward_micro_batch_size_per_gpu"),
                        allow_none=True)
        _check_positive(critic, "critic", ("forward_max_token_len_per_gpu",))
        _require(critic.cliprange_value is None or critic.cliprange_value > 0, "critic.cliprange_value",
                 critic.cliprange_value, "> 0, or null for a plain squared error")
        _require(critic.warmup_steps >= 0, "critic.warmup_steps", critic.warmup_steps, ">= 0")
        _check_optim("critic.optim", critic.optim)
    for name in ("gamma", "lam"):
        value = getattr(algorithm, name)
        _require(0 <= value <= 1, f"algorithm.{name}", value, "in [0, 1]")
    kl_ctrl = algorithm.kl_ctrl
    _require(kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", kl_ctrl.kl_coef, ">= 0")
    _require(kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl", kl_ctrl.target_kl, "> 0")
    _require(kl_ctrl.horizon > 0, "algorithm.kl_ctrl.horizon", kl_ctrl.horizon, "> 0")
    if algorithm.adv_estimator in GROUP_ESTIMATORS and rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={algorithm.adv_estimator!r} compares the responses to the same prompt, "
            f"but {ROLLOUT}.n={rollout.n} samples one per prompt, so every advantage would be 0; "
            f"set {ROLLOUT}.n to 2 or more (4-16 is usual)."
        )
    _check_positive(trainer, "trainer", ("nnodes", "n_gpus_per_node", "total_epochs", "collective_timeout_minutes"))
    _check_positive(trainer, "trainer", ("total_training_steps", "max_ckpt_to_keep"), allow_none=True)
    hang = trainer.hang_timeout_minutes
    if hang is not None and not 0 <= hang < trainer.collective_timeout_minutes:
        raise ConfigError(
            f"trainer.hang_timeout_minutes={hang:g} must be 0 (off) or below trainer.collective_timeout_minutes="
            f"{trainer.collective_timeout_minutes}: a hung collective would otherwise end the job before the "
            "watchdog dumps the stacks and names the phase")
    for name in ("save_freq", "test_freq"):
        value = getattr(trainer, name)
        meaning = "-1 (only at the end)" if name == "save_freq" else "-1 (off)"
        _require(value == -1 or value >= 1, f"trainer.{name}", value, f"{meaning} or >= 1 (every that many steps)")
    _require(trainer.prometheus_port is None or 0 < trainer.prometheus_port < 65536, "trainer.prometheus_port",
             trainer.prometheus_port, "a TCP port (1-65535) or null (off)")
    profile = trainer.profile
    _require(all(step >= 1 for step in profile.steps), "trainer.profile.steps", profile.steps, "PPO steps >= 1")
    _require(all(0 <= rank < _world_size(config, None)[0] for rank in profile.ranks), "trainer.profile.ranks",
             profile.ranks, "global ranks of the job (0 .. nnodes x n_gpus_per_node - 1)")
    if trainer.val_only and not config.data.val_files:
        raise ConfigError("trainer.val_only=true needs data.val_files (the prompts to validate on).")
    if trainer.resume_mode == "resume_path" and not trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode='resume_path' needs trainer.resume_from_path=CHECKPOINT_DIR "
                          "(or use resume_mode=auto to resume from the newest checkpoint in default_local_dir).")


# ----------------------------------------------------------------------------- layouts


def _world_size(config: ExperimentConfig, world_size: int | None) -> tuple[int, str]:
    """The job's ranks: ``trainer.nnodes x trainer.n_gpus_per_node``, which a launch must match."""
    trainer = config.trainer
    world = trainer.nnodes * trainer.n_gpus_per_node
    text = (f"world size {world} = trainer.nnodes ({trainer.nnodes}) x trainer.n_gpus_per_node "
            f"({trainer.n_gpus_per_node})")
    if world_size is not None and world_size != world:
        raise ConfigError(
            f"the job was launched with {world_size} ranks, but the experiment describes {text}; set "
            f"trainer.nnodes and trainer.n_gpus_per_node to the launch (e.g. trainer.n_gpus_per_node={world_size} "
            f"on one node) or launch {world} ranks."
        )
    return world, text


def check_launch(config: ExperimentConfig, world_size: int, ranks_per_node: int) -> None:
    """The launched job matches ``trainer.nnodes`` x ``trainer.n_gpus_per_node`` (torchrun's
    ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``): the layout checks and GPU placement rely on it."""
    _world_size(config, world_size)
    if ranks_per_node != config.trainer.n_gpus_per_node:
        raise ConfigError(
            f"the job runs {ranks_per_node} ranks per node (LOCAL_WORLD_SIZE), but trainer.n_gpus_per_node="
            f"{config.trainer.n_gpus_per_node}; launch with --nproc_per_node {config.trainer.n_gpus_per_node} or "
            f"set trainer.n_gpus_per_node (and trainer.nnodes) to the launch."
        )


def _data_parallel_size(key: str, megatron: MegatronConfig, world: int, world_text: str) -> int:
    """dp = world / (tp * pp * cp), after parallel.layout's checks (translated to ConfigError)."""
    from parallel.layout import LayoutError

    try:
        return megatron.data_parallel_size(world)
    except LayoutError as error:
        message = f"{key}: {error}."
        if world % megatron.model_parallel_size == 0:
            raise ConfigError(message) from None
        tp, pp, cp = (megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                      megatron.context_parallel_size)
        raise ConfigError(
            f"{message} The ranks must factor as world_size = tp * pp * cp * dp, with the data-parallel size dp "
            f"derived as {world} / ({tp} * {pp} * {cp}) ({world_text}); change {key}.tensor_model_parallel_size, "
            "pipeline_model_parallel_size or context_parallel_size, or the number of ranks."
        ) from None


def _read_model_shape(path_key: str, model_path: str) -> dict[str, Any] | None:
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        logger.debug("%s=%s has no config.json here; skipping the head/layer divisibility checks",
                     path_key, model_path)
        return None
    try:
        hf_config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{config_file} (from {path_key}) is not readable JSON: {error}.") from None
    if "num_attention_heads" not in hf_config or "num_hidden_layers" not in hf_config:
        logger.debug("%s lacks num_attention_heads/num_hidden_layers; skipping the head/layer checks", config_file)
        return None
    heads = int(hf_config["num_attention_heads"])
    return {"num_attention_heads": heads,
            "num_key_value_heads": int(hf_config.get("num_key_value_heads") or heads),
            "num_hidden_layers": int(hf_config["num_hidden_layers"]),
            "source": str(config_file)}


def _divisors(number: int) -> str:
    return ", ".join(str(d) for d in range(1, number + 1) if number % d == 0)


def _check_model_shape(path_key: str, model_path: str, megatron_key: str, megatron: MegatronConfig,
                       rollout_tensor_parallel_size: int | None = None) -> None:
    shape = _read_model_shape(path_key, model_path)
    if shape is None:
        return
    heads, kv_heads, layers, source = (shape["num_attention_heads"], shape["num_key_value_heads"],
                                       shape["num_hidden_layers"], shape["source"])
    tp = megatron.tensor_model_parallel_size
    if heads % tp or kv_heads % tp:
        raise ConfigError(
            f"{megatron_key}.tensor_model_parallel_size={tp} must divide the model's num_attention_heads={heads} "
            f"and num_key_value_heads={kv_heads} (from {source}): each TP rank holds whole heads. "
            f"Valid TP sizes for this model: {_divisors(math.gcd(heads, kv_heads))}."
        )
    if megatron.context_parallel_size > 1:
        _check_context_parallel(megatron_key, megatron, heads // tp, kv_heads // tp, source)
    pp = megatron.pipeline_model_parallel_size
    vpp = megatron.virtual_pipeline_model_parallel_size or 1
    if layers % (pp * vpp):
        raise ConfigError(
            f"The model's num_hidden_layers={layers} (from {source}) must be divisible by "
            f"{megatron_key}.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp} x {vpp} = "
            f"{pp * vpp}, so every model chunk gets the same number of layers. Choose pp * vpp among: "
            f"{_divisors(layers)}."
        )
    rollout_tp = rollout_tensor_parallel_size
    # SGLang splits query heads evenly and replicates KV heads when there are fewer than TP ranks.
    if rollout_tp is not None and (heads % rollout_tp or (kv_heads % rollout_tp and rollout_tp % kv_heads)):
        raise ConfigError(
            f"{ROLLOUT}.tensor_model_parallel_size={rollout_tp} must divide the model's num_attention_heads={heads}, "
            f"and num_key_value_heads={kv_heads} must divide it or be divisible by it (from {source}). "
            f"Valid generation TP sizes divide {heads}: {_divisors(heads)}."
        )


def _check_context_parallel(megatron_key: str, megatron: MegatronConfig, heads_per_tp_rank: int,
                            kv_heads_per_tp_rank: int, source: str) -> None:
    from parallel.layout import STAND_IN_COMM_TYPES

    cp, comm = megatron.context_parallel_size, megatron.cp_comm_type
    setting = f"{megatron_key}.context_parallel_size={cp} with {megatron_key}.cp_comm_type={comm}"
    if comm not in STAND_IN_COMM_TYPES and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError(
            f"{setting}: that exchange runs in Transformer Engine's attention, which this machine does not have; "
            f"without it context parallelism runs {' or '.join(STAND_IN_COMM_TYPES)}.")
    if comm == "a2a" and (heads_per_tp_rank % cp or kv_heads_per_tp_rank % cp):
        raise ConfigError(
            f"{setting} (also what {ULYSSES_KEY} sets): the all-to-all splits each tensor-parallel rank's "
            f"{heads_per_tp_rank} attention heads and {kv_heads_per_tp_rank} key/value heads (from {source}) over "
            f"the CP ranks, so both must divide by {cp}; use cp_comm_type=p2p (Transformer Engine), all_gather with "
            "use_remove_padding=false (all_gather takes no packed rows), or a smaller CP.")


def _check_packed_rows_under_context_parallel(config: ExperimentConfig) -> None:
    """Packed (THD) rows only where the CP exchange takes them (``PACKED_ROW_COMM_TYPES``), on any
    machine: the CPU stand-in refuses what Transformer Engine refuses, so a CPU run cannot pass a
    layout that fails on the GPU."""
    from parallel.layout import PACKED_ROW_COMM_TYPES

    built = config.built_models()
    roles = [(f"{ACTOR}.megatron", config.actor_rollout_ref.actor.megatron, "actor_rollout_ref.model.use_remove_padding",
              config.actor_rollout_ref.model.use_remove_padding)]
    if built.critic:
        roles.append(("critic.megatron", config.critic.megatron, "critic.model.use_remove_padding",
                      config.critic.model.use_remove_padding))
    if built.reward_model:
        roles.append(("reward_model.megatron", config.reward_model.megatron, "reward_model.model.use_remove_padding",
                      config.reward_model.model.use_remove_padding))
    for megatron_key, megatron, packing_key, packed in roles:
        comm = megatron.cp_comm_type
        if megatron.context_parallel_size > 1 and packed and comm not in PACKED_ROW_COMM_TYPES:
            raise ConfigError(
                f"{megatron_key}.cp_comm_type={comm} with {packing_key}=true: Transformer Engine's {comm} "
                f"context-parallel attention does not take packed (THD) rows; use cp_comm_type="
                f"{' or '.join(PACKED_ROW_COMM_TYPES)}, or {packing_key}=false (padded rows).")


def _check_rollout(config: ExperimentConfig, training_world: int) -> None:
    rollout = config.actor_rollout_ref.rollout
    megatron = config.actor_rollout_ref.actor.megatron
    rollout_tp = rollout.tensor_model_parallel_size
    if rollout.name in ("torch", "torch-process") and rollout_tp != 1:
        raise ConfigError(
            f"{ROLLOUT}.name={rollout.name} generates with transformers on one device, without tensor "
            f"parallelism; set {ROLLOUT}.tensor_model_parallel_size=1 (got {rollout_tp}) or use name=sglang."
        )
    _check_staleness(config)
    _check_rollout_correction(config)
    _check_multi_turn(config)
    _require(not rollout.server_addresses or rollout.mode == "disaggregated", f"{ROLLOUT}.server_addresses",
             list(rollout.server_addresses), f"empty with {ROLLOUT}.mode=colocated (servers of their own need "
             f"mode=disaggregated)")
    if rollout.mode == "disaggregated":
        _check_disaggregated(config)
        return
    _require(rollout.num_gpus == 0, f"{ROLLOUT}.num_gpus", rollout.num_gpus,
             f"0 with {ROLLOUT}.mode=colocated (the engines share the training GPUs; set mode=disaggregated to give "
             f"them GPUs of their own)")
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    if (tp * pp) % rollout_tp:
        raise ConfigError(
            f"{ROLLOUT}.tensor_model_parallel_size={rollout_tp} must divide the actor's training model-parallel size "
            f"tp * pp = {tp} * {pp} = {tp * pp}: colocated generation splits each training model-parallel group "
            f"into (tp * pp) / rollout_tp engine replicas. Use a generation TP among {_divisors(tp * pp)}, or "
            f"raise {ACTOR}.megatron.tensor_model_parallel_size."
        )
    _check_replica_placement(config, training_world)


def _check_multi_turn(config: ExperimentConfig) -> None:
    """Multi-turn rollouts: their files load (tools and environments import), and nothing that is
    not built for them is asked for."""
    from engine.rollout.agentic.parsing import TOOL_CALL_FORMATS

    multi_turn, key = config.actor_rollout_ref.rollout.multi_turn, f"{ROLLOUT}.multi_turn"
    if not multi_turn.enable:
        for name in ("tool_config_path", "interaction_config_path"):
            _require(getattr(multi_turn, name) is None, f"{key}.{name}", getattr(multi_turn, name),
                     f"null with {key}.enable=false (it would be ignored; set {key}.enable=true)")
        return
    _require(multi_turn.format in TOOL_CALL_FORMATS, f"{key}.format", multi_turn.format, f"one of {list(TOOL_CALL_FORMATS)}")
    _require(multi_turn.max_assistant_turns >= 1, f"{key}.max_assistant_turns", multi_turn.max_assistant_turns, ">= 1")
    _require(multi_turn.max_user_turns >= 0, f"{key}.max_user_turns", multi_turn.max_user_turns, ">= 0")
    _require(bool(multi_turn.tool_config_path or multi_turn.interaction_config_path), f"{key}.enable", True,
             f"false, or set {key}.tool_config_path and/or {key}.interaction_config_path (with neither there is "
             f"nothing to answer the model between turns)")
    _require(not config.actor_rollout_ref.rollout.partial_rollout, f"{ROLLOUT}.partial_rollout", True,
             f"false with {key}.enable: pausing trajectories in place across a weight push is not built")
    _require(not config.actor_rollout_ref.actor.megatron.moe_router_replay, f"{ACTOR}.megatron.moe_router_replay",
             True, f"false with {key}.enable: replaying the routing of multi-turn trajectories is not built")
    from engine.rollout.agentic.environment import EnvironmentConfigError, load_environments
    from engine.rollout.agentic.tools import ToolError, load_tools

    try:
        if multi_turn.tool_config_path:
            load_tools(multi_turn.tool_config_path)
        if multi_turn.interaction_config_path:
            load_environments(multi_turn.interaction_config_path)
    except (ToolError, EnvironmentConfigError) as error:
        raise ConfigError(f"{key}: {error}") from None


def _check_rollout_correction(config: ExperimentConfig) -> None:
    from engine.config.algorithm import ROLLOUT_IS_LEVELS, ROLLOUT_RS_LEVELS

    correction, key = config.algorithm.rollout_correction, "algorithm.rollout_correction"
    _require(correction.rollout_is is None or correction.rollout_is in ROLLOUT_IS_LEVELS, f"{key}.rollout_is",
             correction.rollout_is, f"null or one of {list(ROLLOUT_IS_LEVELS)}")
    _require(correction.rollout_rs is None or correction.rollout_rs in ROLLOUT_RS_LEVELS, f"{key}.rollout_rs",
             correction.rollout_rs, f"null or one of {list(ROLLOUT_RS_LEVELS)}")
    _require(correction.rollout_is_threshold >= 1, f"{key}.rollout_is_threshold", correction.rollout_is_threshold,
             ">= 1 (the largest importance weight)")
    if correction.rollout_rs is not None:
        # [lower, upper] must hold 1: a token or sequence both policies agree on is never rejected.
        upper = correction.rollout_rs_threshold
        _require(upper is None or upper >= 1, f"{key}.rollout_rs_threshold", upper,
                 ">= 1 or null (a ratio of 1, both policies agreeing, must be kept)")
        lower = correction.rollout_rs_threshold_lower
        _require(lower is None or 0 < lower <= 1, f"{key}.rollout_rs_threshold_lower", lower,
                 "in (0, 1] or null (a ratio of 1, both policies agreeing, must be kept)")
    _require(not (correction.enabled and config.actor_rollout_ref.actor.use_rollout_log_probs),
             f"{ACTOR}.use_rollout_log_probs", True,
             f"false with {key}: pi_old would be the rollout's own log-probs, so every ratio would be 1 and the "
             f"correction would silently do nothing")


def _check_staleness(config: ExperimentConfig) -> None:
    """One step off-policy needs servers that generate while the trainer trains."""
    staleness, rollout = config.trainer.max_staleness, config.actor_rollout_ref.rollout
    _require(staleness >= 0, "trainer.max_staleness", staleness, ">= 0 (0: on-policy; k: k steps off-policy)")
    if rollout.partial_rollout:
        _require(staleness >= 1, f"{ROLLOUT}.partial_rollout", True,
                 "false with trainer.max_staleness=0: on-policy, no generation is in flight at a weight push")
    if staleness == 0:
        return
    _require(rollout.mode == "disaggregated", "trainer.max_staleness", staleness,
             f"0 with {ROLLOUT}.mode={rollout.mode}: colocated engines share the trainer's GPUs, so generation "
             f"cannot overlap training (set {ROLLOUT}.mode=disaggregated)")
    _require(not config.algorithm.uses_greedy_baseline, "trainer.max_staleness", staleness,
             "0 with algorithm.adv_estimator=remax (its greedy baseline is not generated ahead)")
    _require(not rollout.check_weight_sync, f"{ROLLOUT}.check_weight_sync", True,
             f"false with trainer.max_staleness={staleness}: the rollout's log-probs come from earlier weights, so "
             "they cannot confirm the last push (check the sync with max_staleness=0)")


def _check_disaggregated(config: ExperimentConfig) -> None:
    """Servers on GPUs of their own: SGLang only; whole servers on the trainer's (single) node, or
    servers already running on nodes of their own (``server_addresses``)."""
    rollout = config.actor_rollout_ref.rollout
    _require(rollout.name == "sglang", f"{ROLLOUT}.name", rollout.name,
             f"'sglang' with {ROLLOUT}.mode=disaggregated (the embedded engine lives inside the trainer processes)")
    if rollout.server_addresses:
        for address in rollout.server_addresses:
            host, _, port = str(address).rpartition(":")
            _require(bool(host) and port.isdigit() and 0 < int(port) < 65536, f"{ROLLOUT}.server_addresses",
                     list(rollout.server_addresses), f"'host:port' entries (got {address!r})")
        _require(rollout.num_gpus == 0, f"{ROLLOUT}.num_gpus", rollout.num_gpus,
                 f"0 with {ROLLOUT}.server_addresses (those servers run on GPUs outside this job's)")
        return
    tp = rollout.tensor_model_parallel_size
    _require(rollout.num_gpus >= tp and rollout.num_gpus % tp == 0, f"{ROLLOUT}.num_gpus", rollout.num_gpus,
             f"a positive multiple of {ROLLOUT}.tensor_model_parallel_size={tp} in mode=disaggregated "
             f"(num_gpus / tensor_model_parallel_size servers)")
    _require(config.trainer.nnodes == 1, "trainer.nnodes", config.trainer.nnodes,
             f"1 with {ROLLOUT}.mode=disaggregated and num_gpus: rank 0 starts the servers on its node after its "
             f"trainer.n_gpus_per_node GPUs; for servers on nodes of their own start them with "
             f"`python -m launch.rollout_servers` and give their {ROLLOUT}.server_addresses")


def _check_replica_placement(config: ExperimentConfig, training_world: int) -> None:
    """Each colocated SGLang replica must fit on one node (its GPUs are those of its ranks)."""
    from parallel.hybrid_engine import GenerationLayout, HybridLayout, TrainingLayout
    from parallel.layout import LayoutError

    per_node = config.trainer.n_gpus_per_node
    if config.actor_rollout_ref.rollout.name != "sglang" or training_world % per_node:
        return  # the embedded engine has no TP; a world that is not whole nodes is a local test
    try:
        training = TrainingLayout.from_parallel_layout(config.actor_rollout_ref.actor.megatron, training_world)
        layout = HybridLayout(training, GenerationLayout(config.actor_rollout_ref.rollout.tensor_model_parallel_size))
        layout.replica_placements(per_node)
    except LayoutError as error:
        raise ConfigError(f"{ROLLOUT}.tensor_model_parallel_size with trainer.n_gpus_per_node={per_node}: {error}.") from None


# ----------------------------------------------------------------------------- batch sizes


def _check_interleaved_micro_batches(what: str, count: int, megatron_key: str, megatron: MegatronConfig,
                                     dynamic: bool = False) -> None:
    """megatron's interleaved (VPP) schedule runs a multiple of pipeline_model_parallel_size micro-batches.

    Token-budget batching rounds its count up itself but needs a sequence per micro-batch (``count``
    is then the rank's sequences); fixed-size micro-batches must come out a multiple.
    """
    pp, vpp = megatron.pipeline_model_parallel_size, megatron.virtual_pipeline_model_parallel_size
    if not vpp:
        return
    if dynamic and count < pp:
        raise ConfigError(
            f"{what} gives each rank {count} sequences, but {megatron_key}.virtual_pipeline_model_parallel_size={vpp} "
            f"(the interleaved schedule) runs at least pipeline_model_parallel_size={pp} micro-batches of one "
            f"sequence or more; raise the batch sizes."
        )
    if not dynamic and count % pp:
        raise ConfigError(
            f"{what} makes {count} micro-batches per rank, but {megatron_key}.virtual_pipeline_model_parallel_size="
            f"{vpp} (the interleaved schedule) needs a multiple of pipeline_model_parallel_size={pp}; change the "
            f"batch or micro-batch sizes, or use_dynamic_bsz=true."
        )


def _check_ppo_batches(prefix: str, section: Any, dp: int, dynamic: bool, config: ExperimentConfig) -> None:
    """Rollout batch -> mini-batches (optimizer steps) -> per-rank micro-batches must all divide."""
    batch, n = config.data.train_batch_size, config.actor_rollout_ref.rollout.n
    mini, micro = section.ppo_mini_batch_size, section.ppo_micro_batch_size_per_gpu
    if batch % dp:  # each data-parallel rank generates for its own share of the prompts
        raise ConfigError(
            f"data.train_batch_size={batch} prompts must split evenly over the {prefix} data-parallel size "
            f"dp = {dp} (each data-parallel rank samples its share of the prompts); make it a multiple of {dp}."
        )
    if mini > batch or batch % mini:
        raise ConfigError(
            f"data.train_batch_size={batch} must be a multiple of {prefix}.ppo_mini_batch_size={mini} (both count "
            f"prompts; each PPO epoch makes train_batch_size / ppo_mini_batch_size optimizer steps)."
        )
    mini_sequences = mini * n
    if not dynamic and micro is None:
        raise ConfigError(
            f"{prefix}.ppo_micro_batch_size_per_gpu is not set: set it (sequences per forward/backward on one "
            f"rank) or set {prefix}.use_dynamic_bsz=true to batch by {prefix}.ppo_max_token_len_per_gpu."
        )
    step = dp if dynamic else micro * dp
    if mini_sequences % step:
        detail = (f"the data-parallel size dp = {dp}" if dynamic else
                  f"{prefix}.ppo_micro_batch_size_per_gpu * dp = {micro} * {dp} = {step}")
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size * {ROLLOUT}.n = {mini} * {n} = {mini_sequences} sequences per mini-batch "
            f"must be divisible by {detail}, so every rank runs whole micro-batches; change "
            f"ppo_mini_batch_size, ppo_micro_batch_size_per_gpu or rollout.n."
        )
    if dynamic:
        _check_token_budget(f"{prefix}.ppo_max_token_len_per_gpu", section.ppo_max_token_len_per_gpu, config,
                            section.megatron.context_parallel_size)
        _check_interleaved_micro_batches(f"{prefix}.ppo_mini_batch_size * n = {mini_sequences} sequences / dp {dp}",
                                         mini_sequences // dp, f"{prefix}.megatron", section.megatron, dynamic=True)
    else:
        _check_interleaved_micro_batches(f"{prefix}.ppo_micro_batch_size_per_gpu={micro} over a mini-batch of "
                                         f"{mini_sequences} sequences / dp {dp}", mini_sequences // step,
                                         f"{prefix}.megatron", section.megatron)


def _check_token_budget(key: str, budget: int, config: ExperimentConfig, context_parallel_size: int) -> None:
    # Under context parallelism a GPU holds 1/CP of every sequence (verl's Ulysses budget likewise).
    longest = config.data.max_prompt_length + config.data.max_response_length
    if budget * context_parallel_size < longest:
        per_gpu = -(-longest // context_parallel_size)
        split = f", split over context_parallel_size={context_parallel_size}" if context_parallel_size > 1 else ""
        raise ConfigError(
            f"{key}={budget} is smaller than one full sequence, data.max_prompt_length + data.max_response_length = "
            f"{config.data.max_prompt_length} + {config.data.max_response_length} = {longest}{split}; raise it to at "
            f"least {per_gpu} (2-4x is usual)."
        )


def _check_log_prob_batches(prefix: str, section: Any, dynamic: bool, config: ExperimentConfig, dp: int) -> None:
    rows = config.data.train_batch_size * config.actor_rollout_ref.rollout.n // dp
    if dynamic:
        _check_token_budget(f"{prefix}.log_prob_max_token_len_per_gpu", section.log_prob_max_token_len_per_gpu, config,
                            config.actor_rollout_ref.actor.megatron.context_parallel_size)
        _check_interleaved_micro_batches(f"the {prefix} log-prob pass over data.train_batch_size * n / dp", rows,
                                         f"{ACTOR}.megatron", config.actor_rollout_ref.actor.megatron, dynamic=True)
        return
    micro = section.log_prob_micro_batch_size_per_gpu
    if micro is None:
        raise ConfigError(
            f"{prefix}.log_prob_micro_batch_size_per_gpu is not set (it defaults to "
            f"{ACTOR}.ppo_micro_batch_size_per_gpu); set either, or {ACTOR}.use_dynamic_bsz=true."
        )
    _check_interleaved_micro_batches(f"{prefix}.log_prob_micro_batch_size_per_gpu={micro} over {rows} sequences "
                                     "per rank", math.ceil(rows / micro), f"{ACTOR}.megatron",
                                     config.actor_rollout_ref.actor.megatron)


def _check_actor_batches(config: ExperimentConfig, actor_dp: int) -> None:
    arr = config.actor_rollout_ref
    dynamic = arr.actor.use_dynamic_bsz
    _check_ppo_batches(ACTOR, arr.actor, actor_dp, dynamic, config)
    _check_log_prob_batches(ROLLOUT, arr.rollout, dynamic, config, actor_dp)
    if config.built_models().kl_reference:
        _check_log_prob_batches("actor_rollout_ref.ref", arr.ref, dynamic, config, actor_dp)


def _check_critic_layout(config: ExperimentConfig) -> None:
    actor, critic = config.actor_rollout_ref.actor.megatron, config.critic.megatron
    if critic.as_layout() != actor.as_layout():
        raise ConfigError(
            f"critic.megatron's layout {critic.describe()} differs from the actor's {actor.describe()}: actor, "
            f"reference and critic train on one mesh today, so leave the critic's parallel sizes at their defaults "
            f"(the actor's) or set them equal."
        )


def _check_critic_batches(config: ExperimentConfig, critic_dp: int) -> None:
    # (The value pass cuts the whole batch with the update's micro-batch size: whole mini-batches of
    # whole micro-batches, so the update's checks cover it.)
    _check_ppo_batches("critic", config.critic, critic_dp, config.critic.use_dynamic_bsz, config)


# ----------------------------------------------------------------------------- rewards


def _check_reward_sources(config: ExperimentConfig) -> None:
    """The reward model and the judge: switched on with what they need, one mesh, sane numbers."""
    import re

    reward, combine, judge = config.reward_model, config.reward_model.combine, config.reward_model.judge
    if combine.rule_weight == 0 and not reward.enable and not judge.enable:
        raise ConfigError("reward_model.combine.rule_weight=0 with neither reward_model.enable nor "
                          "reward_model.judge.enable leaves no reward to train on; set one of them.")
    for name in ("model_score_clip", "reward_clip"):
        value = getattr(combine, name)
        _require(value is None or value > 0, f"reward_model.combine.{name}", value, "> 0 or null (no clip)")
    if reward.enable:
        if not reward.model.path:
            raise ConfigError("reward_model.enable=true needs reward_model.model.path: the HF folder of a "
                              "*ForSequenceClassification reward model.")
        _check_reward_model_folder(reward.model.path)
        layout, actor = reward.megatron, config.actor_rollout_ref.actor.megatron
        if layout.as_layout() != actor.as_layout():
            raise ConfigError(
                f"reward_model.megatron's layout {layout.describe()} differs from the actor's {actor.describe()}: "
                f"the reward model runs on the actor's mesh, so leave its parallel sizes at their defaults (the "
                f"actor's) or set them equal.")
        _check_positive(reward, "reward_model", ("forward_max_token_len_per_gpu",))
        _check_positive(reward, "reward_model", ("micro_batch_size_per_gpu",), allow_none=True)
        if not reward.use_dynamic_bsz and reward.micro_batch_size_per_gpu is None:
            raise ConfigError("reward_model.micro_batch_size_per_gpu is not set: set it (sequences per forward on "
                              "one rank) or reward_model.use_dynamic_bsz=true.")
    if judge.enable:
        if not judge.url and not judge.model.path:
            raise ConfigError("reward_model.judge.enable=true needs reward_model.judge.url (an OpenAI-compatible "
                              "endpoint) or reward_model.judge.model.path (Trident then starts an SGLang server).")
        if judge.model.path and not judge.url and not Path(judge.model.path, "config.json").is_file():
            raise ConfigError(f"reward_model.judge.model.path={judge.model.path!r} has no config.json.")
        try:
            re.compile(judge.score_pattern)
        except re.error as error:
            raise ConfigError(f"reward_model.judge.score_pattern={judge.score_pattern!r} is not a regular "
                              f"expression: {error}.") from None
        if "{response}" not in judge.prompt_template:
            raise ConfigError("reward_model.judge.prompt_template must contain {response} (and usually {prompt}).")
        _require(judge.max_score > 0, "reward_model.judge.max_score", judge.max_score, "> 0")
        _check_positive(judge, "reward_model.judge", ("max_tokens", "max_concurrency"))
        _check_positive(judge.model, "reward_model.judge.model", ("tensor_model_parallel_size",))
        _require(judge.timeout_s > 0, "reward_model.judge.timeout_s", judge.timeout_s, "> 0 seconds")
        _require(judge.model.startup_timeout_s > 0, "reward_model.judge.model.startup_timeout_s",
                 judge.model.startup_timeout_s, "> 0 seconds")
        _require(judge.max_retries >= 0, "reward_model.judge.max_retries", judge.max_retries, ">= 0")
        _require(0 < judge.model.gpu_memory_utilization <= 1, "reward_model.judge.model.gpu_memory_utilization",
                 judge.model.gpu_memory_utilization, "in (0, 1]")


def _check_dapo(config: ExperimentConfig) -> None:
    """Dynamic sampling and overlong shaping: numbers in range, combinations that are built."""
    filtering, overlong = config.algorithm.filter_groups, config.reward_model.overlong_buffer
    if overlong.enable:
        limit = config.data.max_response_length
        _require(0 < overlong.len <= limit, "reward_model.overlong_buffer.len", overlong.len,
                 f"in [1, data.max_response_length={limit}] (the tokens before the limit that are penalised)")
        _require(overlong.penalty_factor >= 0, "reward_model.overlong_buffer.penalty_factor", overlong.penalty_factor,
                 ">= 0 (the penalty at the length limit)")
    _require(filtering.max_num_gen_batches >= 0, "algorithm.filter_groups.max_num_gen_batches",
             filtering.max_num_gen_batches, ">= 0 (0: no limit)")
    if not filtering.enable:
        return
    key, rollout = "algorithm.filter_groups.enable", config.actor_rollout_ref.rollout
    _require(rollout.n >= 2, f"{ROLLOUT}.n", rollout.n,
             f">= 2 with {key}=true: a group of one response never has a spread, so every group would be dropped")
    _require(not config.algorithm.uses_greedy_baseline, key, True,
             "false with algorithm.adv_estimator=remax (dynamic sampling with its greedy baselines is not built)")
    _require(not (config.reward_model.enable and rollout.mode == "colocated"), key, True,
             f"false with reward_model.enable=true and {ROLLOUT}.mode=colocated: the rounds of generation keep the "
             f"engine's memory resident, and the reward model's forward would peak with it (not built; use "
             f"{ROLLOUT}.mode=disaggregated, or rule and judge rewards)")


def _check_reward_model_folder(path: str) -> None:
    """A local reward model folder must hold a one-label sequence classifier (a remote path is
    checked when it is loaded)."""
    config_file = Path(path, "config.json")
    if not config_file.is_file():
        if Path(path).exists():
            raise ConfigError(f"reward_model.model.path={path!r} has no config.json.")
        return
    hf = json.loads(config_file.read_text())
    architectures = hf.get("architectures") or []
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ConfigError(f"reward_model.model.path={path!r} is a {architectures or 'model without architectures'}, "
                          f"not a *ForSequenceClassification reward model (a causal LM has no score head).")
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if labels != 1:
        raise ConfigError(f"reward_model.model.path={path!r} has {labels} labels; a reward model scores with one "
                          f"(num_labels=1).")
