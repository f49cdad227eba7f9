"""Metrics of the PPO loop: the Tracker that feeds the sinks, step timers and per-phase memory.

The trainer hands ``Tracker.log`` one flat dict per step with the names users know from verl
(``actor/pg_loss``, ``critic/vf_loss``, ``timing_s/gen``, ``perf/mfu/actor`` ...); the sinks
(``engine.trainer.loggers``) write the same names. Only global rank 0 writes; other ranks may call
``log`` and it does nothing there. Values of None are skipped (e.g. ``perf/mfu/actor`` on a device
without a known peak).
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from typing import Any, Iterator, Mapping, Sequence, TextIO

import psutil
import torch
from tqdm import tqdm

from engine.config.trainer import LOGGERS
from engine.rollout.memory import record
from engine.trainer.phases import PHASES
from engine.trainer import watchdog
from engine.trainer.loggers import (ConsoleSink, JsonlSink, MlflowSink, PrometheusSink, Sink, TensorBoardSink,
                                    WandbSink)
from engine.trainer.run_dir import RunDirectory

# Validation metrics the end-of-run summary reports (final and best), when the run has them.
SUMMARY_KEYS = ("val/accuracy", "val/score/mean")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {name!r} is a tensor of shape {tuple(value.shape)}; log a scalar")
        return float(value.detach().float().item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"metric {name!r} has a non-numeric value {value!r}") from None


GIB = 1024**3


def reset_peak_memory() -> None:
    """Start a new peak-memory window: the CUDA allocator's peak and the process's peak RSS.

    The peak RSS (``VmHWM``) is reset by writing 5 to ``/proc/self/clear_refs`` (Linux >= 4.0);
    where that is not allowed the window silently stays process-wide.
    """
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass


def peak_memory_gb() -> dict[str, float]:
    """Peak memory since the last ``reset_peak_memory``: ``max_memory_allocated_gb`` (CUDA only)
    and ``max_rss_gb`` (host memory of this process, also the CPU path's device memory)."""
    peaks: dict[str, float] = {}
    if torch.cuda.is_available():
        peaks["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / GIB
    peaks["max_rss_gb"] = _peak_rss_bytes() / GIB
    return peaks


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@contextlib.contextmanager
def phase(name: str, metrics: dict[str, float], *, synchronize: bool = True) -> Iterator[None]:
    """Time one phase of the PPO step and record its peak memory into ``metrics``.

    Adds the wall time to ``timing_s/<name>`` (accumulating over calls) and keeps the largest peak
    seen in the phase as ``perf/max_memory_allocated_gb/<name>`` (GPU) and ``perf/max_rss_gb/<name>``
    (host), so the planner's per-phase estimates can be compared with a run. With ``synchronize``
    the CUDA device is synchronised on entry and exit, so queued GPU work is charged to the phase
    that launched it. The phase is a ``record_function`` range in torch profiler traces and, on
    GPUs, an NVTX range, so Nsight Systems shows rollout vs training (``trainer.profile``).
    """
    if name not in PHASES:
        raise ValueError(f"phase {name!r} is not one of engine.trainer.phases.PHASES {PHASES}")
    sync = synchronize and torch.cuda.is_available()
    if sync:
        torch.cuda.synchronize()
    record("phase", name=name)  # the memory record's moves happen in the phase last entered
    reset_peak_memory()
    started = time.perf_counter()
    ranges = contextlib.ExitStack()
    ranges.enter_context(torch.profiler.record_function(f"trident/{name}"))
    if torch.cuda.is_available():
        ranges.enter_context(torch.cuda.nvtx.range(f"trident/{name}"))
    watchdog.entered(name)
    try:
        with ranges:
            yield
    finally:
        if sync:
            torch.cuda.synchronize()
        watchdog.left(name)
        key = f"timing_s/{name}"
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - started
        for kind, value in peak_memory_gb().items():
            key = f"perf/{kind}/{name}"
            metrics[key] = max(metrics.get(key, 0.0), value)


def step_peak_memory(metrics: dict[str, float]) -> dict[str, float]:
    """The step's peaks over its phases (``perf/max_memory_allocated_gb``, ``perf/max_rss_gb``)."""
    peaks: dict[str, float] = {}
    for key, value in metrics.items():
        kind = key.split("/")[1] if key.startswith("perf/max_") and key.count("/") == 2 else None
        if kind is not None:
            peaks[f"perf/{kind}"] = max(peaks.get(f"perf/{kind}", 0.0), value)
    return peaks


class Tracker:
    """Writes each step's metrics to the chosen sinks; only global rank 0 writes.

    Args:
        loggers: any of ``engine.config.trainer.LOGGERS`` (``trainer.logger``).
        run: the run directory (TensorBoard events, metrics.jsonl, the wandb run, the MLflow store).
        total_steps: for progress and ETA on the console (None: no ETA).
        start_step: the step a resumed run continues from: the sinks drop what the crashed attempt
            wrote after it, and the ETA counts only this process's steps.
        project, experiment, config: name the wandb/MLflow run and record the resolved config there.
        prometheus_port: serve the latest metrics for Prometheus there (None: off).
        console_stream: where console lines go (default: the terminal, ``engine.trainer.console``).
        rank: the writer's global rank; defaults to torch.distributed's (0 without it).
    """

    def __init__(self, loggers: Sequence[str] = ("console",), *, run: RunDirectory | None = None,
                 total_steps: int | None = None, start_step: int = 0, project: str = "trident",
                 experiment: str = "default", config: Mapping[str, Any] | None = None,
                 prometheus_port: int | None = None, console_stream: TextIO | None = None,
                 rank: int | None = None) -> None:
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"trainer.logger has unknown entries {unknown}; choose from {list(LOGGERS)}")
        if set(loggers) - {"console"} and run is None:
            raise ValueError(f"the loggers {sorted(set(loggers) - {'console'})} need the run directory")
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.is_writer = rank == 0
        self._summary: dict[str, dict[str, float]] = {}  # key -> final, best, best_step
        self.sinks: dict[str, Sink] = {}
        if not self.is_writer:
            return
        config = config or {}
        makers = {
            "console": lambda: ConsoleSink(total_steps, start_step, console_stream),
            "tensorboard": lambda: TensorBoardSink(run.tensorboard_dir, start_step),
            "jsonl": lambda: JsonlSink(run.metrics_file, start_step),
            "wandb": lambda: WandbSink(run, project, experiment, config),
            "mlflow": lambda: MlflowSink(run, project, experiment, config),
        }
        self.sinks = {name: makers[name]() for name in loggers}
        if prometheus_port is not None:
            self.sinks["prometheus"] = PrometheusSink(prometheus_port, run, project, experiment)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (flat name -> scalar; None values skipped) for ``step``."""
        values = {name: _as_float(name, value) for name, value in metrics.items() if value is not None}
        if not self.is_writer:
            return
        for key in SUMMARY_KEYS:
            if key in values:
                seen = self._summary.setdefault(key, {"best": -math.inf, "best_step": step})
                seen["final"] = values[key]
                if values[key] > seen["best"]:
                    seen.update(best=values[key], best_step=step)
        for sink in self.sinks.values():
            sink.log(values, step)

    def log_text(self, tag: str, text: str) -> None:
        """A text entry in TensorBoard (e.g. the resolved config); nothing on other sinks."""
        sink = self.sinks.get("tensorboard")
        if isinstance(sink, TensorBoardSink):
            sink.log_text(tag, text)

    def summary(self) -> str:
        """The run in one line: total time, and the final and best validation scores."""
        # The rank's whole wall time: start-up (models, engine) included.
        parts = [f"{tqdm.format_interval(time.time() - psutil.Process().create_time())} in total"]
        for key, seen in self._summary.items():
            parts.append(f"{key} final {seen['final']:.4g}, best {seen['best']:.4g} (step {seen['best_step']})")
        return "; ".join(parts)

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()
        self.sinks = {}

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
