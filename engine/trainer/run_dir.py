"""The run directory (``trainer.default_local_dir``): everything one training run writes.

    <default_local_dir>/              runs/<project_name>/<experiment_name> by default
        config.yaml                   the resolved experiment config
        logs/rank_00000.log ...       one log file per rank: everything the rank and its children print
        tensorboard/                  TensorBoard event files
        metrics.jsonl                 one row of metrics per step
        wandb/, mlflow.db             the wandb (offline) run and the MLflow store, when those loggers are on
        prometheus/                   Prometheus file_sd targets: the trainer and the SGLang servers
        profile/                      torch profiler traces (trainer.profile)
        checkpoints/                  see engine.trainer.checkpoint
        rollout/                      rollout-server logs
        hf/<model>/                   HuggingFace exports (the actor at the end of training)

The directory is stable across restarts of the same experiment, so ``resume_mode=auto`` finds the
checkpoints of the previous attempt; ``timestamped=True`` gives every launch its own subfolder
(and therefore no automatic resume).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunDirectory:
    """Paths inside one run directory; ``create()`` makes the folders."""

    root: Path

    @classmethod
    def create(cls, default_local_dir: str | Path, *, timestamped: bool = False) -> "RunDirectory":
        """Make (or reuse) the run directory. Safe to call on every rank at once."""
        root = Path(default_local_dir).expanduser().absolute()
        if timestamped:
            root = root / time.strftime("%Y%m%d-%H%M%S")
        run = cls(root)
        for folder in (run.logs_dir, run.tensorboard_dir, run.checkpoints_dir, run.rollout_dir):
            folder.mkdir(parents=True, exist_ok=True)
        return run

    @property
    def config_file(self) -> Path:
        return self.root / "config.yaml"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def tensorboard_dir(self) -> Path:
        return self.root / "tensorboard"

    @property
    def metrics_file(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints_dir(self) -> Path:
        return self.root / "checkpoints"

    @property
    def rollout_dir(self) -> Path:
        return self.root / "rollout"

    @property
    def prometheus_dir(self) -> Path:
        return self.root / "prometheus"

    @property
    def profile_dir(self) -> Path:
        return self.root / "profile"

    def hf_export_dir(self, model_name: str) -> Path:
        return self.root / "hf" / model_name

    @property
    def stacks_dir(self) -> Path:
        """Every rank's Python stacks after a hang (``engine.trainer.watchdog``)."""
        return self.logs_dir / "stacks"

    def rank_log_file(self, rank: int) -> Path:
        return self.logs_dir / f"rank_{rank:05d}.log"

    def write_config(self, config: Any) -> Path:
        """Write the resolved config as ``config.yaml`` (call on rank 0).

        ``config``: an OmegaConf config, a dataclass or a plain dict; interpolations are resolved.
        A different ``config.yaml`` already there (a restart with changed settings) is kept as
        ``config.<its modification time>.yaml``.
        """
        from omegaconf import OmegaConf

        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            config = OmegaConf.structured(config)
        text = OmegaConf.to_yaml(OmegaConf.create(config) if not OmegaConf.is_config(config) else config, resolve=True)
        path = self.config_file
        if path.exists() and path.read_text() != text:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
            os.replace(path, path.with_name(f"config.{stamp}.yaml"))
        tmp = path.with_name(".config.yaml.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
        return path

    def summary(self) -> str:
        """The line printed at the start and the end of a run."""
        return (f"run dir: {self.root} | logs: {self.logs_dir} | tensorboard: {self.tensorboard_dir} | "
                f"metrics: {self.metrics_file} | checkpoints: {self.checkpoints_dir}")
