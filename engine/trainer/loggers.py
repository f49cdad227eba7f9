"""The metric sinks: ``trainer.logger`` (console, tensorboard, jsonl, wandb, mlflow) and Prometheus.

Each sink takes one step's flat ``{name: float}`` with the same names everywhere (``actor/pg_loss``,
``timing_s/gen``, ``val/accuracy`` ...); only rank 0 builds sinks (``engine.trainer.tracking``).
wandb and mlflow are optional extras, checked by the config before a run starts.
"""
from __future__ import annotations

import json
import logging
import math
import netrc
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence, TextIO

from tqdm import tqdm

from engine.trainer.console import say
from engine.trainer.run_dir import RunDirectory

logger = logging.getLogger(__name__)

# The numbers a user scans for on the console, in this order (when present), then any val/* metric.
CONSOLE_KEYS = (
    "critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy",
    "actor/grad_norm", "critic/vf_loss", "critic/vf_explained_var", "response_length/mean",
    "perf/throughput", "perf/mfu/actor", "timing_s/step",
)


class Sink(Protocol):
    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """One line per step: progress with ETA (tqdm's meter, resume-aware), the key metrics, and the
    validation metrics when the step has them."""

    def __init__(self, total_steps: int | None, start_step: int, stream: TextIO | None = None,
                 keys: Sequence[str] = CONSOLE_KEYS, clock=time.monotonic) -> None:
        self.total_steps, self.start_step, self.keys = total_steps, start_step, tuple(keys)
        self._stream, self._clock = stream, clock
        self._started = clock()

    def progress(self, step: int) -> str:
        shape = "step {n}/{total} [{elapsed}<{remaining}, {rate_fmt}]" if self.total_steps else "step {n} [{elapsed}, {rate_fmt}]"
        return tqdm.format_meter(step, self.total_steps, self._clock() - self._started, initial=self.start_step,
                                 unit="step", bar_format=shape)

    def line(self, values: Mapping[str, float], step: int) -> str:
        shown = [key for key in self.keys if key in values] + sorted(key for key in values if key.startswith("val/"))
        return " | ".join([self.progress(step), *(f"{key} {values[key]:.4g}" for key in shown)])

    def log(self, values: Mapping[str, float], step: int) -> None:
        if self._stream is None:
            say(self.line(values, step))
        else:
            print(self.line(values, step), file=self._stream, flush=True)

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, tensorboard_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides events of steps after the checkpoint we resumed from.
        self._writer = SummaryWriter(str(tensorboard_dir), purge_step=start_step + 1 if start_step else None)

    def log(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()

    def log_text(self, tag: str, text: str) -> None:
        self._writer.add_text(tag, text, global_step=0)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class JsonlSink:
    """``metrics.jsonl``: one ``{"step": n, ...}`` row per step; a resumed run first drops the rows of
    steps after its checkpoint (written by the attempt that crashed), so every step appears once."""

    def __init__(self, metrics_file: Path, start_step: int) -> None:
        metrics_file.parent.mkdir(parents=True, exist_ok=True)
        if start_step and metrics_file.exists():
            _drop_rows_after(metrics_file, start_step)
        self._file = open(metrics_file, "a")

    def log(self, values: Mapping[str, float], step: int) -> None:
        # JSON has no NaN/inf: write them as null, keep the key so the row shows it was logged.
        row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class WandbSink:
    """A wandb run named after the experiment, resumed by id when the run directory is restarted.
    Offline under the run directory unless ``WANDB_MODE`` says otherwise or an API key is set up
    (``WANDB_API_KEY`` or ``wandb login``)."""

    def __init__(self, run: RunDirectory, project: str, experiment: str, config: Mapping[str, Any]) -> None:
        import wandb

        id_file = run.root / "wandb" / "run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
        self.mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_api_key_set() else "offline")
        self._run = wandb.init(project=project, name=experiment, id=run_id, resume="allow", dir=str(run.root),
                               config=dict(config), mode=self.mode, settings=wandb.Settings(console="off"))
        id_file.parent.mkdir(parents=True, exist_ok=True)
        id_file.write_text(run_id)
        self.run_dir = Path(self._run.dir).parent  # wandb/<offline-run-...>, holding files/ and the .wandb log

    def log(self, values: Mapping[str, float], step: int) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()
        if self.mode == "offline":
            say(f"[trident] wandb run saved offline in {self.run_dir}; upload it with: wandb sync {self.run_dir}")


def _wandb_api_key_set() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class MlflowSink:
    """An MLflow run (experiment = project, run name = experiment) in ``$MLFLOW_TRACKING_URI``, or in
    a local store in the run directory (``sqlite:///<run>/mlflow.db``; MLflow's file store is in
    maintenance mode). The run id is kept in the run directory, so a restart continues the run."""

    def __init__(self, run: RunDirectory, project: str, experiment: str, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{run.root / 'mlflow.db'}"
        self._client = MlflowClient(self.tracking_uri)
        found = self._client.get_experiment_by_name(project)
        experiment_id = found.experiment_id if found else self._client.create_experiment(
            project, artifact_location=(run.root / "mlflow-artifacts").as_uri())
        id_file = run.root / "mlflow_run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
        else:
            self.run_id = self._client.create_run(experiment_id, run_name=experiment).info.run_id
            params = [Param(key, str(value)[:6000]) for key, value in _flatten(config).items()]
            for start in range(0, len(params), 100):  # MLflow's batch limit
                self._client.log_batch(self.run_id, params=params[start:start + 100])
            id_file.write_text(self.run_id)

    def log(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
        say(f"[trident] MLflow run {self.run_id} in {self.tracking_uri}")


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class PrometheusSink:
    """``http://<host>:<port>/metrics`` on rank 0: ``trident_metric{name="<metric>"}`` holds the latest
    value of every step metric (the names of metrics.jsonl) and ``trident_step`` the last step. A
    Prometheus file_sd target file in ``<run>/prometheus/`` lists this endpoint beside the SGLang
    servers' own (see ``launch/grafana/``)."""

    def __init__(self, port: int, run: RunDirectory, project: str, experiment: str) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        registry = CollectorRegistry()
        self._metric = Gauge("trident_metric", "Latest value of a step metric (same names as metrics.jsonl)",
                             ["name"], registry=registry)
        self._step = Gauge("trident_step", "The last PPO step logged", registry=registry)
        try:
            self._server, _ = start_http_server(port, registry=registry)
        except OSError as error:
            from engine.config.errors import ConfigError

            raise ConfigError(f"trainer.prometheus_port={port}: cannot serve metrics there ({error})") from None
        write_prometheus_target(run.prometheus_dir / "trainer.json", f"{socket.getfqdn()}:{port}",
                                {"job": "trident", "project": project, "experiment": experiment})
        say(f"[trident] Prometheus metrics: http://{socket.getfqdn()}:{port}/metrics")

    def log(self, values: Mapping[str, float], step: int) -> None:
        for name, value in values.items():
            self._metric.labels(name).set(value)
        self._step.set(step)

    def close(self) -> None:
        self._server.shutdown()


def write_prometheus_target(path: Path, address: str, labels: Mapping[str, str]) -> None:
    """One Prometheus ``file_sd_configs`` entry (a JSON list of {targets, labels})."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"targets": [address], "labels": dict(labels)}], indent=1))


def _drop_rows_after(metrics_file: Path, last_step: int) -> None:
    """Rewrite ``metrics_file`` (atomically) without rows of steps after ``last_step``."""
    kept = []
    with open(metrics_file) as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                logger.warning("%s:%d is not valid JSON; dropping it", metrics_file, number)
                continue
            if row.get("step", 0) <= last_step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = metrics_file.with_name(metrics_file.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, metrics_file)
