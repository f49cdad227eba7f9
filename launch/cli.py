"""The ``trident`` command: check an experiment in this process, then run it under torchrun.

    trident yaml/X.yaml [key=value ...] [--check] [--nproc-per-node N] [--max-restarts N]
            [--nnodes N --node-rank R --rdzv-endpoint HOST:PORT --rdzv-id ID]

(``python -m launch.cli`` is the same.) Before any rank starts, it loads the config and checks every
input it names (``engine.trainer.preflight``: model folders, tokenizer, reward function, every
prompt row): a mistake is one message and exit status 2, and nothing has been started. ``--check``
stops there. Otherwise it runs ``launch.main`` on ``trainer.n_gpus_per_node`` ranks per node (the
options override the launch, which the config must then match) through torchrun's own agent,
in this process, with ranks forked from a process that has imported what they import
(``launch.torchrun``): a rank's error message is printed once, however many ranks hit it, and a rank
that died without one (killed, out of memory) is named with its exit code and its log file,
without torchrun's stack dump.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from launch.main import ERROR_DIR_ENV, EXIT_USER_ERROR, user_errors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trident", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("yaml_path", help="experiment file, e.g. yaml/demo_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument("--check", action="store_true", help="check the config and its inputs, start nothing")
    parser.add_argument("--nproc-per-node", type=int, help="ranks on this node (default trainer.n_gpus_per_node)")
    parser.add_argument("--nnodes", type=int, help="nodes in the job (default trainer.nnodes)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (with --rdzv-endpoint)")
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (several nodes)")
    parser.add_argument("--rdzv-id", default="trident", help="rendezvous id shared by the job's nodes")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="restart the job up to N times when a rank fails; it resumes from the newest checkpoint")
    args = parser.parse_intermixed_args(argv)
    if args.max_restarts < 0:
        print(f"[trident] error: --max-restarts must be >= 0, got {args.max_restarts}", file=sys.stderr)
        return EXIT_USER_ERROR

    from engine.config import load_config
    from engine.trainer.preflight import check_inputs

    try:
        cfg = load_config(args.yaml_path, args.overrides)
        prepare_demo_models(cfg)
        check_inputs(cfg, data=True)
    except user_errors() as error:
        print(f"[trident] error: {error}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    if args.check:
        print(f"[trident] {args.yaml_path}: the config, model, tokenizer, reward function and prompt files are "
              "usable", flush=True)
        return 0
    return launch(args, logs_dir=Path(cfg.trainer.default_local_dir) / "logs",
                  nnodes=args.nnodes or cfg.trainer.nnodes, nproc=args.nproc_per_node or cfg.trainer.n_gpus_per_node)


def prepare_demo_models(cfg) -> None:
    """The demo experiments' models are ours to build (``yaml/demo_cpu.yaml``, ``yaml/demo_tools_cpu.yaml``):
    the folder the actor reads, if it is one of them, is built now when missing or stale (its recipe
    hash), and reused at once otherwise."""
    from launch import prepare_demo_model, prepare_demo_tools_model

    builders = {prepare_demo_model.DEFAULT_DIR: (prepare_demo_model.prepare_demo_model, prepare_demo_model.RECIPE_FILE),
                prepare_demo_tools_model.DEFAULT_DIR: (prepare_demo_tools_model.prepare_demo_tools_model,
                                                       prepare_demo_tools_model.RECIPE_FILE)}
    folder = Path(cfg.actor_rollout_ref.model.path).resolve()
    if folder not in builders:
        return
    build, recipe_file = builders[folder]
    if not (folder / recipe_file).exists():
        print(f"[trident] building the demo model {cfg.actor_rollout_ref.model.path} (once, a few minutes)", flush=True)
    build()


def launch(args: argparse.Namespace, *, logs_dir: Path, nnodes: int, nproc: int) -> int:
    """torchrun ``launch.main`` in this process (``launch.torchrun``); returns the job's exit status."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from launch import torchrun

    if nnodes > 1 and not args.rdzv_endpoint:
        print("[trident] error: a job of several nodes needs --rdzv-endpoint HOST:PORT (a host every node reaches)",
              file=sys.stderr)
        return EXIT_USER_ERROR
    rendezvous = (["--standalone"] if nnodes == 1 and not args.rdzv_endpoint else
                  ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id}",
                   f"--node-rank={args.node_rank}"])
    torchrun_args = [f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--max-restarts={args.max_restarts}", *rendezvous,
                     "-m", "launch.main", args.yaml_path, *args.overrides]
    error_dir = tempfile.mkdtemp(prefix="trident-errors-")
    os.environ[ERROR_DIR_ENV] = error_dir
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # torchrun's agent logs each failure and its own stack dump; report_failures says it once, plainly.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.CRITICAL)  # "Terminating process ..."
    try:
        torchrun.run(torchrun_args)
        return 0
    except ChildFailedError as failure:
        return report_failures(failure, Path(error_dir), logs_dir)
    finally:
        shutil.rmtree(error_dir, ignore_errors=True)


def report_failures(failure, error_dir: Path, logs_dir: Path) -> int:
    """Each distinct rank message once, with its ranks; ranks that died without one, with their exit
    code and log. Returns the job's exit status (the first failed rank's)."""
    messages: dict[str, list[int]] = {}
    for file in sorted(error_dir.glob("rank_*.txt")):
        messages.setdefault(file.read_text(), []).append(int(file.stem.split("_")[1]))
    for message, ranks in messages.items():
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        print(f"[trident] error ({where}): {message}", file=sys.stderr, flush=True)
    reported = {rank for ranks in messages.values() for rank in ranks}
    for rank, process in sorted(failure.failures.items()):
        if rank not in reported:
            code = process.exitcode
            how = ("stopped by SIGTERM" if code in (-signal.SIGTERM, 128 + signal.SIGTERM) else
                   f"killed by signal {-code}" if code < 0 else f"failed with exit code {code}")
            # NCCL's watchdog aborts a rank whose collective outlived the timeout (its message is above).
            hint = (" (SIGABRT: a CUDA error, or a collective that outlived trainer.collective_timeout_minutes)"
                    if code in (-signal.SIGABRT, 128 + signal.SIGABRT) else "")
            print(f"[trident] rank {rank} {how}{hint}; its log: {logs_dir / f'rank_{rank:05d}.log'}",
                  file=sys.stderr, flush=True)
    first = failure.get_first_failure()[1].exitcode
    return first if first > 0 else 1


def command() -> NoReturn:
    """The ``trident`` executable: ``main``'s status, without the interpreter's teardown (``exit_now``)."""
    from engine.lifecycle import exit_now

    exit_now(main())


if __name__ == "__main__":
    command()
