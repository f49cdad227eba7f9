"""The SPMD entry point: ``python -m launch.main yaml/X.yaml key=value ...`` on every rank.

torchrun, Slurm (srun + torchrun), the Ray launcher and the ``trident`` command all start this
same program; ranks come from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT). In order, before any process group starts: a reaper for whatever this
rank will start (``engine.lifecycle``), the config checked against the launch, the model,
tokenizer and reward function checked (``engine.trainer.preflight``). A user's mistake, found
then or later (a data row, a checkpoint that does not fit, a reward function that keeps failing),
ends the rank with one message and exit status 2 instead of a traceback; under the ``trident``
command the messages go to the launcher, which prints each once (``TRIDENT_ERROR_DIR``). Once the
config is checked, the rank's output goes to ``<run>/logs/rank_<r>.log`` and only Trident's own
lines reach the terminal (``engine.trainer.console``); an unexpected exception is one line there,
its traceback in that log.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_USER_ERROR = 2
# Set by the trident command: each failing rank writes its message here instead of to stderr.
ERROR_DIR_ENV = "TRIDENT_ERROR_DIR"


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that are the user's to fix (config, inputs, data, checkpoints, the rollout
    servers' start-up, a failing reward function or judge): reported as a message, not a traceback."""
    from engine.config.errors import ConfigError
    from engine.data.schema import PromptSchemaError
    from engine.models.checkpoint import CheckpointError as ModelCheckpointError
    from engine.models.hf_config import UnsupportedModelError
    from engine.rewards.judge import JudgeError
    from engine.rewards.manager import RewardFunctionError
    from engine.rollout.base import RolloutError
    from engine.trainer.checkpoint import CheckpointError
    from parallel.device import DeviceError

    return (ConfigError, PromptSchemaError, ModelCheckpointError, UnsupportedModelError, RewardFunctionError,
            JudgeError, RolloutError, CheckpointError, DeviceError)


def report_error(message: str) -> None:
    """The rank's message: to the trident launcher's folder, or to stderr with the rank named."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    error_dir = os.environ.get(ERROR_DIR_ENV)
    if error_dir:
        Path(error_dir, f"rank_{rank:05d}.txt").write_text(message)
        return
    where = f" (rank {rank})" if world_size > 1 else ""
    from engine.trainer.console import say_error

    say_error(f"[trident] error{where}: {message}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("yaml_path", help="experiment file, e.g. yaml/demo_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)

    from engine.lifecycle import start_reaper, stop_gracefully_on_sigterm

    start_reaper()
    stop_gracefully_on_sigterm()
    try:
        run(args.yaml_path, args.overrides)
    except Exception as error:
        if isinstance(error, user_errors()):
            logging.getLogger(__name__).info("%s: %s", type(error).__name__, error)  # into the rank's log file
            report_error(str(error))
            return EXIT_USER_ERROR
        if is_collective_timeout(error):
            logging.getLogger(__name__).exception("collective timeout")
            report_error("a collective did not complete within trainer.collective_timeout_minutes: another rank is "
                         f"stuck or has died (its log says which), or a phase needs a longer timeout ({error})")
            return 1
        logging.getLogger(__name__).exception("the run failed")  # the traceback, into the rank's log
        from engine.trainer import console

        report_error(f"{type(error).__name__}: {error} (traceback: {console.log_file or 'above'})")
        return 1
    return 0


def is_collective_timeout(error: BaseException) -> bool:
    """gloo's recv/send timeout (a RuntimeError) or NCCL's (a DistBackendError naming Timeout(ms))."""
    return isinstance(error, RuntimeError) and bool(
        re.search(r"Timed out waiting \d+ms|Timeout\(ms\)=\d+", str(error)))


# NCCL settings every rank needs before its first communicator. SGLang sets NCCL_CUMEM_ENABLE=0 for
# itself, and a rank that joins a server's weight-update group with cuMem buffers on can hang or
# crash in the broadcast: slime sets it for every training actor (slime/ray/actor_group.py:65-67),
# verl for every worker (verl/trainer/constants_ppo.py:27-31). A user's own value is kept, as slime does.
RANK_NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0"}


def run(yaml_path: str, overrides: Sequence[str]) -> None:
    from engine.config import load_config
    from engine.config.validation import check_launch
    from engine.trainer.preflight import check_inputs
    from parallel.device import decide

    for name, value in RANK_NCCL_ENV.items():
        os.environ.setdefault(name, value)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(yaml_path, overrides, world_size)
    decide(cfg.trainer.device)  # before anything asks CUDA; the start banner prints it
    check_launch(cfg, world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    check_inputs(cfg, data=False)  # the prompt files are read and checked while the components are built
    from engine.trainer.console import capture_output
    from engine.trainer.run_dir import RunDirectory

    # From here on megatron, SGLang, Ray and their children write to the rank's log, not the terminal.
    rank = int(os.environ.get("RANK", "0"))
    capture_output(RunDirectory.create(cfg.trainer.default_local_dir).rank_log_file(rank), rank)
    preloaded = sys.modules.get("launch.rank_imports")  # imported before this rank was forked (launch.torchrun)
    if preloaded is not None:
        sys.stderr.write(preloaded.import_output)

    from engine.trainer.ppo_trainer import run_ppo
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(cfg.actor_rollout_ref.actor.megatron, seed=cfg.trainer.seed,
                              timeout_minutes=cfg.trainer.collective_timeout_minutes)
    try:
        run_ppo(cfg)
    finally:
        destroy_model_parallel()


if __name__ == "__main__":  # dist-checkpointing's spawn Manager re-imports this module
    sys.exit(main())
