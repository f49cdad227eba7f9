"""The SPMD entry point: ``python -m launch.main yaml/X.yaml key=value ...`` on every rank.

torchrun, Slurm (srun + torchrun) and the Ray launcher all start this same program; ranks come
from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). The
config is loaded and validated against the world size before any process group starts, so a
mistake is one message and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("yaml_path", help="experiment file, e.g. yaml/demo_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    args = parser.parse_args(argv)

    from engine.config.cli import load_config_or_exit

    cfg = load_config_or_exit(args.yaml_path, args.overrides, int(os.environ.get("WORLD_SIZE", "1")))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from engine.trainer.ppo_trainer import run_ppo
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    megatron = cfg.actor_rollout_ref.actor.megatron
    initialize_model_parallel(megatron.layout(), seed=megatron.seed)
    try:
        run_ppo(cfg)
    finally:
        destroy_model_parallel()


if __name__ == "__main__":  # dist-checkpointing's spawn Manager re-imports this module
    sys.exit(main())
