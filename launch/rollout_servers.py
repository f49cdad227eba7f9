"""Start the SGLang servers of a disaggregated job on a node of their own, for trainers elsewhere.

    TRIDENT_ROLLOUT_API_KEY=<key> python -m launch.rollout_servers yaml/X.yaml [key=value ...] \\
        --address-file FILE [--servers K] [--host ADDRESS] [--log-dir DIR]

Starts K servers (default: as many as the node's GPUs hold; one without GPUs) with the experiment's rollout settings (``actor_rollout_ref.rollout``: generation
TP, dtype, memory fraction, timeouts; the model of ``actor_rollout_ref.model.path``), each on the
next ``tensor_model_parallel_size`` GPUs of this node (CPU processes on a machine without GPUs),
listening on ``--host`` (default: this node's address on its default route) and requiring the job's
API key, which comes from the environment and is neither logged nor put on a command line
(``engine.rollout.sglang_launch``). Once every server answers, their ``host:port`` lines go to
``--address-file`` (written whole, at once): the trainers get them as
``actor_rollout_ref.rollout.server_addresses=[...]`` with the same key in their environment.
Then it watches the servers: it exits non-zero when one dies and stops them all on SIGTERM or
Ctrl-C (what Slurm and Ray send at the end of the job).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from launch.main import EXIT_USER_ERROR


def default_host() -> str:
    """This node's address on its default route (what other nodes reach it by)."""
    from parallel.state import address_towards

    return address_towards("192.0.2.1", 9)  # TEST-NET-1: a route lookup only, nothing is sent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("yaml_path", help="the job's experiment file")
    parser.add_argument("overrides", nargs="*", help="the job's dotted.key=value overrides")
    parser.add_argument("--servers", type=int, help="servers on this node (default: as many as its GPUs hold, "
                        "tensor_model_parallel_size each; 1 without GPUs)")
    parser.add_argument("--address-file", type=Path, required=True, help="where the servers' host:port lines go")
    parser.add_argument("--host", help="address to listen on (default: this node's address on its default route)")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: the address file's folder)")
    args = parser.parse_args(argv)

    from engine.config.cli import load_config_or_exit
    from engine.lifecycle import start_reaper, stop_gracefully_on_sigterm
    from engine.rollout.sglang_launch import API_KEY_ENV

    api_key = os.environ.get(API_KEY_ENV)
    if not api_key:
        print(f"launch.rollout_servers: set {API_KEY_ENV} to the job's API key (the trainers get the same one)",
              file=sys.stderr)
        return EXIT_USER_ERROR
    host = args.host or default_host()
    args.address_file.parent.mkdir(parents=True, exist_ok=True)
    # The trainers' view of the same experiment: servers of their own, at addresses not known yet
    # (the port is a stand-in, so the config validates as the trainers will load it).
    cfg = load_config_or_exit(args.yaml_path, [*args.overrides, "actor_rollout_ref.rollout.mode=disaggregated",
                                               "actor_rollout_ref.rollout.num_gpus=0",
                                               f"actor_rollout_ref.rollout.server_addresses=['{host}:1']"])
    from parallel.device import DeviceError, decide

    try:
        print(f"[trident] {decide(cfg.trainer.device).banner()}", flush=True)
    except DeviceError as error:
        print(f"[trident] error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    count = args.servers if args.servers is not None else _servers_per_node(cfg)
    if count < 1:
        parser.error(f"--servers must be >= 1, got {count} (this node's GPUs hold none)")
    start_reaper()
    stop_gracefully_on_sigterm()
    from engine.rollout.base import RolloutError

    try:
        servers = start_servers(cfg, count, host, api_key, args.log_dir or args.address_file.parent)
    except RolloutError as error:
        print(f"[trident] error: {error}", file=sys.stderr, flush=True)
        return 1
    try:
        addresses = [f"{server.config.host}:{server.port}" for server in servers]
        partial = args.address_file.with_name(args.address_file.name + ".partial")
        partial.write_text("".join(f"{address}\n" for address in addresses))
        partial.replace(args.address_file)
        print(f"[trident] {len(servers)} rollout server(s) ready: {', '.join(addresses)} "
              f"(addresses in {args.address_file}; logs in {servers[0].log_path.parent})", flush=True)
        while True:
            for server in servers:
                server.raise_if_crashed(grace_s=0.0)
            time.sleep(2.0)
    except KeyboardInterrupt:
        return 0
    except Exception as error:
        print(f"[trident] error: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        for server in servers:
            server.stop()


def _servers_per_node(cfg) -> int:
    """As many as the node's GPUs hold; one on a machine without GPUs (CPU clusters, tests)."""
    import torch

    if not torch.cuda.is_available():
        return 1
    return torch.cuda.device_count() // cfg.actor_rollout_ref.rollout.tensor_model_parallel_size


def start_servers(cfg, count: int, host: str, api_key: str, log_dir: Path) -> list:
    """``count`` servers of ``cfg``'s rollout on this node, each on its own GPUs (TP of them), ready."""
    import torch

    from engine.rollout.sglang_server import SGLangServer, SGLangServerConfig, feature_args

    rollout, model = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
    tp = rollout.tensor_model_parallel_size
    if torch.cuda.is_available() and count * tp > torch.cuda.device_count():
        raise SystemExit(f"launch.rollout_servers: {count} server(s) x tensor_model_parallel_size={tp} GPUs; "
                         f"this node has {torch.cuda.device_count()}")
    servers = [
        SGLangServer(SGLangServerConfig(
            model_path=model.path, log_path=log_dir / f"sglang_server{i}.log", rollout=rollout, host=host,
            gpu_ids=tuple(range(i * tp, (i + 1) * tp)) if torch.cuda.is_available() else (),
            random_seed=cfg.trainer.seed + i, trust_remote_code=model.trust_remote_code, api_key=api_key,
            extra_args=feature_args(rollout, cfg.actor_rollout_ref.actor.megatron.moe_router_replay)))
        for i in range(count)
    ]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_until_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


if __name__ == "__main__":
    sys.exit(main())
