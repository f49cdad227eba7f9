"""Where the rollout engine runs (``engine.trainer.rollout.Rollout`` calls these): a colocated
engine per generation replica on its leader rank, started before any training model and left
released; or servers of their own, started by rank 0 on GPUs after the trainer's, or attached to on
nodes of their own (``rollout.server_addresses``)."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from engine.config import ExperimentConfig
from engine.config.errors import ConfigError
from engine.rollout.base import MEMORY_TAGS, RolloutEngine
from engine.rollout.memory import record
from engine.rollout.sglang_launch import API_KEY_ENV
from engine.trainer.console import say
from engine.trainer.loggers import write_prometheus_target
from engine.trainer.run_dir import RunDirectory
from parallel.hybrid_engine import HybridLayout
from parallel.state import address_towards, control_group


def start_disaggregated_servers(cfg: ExperimentConfig, run: RunDirectory, pushes_weights: bool) -> RolloutEngine | None:
    """Rollout servers on devices of their own (``rollout.mode=disaggregated``), collective.

    Rank 0 starts ``num_gpus / tensor_model_parallel_size`` servers on the node's GPUs after the
    trainer's ``LOCAL_WORLD_SIZE`` ones (CPU processes without CUDA) and owns them; the weight
    senders of the other pipeline stages attach to the same servers by address. Weights travel by
    broadcast (``update_weights_from_distributed``), never through shared memory."""
    from engine.rollout.factory import create_rollout_engine

    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    launch = dict(run_dir=str(run.rollout_dir), weight_transport="distributed", random_seed=cfg.trainer.seed,
                  trust_remote_code=model.trust_remote_code,
                  return_routed_experts=cfg.actor_rollout_ref.actor.megatron.moe_router_replay)
    if rollout.server_addresses:
        return _attach_external_servers(cfg, launch, pushes_weights)
    servers = rollout.num_gpus // rollout.tensor_model_parallel_size
    engine, addresses = None, [None]
    if dist.get_rank() == 0:
        engine = create_rollout_engine(rollout, model.path, replica_gpus=_server_gpus(rollout, servers),
                                       extra_server_args=_server_metrics_args(cfg), **launch)
        _register_server_metrics(cfg, run, engine)
        addresses = [[f"{server.config.host}:{server.port}" for server in engine.servers]]
        say(f"[trident] {servers} rollout server(s) of their own: {', '.join(addresses[0])} (logs in {run.rollout_dir})")
    dist.broadcast_object_list(addresses, src=0, group=control_group())
    if pushes_weights and engine is None:
        engine = create_rollout_engine(rollout, model.path, attach_to=tuple(addresses[0]), **launch)
    return engine


def _attach_external_servers(cfg: ExperimentConfig, launch: dict[str, Any], pushes_weights: bool) -> RolloutEngine | None:
    """Servers a launcher started on nodes of their own (``rollout.server_addresses``,
    ``launch.rollout_servers``): rank 0 drives them as its own (generation, weight-update sessions)
    without starting or stopping them; the weight senders of later pipeline stages push into its
    sessions. Every request carries the job's API key; each sender's weight-update group listens on
    this node's address on the route to the servers. ``launch``: the engine settings every
    disaggregated engine shares."""
    from engine.rollout.factory import create_rollout_engine

    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    api_key = os.environ.get(API_KEY_ENV)
    if not api_key:
        raise ConfigError(f"actor_rollout_ref.rollout.server_addresses: the servers require the job's API key in the "
                          f"environment variable {API_KEY_ENV} (the one launch.rollout_servers started them with)")
    if dist.get_rank() != 0 and not pushes_weights:
        return None
    addresses = tuple(str(address) for address in rollout.server_addresses)
    host, port = addresses[0].rsplit(":", 1)
    launch = dict(launch, api_key=api_key, weight_update_master_address=address_towards(host, int(port)))
    if dist.get_rank() != 0:
        return create_rollout_engine(rollout, model.path, attach_to=addresses, **launch)
    engine = create_rollout_engine(rollout, model.path, external_servers=addresses, **launch)
    say(f"[trident] {len(addresses)} rollout server(s) on nodes of their own: {', '.join(addresses)}")
    return engine


def _server_gpus(rollout, servers: int) -> tuple[tuple[int, ...], ...]:
    """Node-local GPUs of each disaggregated server: those after the trainer's ranks on this node."""
    if not torch.cuda.is_available():
        return ((),) * servers
    first = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    tp = rollout.tensor_model_parallel_size
    if first + servers * tp > torch.cuda.device_count():
        raise ValueError(f"actor_rollout_ref.rollout.num_gpus={rollout.num_gpus}: the node has "
                         f"{torch.cuda.device_count()} GPUs and the trainer uses {first} of them")
    return tuple(tuple(range(first + i * tp, first + (i + 1) * tp)) for i in range(servers))


def start_colocated_engine(cfg: ExperimentConfig, run: RunDirectory, layout: HybridLayout) -> RolloutEngine | None:
    """This generation replica's engine on its leader rank (None elsewhere), started before any
    training model and left with all its memory released; collective. The other ranks wait on the
    control group (gloo, ``trainer.collective_timeout_minutes``) while the leaders start servers."""
    engine = None
    if layout.generation_coordinates(dist.get_rank()).tensor == 0:
        engine = _build_engine(cfg, run, layout)
        record("start_engine", engine=cfg.actor_rollout_ref.rollout.name)
        engine.release_memory(MEMORY_TAGS)
        record("release", tags=list(MEMORY_TAGS))
    dist.barrier(group=control_group())
    return engine


def _build_engine(cfg: ExperimentConfig, run: RunDirectory, layout: HybridLayout) -> RolloutEngine:
    """This generation replica's engine, on its leader rank; an SGLang server gets exactly the GPUs
    of the replica's ranks (``HybridLayout.replica_placements``)."""
    from engine.rollout.factory import create_rollout_engine

    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    lora = model.lora_settings(cfg.trainer.seed) if rollout.lora_sync == "adapters" else None
    if rollout.name == "torch":
        return create_rollout_engine(rollout, model.path, trust_remote_code=model.trust_remote_code, lora=lora)
    if rollout.name == "torch-process":
        return create_rollout_engine(rollout, model.path, trust_remote_code=model.trust_remote_code)
    gpus: tuple[int, ...] = ()
    replica = layout.generation_coordinates(dist.get_rank()).replica
    if torch.cuda.is_available():
        gpus = layout.replica_placements(cfg.trainer.n_gpus_per_node)[replica].local_devices
    engine = create_rollout_engine(rollout, model.path, run_dir=str(run.rollout_dir), replica_gpus=(gpus,),
                                   first_replica_index=replica,
                                   random_seed=cfg.trainer.seed + dist.get_rank(),
                                   trust_remote_code=model.trust_remote_code, extra_server_args=_server_metrics_args(cfg),
                                   return_routed_experts=cfg.actor_rollout_ref.actor.megatron.moe_router_replay,
                                   lora=lora)
    _register_server_metrics(cfg, run, engine)
    return engine


def _server_metrics_args(cfg: ExperimentConfig) -> tuple[str, ...]:
    return ("--enable-metrics",) if cfg.trainer.prometheus_port is not None else ()


def _register_server_metrics(cfg: ExperimentConfig, run: RunDirectory, engine) -> None:
    """SGLang's own /metrics (queue, throughput, KV-cache use) beside the trainer's, for Prometheus."""
    if cfg.trainer.prometheus_port is None:
        return
    for server in engine.servers:
        write_prometheus_target(run.prometheus_dir / f"sglang_{server.port}.json", f"{server.config.host}:{server.port}",
                                {"job": "sglang", "project": cfg.trainer.project_name,
                                 "experiment": cfg.trainer.experiment_name})

