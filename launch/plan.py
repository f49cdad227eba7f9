"""Check a layout before launching it: config validation, per-phase GPU memory, HybridEngine sync.

    python -m launch.plan yaml/X.yaml [--nodes N] [--gpus-per-node G] [--gpu h100-80gb | --gpu-mem GIB]
        [--reserve-gib 3] [--cuda-graph-gib 1] [--json | --markdown] [key=value ...]

Loads the experiment with ``engine.config.load_config`` at the world size N x G (default:
``trainer.nnodes`` x ``trainer.n_gpus_per_node``), reads the model's architecture, and estimates the
peak memory of the fullest GPU in every phase of a PPO step (launch.memory_model; the formulas and
their checks are in docs/planner.md). Exit status: 0 the plan fits, 1 a phase does not fit (the
message names it and by how much), 2 the config or the model is invalid.

The architecture comes from ``<model.path>/config.json`` when that file exists; otherwise from
``KNOWN_ARCHITECTURES`` (the published config.json values of common checkpoints), looked up by
the folder's name, so a plan can be made on a machine that does not hold the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Sequence

from engine.config import ConfigError, ExperimentConfig, MegatronConfig, load_config
from engine.models.hf_config import ModelArchitecture, UnsupportedModelError, architecture_from_hf
from launch.memory_model import (
    GIB,
    MemoryPlan,
    ModelMemoryConfig,
    OffloadPolicy,
    RolloutMemoryConfig,
    estimate_memory,
    full_model_parameters,
)

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# What each GPU kind has, as ``nvidia-smi --query-gpu=memory.total`` reports it (MiB).
GPU_KINDS_MIB = {"h100-80gb": 81559, "h200": 143771, "a100-80gb": 81920}
DEFAULT_GPU = "h100-80gb"
# One process's CUDA context on the GPU (the trainer's; the colocated engine's, which stays while it
# is released): ~0.5 GiB with torch 2.x's lazy module loading; an estimate, not measured here.
CUDA_CONTEXT_GIB = 0.5
# SGLang's CUDA graphs of the decode batch sizes, captured beside its pool and released with it
# (SGLANG_MEMORY_SAVER_CUDA_GRAPH): an estimate, not measured here.
DEFAULT_CUDA_GRAPH_GIB = 1.0
# NCCL communicator buffers of the TP/PP/DP/CP groups (~1-2 GiB) and the caching allocator's
# fragmentation: memory no formula here counts.
DEFAULT_RESERVE_GIB = 3.0
# megatron DDP in engine.roles.optim keeps gradients in fp32 (grad_reduce_in_fp32=True).
GRAD_DTYPE_BYTES = 4

_LLAMA3_70B = dict(
    model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
    rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False, hidden_act="silu",
)
_LLAMA3_8B = dict(_LLAMA3_70B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
_LLAMA31_SCALING = dict(
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192),
    max_position_embeddings=131072,
)
_QWEN25_72B = dict(
    model_type="qwen2", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
    num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, rope_theta=1000000.0,
    rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
    use_sliding_window=False,
)
_QWEN25_7B = dict(_QWEN25_72B, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4)
_QWEN25_05B = dict(_QWEN25_72B, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
_QWEN3_8B = dict(
    model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
    max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    use_sliding_window=False,
)
_QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936, rope_theta=1000000.0,
    rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=False, hidden_act="silu",
    attention_bias=False, use_sliding_window=False,
)
_MIXTRAL_8X7B = dict(
    model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, rope_theta=1000000.0,
    rms_norm_eps=1e-5, max_position_embeddings=32768, tie_word_embeddings=False, hidden_act="silu",
    sliding_window=None, router_jitter_noise=0.0,
)
_SMOLLM2_135M = dict(
    model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="silu",
)

# The config.json fields (as published on the Hugging Face hub) of checkpoints we plan for, keyed
# by the lower-cased folder name a user gives in model.path.
KNOWN_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "meta-llama-3-70b": _LLAMA3_70B,
    "meta-llama-3-70b-instruct": _LLAMA3_70B,
    "llama-3.1-70b": dict(_LLAMA3_70B, **_LLAMA31_SCALING),
    "llama-3.1-70b-instruct": dict(_LLAMA3_70B, **_LLAMA31_SCALING),
    "meta-llama-3-8b": _LLAMA3_8B,
    "meta-llama-3-8b-instruct": _LLAMA3_8B,
    "qwen2.5-72b": _QWEN25_72B,
    "qwen2.5-72b-instruct": _QWEN25_72B,
    "qwen2.5-7b": _QWEN25_7B,
    "qwen2.5-7b-instruct": _QWEN25_7B,
    "qwen2.5-0.5b": _QWEN25_05B,
    "qwen2.5-0.5b-instruct": _QWEN25_05B,
    "qwen3-8b": _QWEN3_8B,
    "qwen3-8b-base": _QWEN3_8B,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "qwen3-30b-a3b-base": _QWEN3_30B_A3B,
    "mixtral-8x7b-v0.1": _MIXTRAL_8X7B,
    "mixtral-8x7b-instruct-v0.1": _MIXTRAL_8X7B,
    "smollm2-135m-instruct": _SMOLLM2_135M,
}


class PlanError(ValueError):
    """The model cannot be planned for (unknown architecture, unsplittable layout)."""


def resolve_architecture(model_path: str, path_key: str) -> tuple[ModelArchitecture, str]:
    """The model's architecture and where it came from (its config.json or the known table)."""
    folder = Path(model_path)
    try:
        if (folder / "config.json").is_file():
            return architecture_from_hf(folder), str(folder / "config.json")
        known = KNOWN_ARCHITECTURES.get(folder.name.lower())
        if known is None:
            raise PlanError(
                f"{path_key}={model_path}: no config.json there and {folder.name!r} is not a known architecture "
                f"(known: {', '.join(sorted(KNOWN_ARCHITECTURES))}); point {path_key} at a folder with the "
                "model's config.json (the weights are not needed)"
            )
        return architecture_from_hf(SimpleNamespace(**known)), f"known architecture {folder.name.lower()!r}"
    except UnsupportedModelError as err:
        raise PlanError(f"{path_key}={model_path}: {err}") from None


@dataclass
class PlanReport:
    """Everything ``python -m launch.plan`` prints."""

    yaml_path: str
    nodes: int
    gpus_per_node: int
    gpu_memory_gib: float
    world_size: int
    architecture_source: str
    parameters: int
    models: list[ModelMemoryConfig]
    rollout: RolloutMemoryConfig
    memory: MemoryPlan
    # Bytes one GPU receives in one weight sync, by sync mode (the most over the GPUs, replayed by
    # the HybridEngine's own plan): "full" (whole HF tensors on every generation rank), "sharded"
    # (each its SGLang shard; where the sharded loader covers the model), "adapters" (LoRA with
    # lora_sync=adapters: the PEFT adapters), "broadcast" (servers of their own: the whole model).
    sync_bytes_by_mode: dict[str, int]
    # The mode the loop runs with this config.
    loop_sync_mode: str

    @property
    def loop_sync_received_bytes(self) -> int:
        return self.sync_bytes_by_mode[self.loop_sync_mode]

    @property
    def fits(self) -> bool:
        return self.memory.fits


def _sequence_length(config: ExperimentConfig) -> int:
    return config.data.max_prompt_length + config.data.max_response_length


def _tokens(dynamic: bool, budget: int, micro_batch: int | None, config: ExperimentConfig, context_parallel: int) -> int:
    """Tokens of whole sequences in one micro-batch of a GPU (CP splits them): the token budget
    (a GPU's share: x CP), or micro-batch x padded length."""
    return budget * context_parallel if dynamic else micro_batch * _sequence_length(config)


def _num_microbatches(dynamic: bool, budget: int, mini_batch: int, micro_batch: int | None,
                      data_parallel: int, config: ExperimentConfig, context_parallel: int) -> int:
    """Micro-batches per rank per optimizer step (an upper bound with dynamic batching)."""
    sequences = mini_batch * config.actor_rollout_ref.rollout.n // data_parallel
    if dynamic:
        return max(1, math.ceil(sequences * _sequence_length(config) / (budget * context_parallel)))
    return max(1, sequences // micro_batch)


def _layout_and_dp(megatron: MegatronConfig, world: int):
    return megatron, megatron.data_parallel_size(world)


def _check_split(architecture: ModelArchitecture, megatron: MegatronConfig, key: str) -> None:
    try:
        architecture.validate_layout(megatron)
    except UnsupportedModelError as err:
        raise PlanError(f"{key}: {err}") from None


def _offload(megatron) -> OffloadPolicy:
    return OffloadPolicy(megatron.param_offload, megatron.grad_offload, megatron.optimizer_offload)


def _lora(model) -> dict:
    """``ModelMemoryConfig``'s LoRA fields for ``actor_rollout_ref.model``."""
    settings = model.lora_settings(seed=0)
    return {} if settings is None else {"lora_rank": settings.rank, "lora_targets": settings.megatron_layers()}


def memory_inputs(config: ExperimentConfig, world_size: int) -> tuple[list[ModelMemoryConfig], RolloutMemoryConfig, str]:
    """The memory model's view of a validated experiment on ``world_size`` ranks.

    Offload follows the config's ``...megatron.param_offload / grad_offload / optimizer_offload``
    (actor, critic) and ``actor_rollout_ref.ref.megatron.param_offload``: an offloaded part counts
    only in the phases that use it.
    """
    arr = config.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    if rollout.server_addresses:
        raise PlanError("actor_rollout_ref.rollout.server_addresses: servers on nodes of their own are not planned "
                        "(plan them with rollout.num_gpus on the trainer's node, the same per-GPU figures)")
    training_world = world_size  # the trainer's ranks (servers of their own come on top)
    architecture, source = resolve_architecture(arr.model.path, "actor_rollout_ref.model.path")
    _check_split(architecture, actor.megatron, "actor_rollout_ref.actor.megatron")
    actor_layout, actor_dp = _layout_and_dp(actor.megatron, training_world)
    actor_cp = actor_layout.context_parallel_size
    seq_len = _sequence_length(config)
    param_bytes = DTYPE_BYTES[actor.megatron.param_dtype]
    models = [
        ModelMemoryConfig(
            role="actor", architecture=architecture, layout=actor_layout, data_parallel_size=actor_dp,
            trainable=True, params_dtype_bytes=param_bytes, grad_dtype_bytes=max(param_bytes, GRAD_DTYPE_BYTES),
            use_distributed_optimizer=actor.megatron.use_distributed_optimizer,
            recompute_granularity="full" if arr.model.enable_gradient_checkpointing else None,
            train_tokens_per_microbatch=_tokens(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu,
                                                actor.ppo_micro_batch_size_per_gpu, config, actor_cp),
            forward_tokens_per_microbatch=_tokens(actor.use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu,
                                                  rollout.log_prob_micro_batch_size_per_gpu, config, actor_cp),
            sequence_length=seq_len,
            num_microbatches=_num_microbatches(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu,
                                               actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu,
                                               actor_dp, config, actor_cp),
            offload=_offload(actor.megatron),
            **_lora(arr.model),
        )
    ]
    # With LoRA the reference is the actor with its adapters off: no model of its own.
    if config.built_models().reference:
        models.append(ModelMemoryConfig(
            role="reference", architecture=architecture, layout=actor_layout, data_parallel_size=actor_dp,
            trainable=False, params_dtype_bytes=param_bytes,
            forward_tokens_per_microbatch=_tokens(actor.use_dynamic_bsz, arr.ref.log_prob_max_token_len_per_gpu,
                                                  arr.ref.log_prob_micro_batch_size_per_gpu, config, actor_cp),
            sequence_length=seq_len, offload=OffloadPolicy(param_offload=arr.ref.megatron.param_offload),
        ))
    if config.built_models().critic:
        critic = config.critic
        critic_architecture, _ = resolve_architecture(critic.model.path, "critic.model.path")
        _check_split(critic_architecture, critic.megatron, "critic.megatron")
        critic_layout, critic_dp = _layout_and_dp(critic.megatron, training_world)
        critic_bytes = DTYPE_BYTES[critic.megatron.param_dtype]
        critic_cp = critic_layout.context_parallel_size
        critic_tokens = _tokens(critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu,
                                critic.ppo_micro_batch_size_per_gpu, config, critic_cp)
        models.append(ModelMemoryConfig(
            role="critic", architecture=critic_architecture, layout=critic_layout, data_parallel_size=critic_dp,
            trainable=True, value_head=True, params_dtype_bytes=critic_bytes,
            grad_dtype_bytes=max(critic_bytes, GRAD_DTYPE_BYTES),
            use_distributed_optimizer=critic.megatron.use_distributed_optimizer,
            recompute_granularity="full" if critic.model.enable_gradient_checkpointing else None,
            train_tokens_per_microbatch=critic_tokens, forward_tokens_per_microbatch=critic_tokens,
            sequence_length=seq_len,
            num_microbatches=_num_microbatches(critic.use_dynamic_bsz, critic.ppo_max_token_len_per_gpu,
                                               critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu,
                                               critic_dp, config, critic_cp),
            offload=_offload(critic.megatron),
        ))
    rollout_config = RolloutMemoryConfig(
        tensor_model_parallel_size=rollout.tensor_model_parallel_size,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        sequences_per_step=config.data.train_batch_size * rollout.n,
        sequence_length=seq_len,
        weight_dtype_bytes=DTYPE_BYTES[rollout.dtype],
        kv_cache_dtype_bytes=DTYPE_BYTES[rollout.dtype],
        update_weights_bucket_megabytes=rollout.update_weights_bucket_megabytes,
        # The torch engine is HF generate inside each trainer process: one full copy per rank and
        # a KV cache for that rank's prompts, no memory fraction of its own.
        in_process=rollout.name == "torch",
        server_gpus=rollout.num_gpus if rollout.mode == "disaggregated" else 0,
        batches_in_flight=max(1, config.trainer.max_staleness),
    )
    return models, rollout_config, source


def make_plan(
    yaml_path: str,
    overrides: Sequence[str] = (),
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    gpu_memory_gib: float | None = None,
    reserve_gib: float = DEFAULT_RESERVE_GIB,
    gpu: str = DEFAULT_GPU,
    cuda_graph_gib: float = DEFAULT_CUDA_GRAPH_GIB,
) -> PlanReport:
    """Validate the experiment at nodes x gpus_per_node ranks and estimate its memory on GPUs of
    kind ``gpu`` (``GPU_KINDS_MIB``), or of ``gpu_memory_gib`` GiB when given.

    Raises ConfigError (invalid config) or PlanError (the model cannot be planned for).
    """
    if gpu_memory_gib is None:
        if gpu not in GPU_KINDS_MIB:
            raise PlanError(f"--gpu {gpu!r}: known kinds are {', '.join(GPU_KINDS_MIB)} (or give --gpu-mem GIB)")
        gpu_memory_gib = GPU_KINDS_MIB[gpu] / 1024
    cluster = [f"trainer.nnodes={nodes}"] if nodes is not None else []
    cluster += [f"trainer.n_gpus_per_node={gpus_per_node}"] if gpus_per_node is not None else []
    config = load_config(yaml_path, [*cluster, *overrides])
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    models, rollout, source = memory_inputs(config, world)
    memory = estimate_memory(models, rollout, world, gpu_memory_gib * GIB, reserve_gib * GIB,
                             context_bytes=CUDA_CONTEXT_GIB * GIB, cuda_graph_bytes=cuda_graph_gib * GIB)
    return PlanReport(
        yaml_path=str(yaml_path), nodes=config.trainer.nnodes, gpus_per_node=config.trainer.n_gpus_per_node,
        gpu_memory_gib=gpu_memory_gib, world_size=world, architecture_source=source,
        parameters=full_model_parameters(models[0].architecture), models=models, rollout=rollout, memory=memory,
        **weight_sync_modes(config, models[0], world, int(memory.sync.model_bytes)),
    )


def weight_sync_modes(config: ExperimentConfig, actor: ModelMemoryConfig, world_size: int, model_bytes: int) -> dict:
    """``sync_bytes_by_mode`` and ``loop_sync_mode`` of a PlanReport (see there)."""
    from engine.sync.weight_sync import presharded_refusal

    rollout, architecture = config.actor_rollout_ref.rollout, actor.architecture
    if rollout.mode == "disaggregated":  # every server GPU receives every tensor of the broadcast
        return {"sync_bytes_by_mode": {"broadcast": model_bytes}, "loop_sync_mode": "broadcast"}
    tg = rollout.tensor_model_parallel_size
    modes = {"full": max(weight_sync_received_bytes(architecture, actor.layout, world_size, tg, rollout.dtype).values())}
    loop = "full"
    if rollout.name == "sglang" and presharded_refusal(architecture, actor.layout.tensor_model_parallel_size, tg) is None:
        modes["sharded"] = max(weight_sync_received_bytes(architecture, actor.layout, world_size, tg, rollout.dtype,
                                                          sharded=True).values())
        loop = "sharded" if rollout.weight_sync_target == "sharded" else loop
    lora = config.actor_rollout_ref.model.lora_settings(config.trainer.seed)
    if lora is not None and rollout.name in ("sglang", "torch"):
        import torch

        modes["adapters"] = lora.peft_elements(architecture) * torch.empty((), dtype=getattr(torch, rollout.dtype)).element_size()
        loop = "adapters" if rollout.lora_sync == "adapters" else loop
    return {"sync_bytes_by_mode": modes, "loop_sync_mode": loop}


def weight_sync_received_bytes(architecture: ModelArchitecture, layout, world_size: int, generation_tp: int,
                               dtype: str, *, sharded: bool = False) -> dict[int, int]:
    """Bytes GPUs receive in one weight sync, by rank: the HybridEngine's own plan
    (``ReshardPlan.traffic``) for the whole tensors every colocated generation rank gets, or with
    ``sharded`` for each rank's SGLang shard (SGLang's vocab padding), in the engine's ``dtype``.
    GPUs differ by pipeline stage and expert rank only, so one of each is replayed (the first rank
    of each); with ``sharded`` also by TP rank (every rank of the first model-parallel group)."""
    import torch

    from engine.rollout.sglang_presharded import vocab_rows
    from engine.sync.specs import parameter_specs
    from parallel.hybrid_engine import GenerationLayout, HybridLayout, ReshardPlan, ReshardTarget, TrainingLayout

    training = TrainingLayout.from_parallel_layout(layout, world_size)
    specs = parameter_specs(architecture, training, transformer_engine=True, generation_vocab_rows=(
        vocab_rows(architecture.vocab_size, generation_tp) if sharded else None))
    plan = ReshardPlan(HybridLayout(training, GenerationLayout(generation_tp)), specs,
                       ReshardTarget.SHARDED if sharded else ReshardTarget.FULL, getattr(torch, dtype))
    if sharded:
        return {rank: plan.traffic(rank).received for rank in plan.template_ranks()}
    representatives: dict[tuple[int, int], int] = {}
    for rank in range(world_size):
        coordinates = training.coordinates(rank)
        representatives.setdefault((coordinates.pipeline, coordinates.expert), rank)
    return {rank: plan.traffic(rank).received for rank in representatives.values()}


# ----------------------------------------------------------------------------- output


def _layout_text(model: ModelMemoryConfig) -> str:
    layout = model.layout
    extras = []
    if model.trainable:
        extras.append("dist-opt" if model.use_distributed_optimizer else "replicated optimizer")
    extras.append({2: "bf16", 4: "fp32"}.get(model.params_dtype_bytes, f"{model.params_dtype_bytes}B"))
    if model.recompute_granularity:
        extras.append(f"recompute={model.recompute_granularity}")
    tokens = model.train_tokens_per_microbatch if model.trainable else model.forward_tokens_per_microbatch
    cp = layout.context_parallel_size
    extras.append(f"{tokens} tokens/micro-batch" + (f", {tokens // cp} per GPU" if cp > 1 else ""))
    return f"{layout.describe(model.data_parallel_size)} ({', '.join(extras)})"


def summary_lines(report: PlanReport) -> list[str]:
    memory, rollout, sync = report.memory, report.rollout, report.memory.sync
    lines = [
        f"{report.yaml_path}: {report.nodes} node(s) x {report.gpus_per_node} GPUs = {report.world_size} ranks, "
        f"{report.gpu_memory_gib:.1f} GiB per GPU",
        f"model: {report.parameters / 1e9:.2f} B parameters ({report.architecture_source})",
    ]
    lines += [f"{model.role}: {_layout_text(model)}" for model in report.models]
    replicas = rollout.replicas(report.world_size)
    lines.append(
        f"rollout: TP{rollout.tensor_model_parallel_size}, {replicas} replica(s), "
        + ("in-process engine" if rollout.in_process else f"gpu_memory_utilization {rollout.gpu_memory_utilization:g}")
        + (f", disaggregated on {rollout.server_gpus} GPUs of their own (column 'server'), "
           f"{rollout.batches_in_flight} batch(es) in flight" if rollout.disaggregated else ", colocated")
    )
    lines.append(
        f"KV cache: {memory.kv_cache_bytes_per_token / 1024:.1f} KiB/token/GPU, {memory.kv_cache_bytes / GIB:.1f} GiB "
        f"-> {memory.max_concurrent_sequences} concurrent {rollout.sequence_length}-token sequences per replica "
        f"for {memory.sequences_per_replica} " + ("in flight" if rollout.disaggregated else "per step")
        + (f" ({math.ceil(memory.sequences_per_replica / memory.max_concurrent_sequences)} waves)"
           if 0 < memory.max_concurrent_sequences < memory.sequences_per_replica else "")
    )
    if rollout.disaggregated:
        lines.append(f"weight sync: every server GPU receives the whole model, {report.loop_sync_received_bytes / GIB:.2f} "
                     f"GiB per step, broadcast in buckets of {sync.bucket_bytes / 2**20:g} MiB")
        return lines
    described = {"full": "whole tensors on every generation rank", "sharded": "each rank its SGLang shard",
                 "adapters": "the LoRA adapters only"}
    modes = "; ".join(f"{mode} {received / GIB:.2f} GiB ({described[mode]})" + (" <- the loop" if mode == report.loop_sync_mode else "")
                      for mode, received in report.sync_bytes_by_mode.items())
    lines.append(
        f"weight sync per GPU: {modes}; HybridFlow's bound {sync.received_bytes / GIB:.2f} GiB, gather-all "
        f"{sync.gather_all_bytes / GIB:.1f} GiB; {sync.engine_shard_bytes / GIB:.2f} GiB engine shard in "
        f"{sync.buckets} bucket(s) of {sync.bucket_bytes / 2**20:g} MiB; model {sync.model_bytes / GIB:.1f} GiB"
    )
    return lines


def _item_names(report: PlanReport) -> list[str]:
    names: list[str] = []
    for phase in report.memory.phases:
        names += [name for name in phase.items if name not in names]
    # Roles in the order the models are listed, the rollout engine after them, the reserve last.
    roles = [model.role for model in report.models] + ["rollout", "cuda_contexts", "reserved"]
    return sorted(names, key=lambda name: (roles.index(name.split("/")[0]), names.index(name)))


def table_text(report: PlanReport) -> str:
    phases = report.memory.phases
    names = _item_names(report)
    width = max(len(name) for name in [*names, "headroom"]) + 2
    column = max(12, *(len(p.phase) + 2 for p in phases))
    rows = ["GiB per GPU".ljust(width) + "".join(p.phase.rjust(column) for p in phases)]
    for name in names:
        rows.append(name.ljust(width) + "".join(
            (f"{p.items[name] / GIB:.1f}" if name in p.items else "-").rjust(column) for p in phases))
    rows.append("total".ljust(width) + "".join(f"{p.total_bytes / GIB:.1f}".rjust(column) for p in phases))
    rows.append("headroom".ljust(width) + "".join(
        f"{(p.capacity_bytes - p.total_bytes) / GIB:.1f}".rjust(column) for p in phases))
    return "\n".join(rows)


def markdown_text(report: PlanReport) -> str:
    phases = report.memory.phases
    lines = ["| GiB per GPU | " + " | ".join(p.phase for p in phases) + " |",
             "|---|" + "---:|" * len(phases)]
    for name in _item_names(report):
        lines.append(f"| {name} | " + " | ".join(
            f"{p.items[name] / GIB:.1f}" if name in p.items else "-" for p in phases) + " |")
    lines.append("| **total** | " + " | ".join(f"**{p.total_bytes / GIB:.1f}**" for p in phases) + " |")
    lines.append("| headroom | " + " | ".join(f"{(p.capacity_bytes - p.total_bytes) / GIB:.1f}" for p in phases) + " |")
    return "\n".join([*(f"- {line}" for line in summary_lines(report)), "", *lines])


def json_dict(report: PlanReport) -> dict[str, Any]:
    memory, sync = report.memory, report.memory.sync
    return {
        "yaml": report.yaml_path, "nodes": report.nodes, "gpus_per_node": report.gpus_per_node,
        "world_size": report.world_size, "gpu_memory_bytes": report.gpu_memory_gib * GIB,
        "architecture_source": report.architecture_source, "parameters": report.parameters,
        "fits": report.fits, "problems": memory.problems,
        "models": {
            model.role: {
                "tensor_model_parallel_size": model.layout.tensor_model_parallel_size,
                "pipeline_model_parallel_size": model.layout.pipeline_model_parallel_size,
                "virtual_pipeline_model_parallel_size": model.layout.virtual_pipeline_model_parallel_size,
                "context_parallel_size": model.layout.context_parallel_size,
                "expert_model_parallel_size": model.layout.expert_model_parallel_size,
                "expert_tensor_parallel_size": model.layout.expert_tensor_size,
                "data_parallel_size": model.data_parallel_size,
                "sequence_parallel": model.layout.uses_sequence_parallel,
                "recompute_granularity": model.recompute_granularity,
            }
            for model in report.models
        },
        "phases": {
            phase.phase: {"items_bytes": phase.items, "total_bytes": phase.total_bytes, "fits": phase.fits,
                          "over_by_bytes": phase.over_by_bytes}
            for phase in memory.phases
        },
        "rollout": {
            "tensor_model_parallel_size": report.rollout.tensor_model_parallel_size,
            "kv_cache_bytes": memory.kv_cache_bytes, "kv_cache_bytes_per_token": memory.kv_cache_bytes_per_token,
            "max_concurrent_sequences": memory.max_concurrent_sequences,
            "sequences_per_replica": memory.sequences_per_replica,
        },
        "weight_sync": {
            "model_bytes": sync.model_bytes, "received_bytes_per_gpu": report.loop_sync_received_bytes,
            "mode": report.loop_sync_mode, "received_bytes_per_gpu_by_mode": report.sync_bytes_by_mode,
            "sharded_bound_bytes_per_gpu": sync.received_bytes, "gather_all_bytes_per_gpu": sync.gather_all_bytes, "engine_shard_bytes": sync.engine_shard_bytes,
            "bucket_bytes": sync.bucket_bytes, "buckets": sync.buckets,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.plan", description="Check a layout and estimate its per-GPU memory before launching.")
    parser.add_argument("experiment", help="the experiment yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, as for launch.main")
    parser.add_argument("--nodes", type=int, default=None, help="nodes (default: trainer.nnodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: trainer.n_gpus_per_node)")
    parser.add_argument("--gpu", default=DEFAULT_GPU, choices=sorted(GPU_KINDS_MIB),
                        help=f"GPU kind, for its memory (default {DEFAULT_GPU})")
    parser.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU, instead of --gpu's")
    parser.add_argument("--reserve-gib", type=float, default=DEFAULT_RESERVE_GIB,
                        help=f"GiB per GPU kept for NCCL buffers and fragmentation (default {DEFAULT_RESERVE_GIB:g})")
    parser.add_argument("--cuda-graph-gib", type=float, default=DEFAULT_CUDA_GRAPH_GIB,
                        help=f"GiB of the engine's CUDA graphs during rollout (default {DEFAULT_CUDA_GRAPH_GIB:g})")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the plan as JSON")
    output.add_argument("--markdown", action="store_true", help="print the plan as a markdown snippet")
    args = parser.parse_intermixed_args(argv)
    try:
        report = make_plan(args.experiment, args.overrides, args.nodes, args.gpus_per_node, args.gpu_mem,
                           args.reserve_gib, gpu=args.gpu, cuda_graph_gib=args.cuda_graph_gib)
    except (ConfigError, PlanError) as err:
        print(f"launch.plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(json_dict(report), indent=2))
    elif args.markdown:
        print(markdown_text(report))
    else:
        print("\n".join(summary_lines(report)))
        print()
        print(table_text(report))
    for problem in report.memory.problems:
        print(f"launch.plan: does not fit: {problem}", file=sys.stderr)
    return 0 if report.fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
