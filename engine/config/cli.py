"""Config errors as a message and exit status 2, never a traceback; and a config checker.

    python -m engine.config.cli yaml/demo_cpu.yaml [--world-size N] [key=value ...]

prints the resolved config (the YAML the run directory would get) or the error.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from engine.config.errors import ConfigError
from engine.config.experiment import ExperimentConfig
from engine.config.loader import load_config, to_yaml


def load_config_or_exit(
    yaml_path: str | Path, overrides: Sequence[str] = (), world_size: int | None = None
) -> ExperimentConfig:
    """:func:`load_config`, but a :class:`ConfigError` prints its message to stderr and exits with 2."""
    try:
        return load_config(yaml_path, overrides, world_size)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("yaml_path", help="experiment file, e.g. yaml/demo_cpu.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks to check the layouts against (default: trainer.nnodes * n_gpus_per_node)")
    args = parser.parse_args(argv)
    config = load_config_or_exit(args.yaml_path, args.overrides, args.world_size)
    sys.stdout.write(to_yaml(config))


if __name__ == "__main__":
    main()
