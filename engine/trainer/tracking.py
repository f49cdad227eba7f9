"""Metrics of the PPO loop: console line, TensorBoard events, JSONL rows; step timers and ETA.

The trainer hands ``Tracker.log`` one flat dict per step with the names users know from verl
(``actor/pg_loss``, ``critic/vf_loss``, ``timing_s/gen``, ``perf/mfu/actor`` ...). Only global
rank 0 writes; other ranks may call ``log`` and it does nothing there. Values of None are
skipped (e.g. ``perf/mfu/actor`` on a device without a known peak).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, TextIO

import torch

logger = logging.getLogger(__name__)

LOGGERS = ("console", "tensorboard", "jsonl")
# The numbers a user scans for on the console, in this order (when present in the step's metrics).
CONSOLE_KEYS = (
    "critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy",
    "actor/grad_norm", "critic/vf_loss", "critic/vf_explained_var", "response_length/mean",
    "perf/throughput", "perf/mfu/actor", "timing_s/step",
)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric {name!r} is a tensor of shape {tuple(value.shape)}; log a scalar")
        return float(value.detach().float().item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"metric {name!r} has a non-numeric value {value!r}") from None


def format_duration(seconds: float | None) -> str:
    """``1:02:03`` style (hours:minutes:seconds), ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}"


class ProgressEstimate:
    """Progress and ETA of the step loop, from the steps run by this process (resume-aware).

    ETA = (total - done) * mean seconds per step since this process started (its first step may
    include warm-up; the estimate settles as steps accumulate).
    """

    def __init__(self, total_steps: int | None, start_step: int = 0, clock=time.monotonic) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self._clock = clock
        self._started = clock()

    def eta_seconds(self, step: int) -> float | None:
        done_here = step - self.start_step
        if self.total_steps is None or done_here <= 0:
            return None
        per_step = (self._clock() - self._started) / done_here
        return max(0, self.total_steps - step) * per_step

    def describe(self, step: int) -> str:
        if self.total_steps is None:
            return f"step {step}"
        percent = 100.0 * step / self.total_steps if self.total_steps else 100.0
        elapsed = self._clock() - self._started
        return (f"step {step}/{self.total_steps} ({percent:.0f}%) elapsed {format_duration(elapsed)} "
                f"eta {format_duration(self.eta_seconds(step))}")


def format_console_line(step_description: str, metrics: Mapping[str, float],
                        keys: Sequence[str] = CONSOLE_KEYS) -> str:
    """One compact line: the progress, then ``name value`` for the key metrics present."""
    parts = [step_description]
    for key in keys:
        if key in metrics:
            parts.append(f"{key} {metrics[key]:.4g}")
    return " | ".join(parts)


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
    that launched it.
    """
    sync = synchronize and torch.cuda.is_available()
    if sync:
        torch.cuda.synchronize()
    reset_peak_memory()
    started = time.perf_counter()
    try:
        yield
    finally:
        if sync:
            torch.cuda.synchronize()
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
    """Writes each step's metrics to the chosen sinks (``trainer.logger``); only global rank 0 writes.

    Args:
        loggers: any of "console", "tensorboard", "jsonl".
        tensorboard_dir: folder for event files (needed with "tensorboard").
        metrics_file: the JSONL file (needed with "jsonl"); one ``{"step": n, ...metrics}`` row per step.
        total_steps: for progress and ETA on the console (None: no ETA).
        start_step: the step a resumed run continues from; JSONL rows and TensorBoard events of
            later steps (written by the run that crashed after its last checkpoint) are dropped,
            so every step appears once.
        console_keys: metrics shown on the console line.
        console_stream: where console lines go (stdout by default).
        rank: the writer's global rank; defaults to torch.distributed's (0 without it).
    """

    def __init__(self, loggers: Sequence[str] = ("console",), *, tensorboard_dir: str | Path | None = None,
                 metrics_file: str | Path | None = None, total_steps: int | None = None, start_step: int = 0,
                 console_keys: Sequence[str] = CONSOLE_KEYS, console_stream: TextIO | None = None,
                 rank: int | None = None) -> None:
        unknown = sorted(set(loggers) - set(LOGGERS))
        if unknown:
            raise ValueError(f"trainer.logger has unknown entries {unknown}; choose from {list(LOGGERS)}")
        if "tensorboard" in loggers and tensorboard_dir is None:
            raise ValueError("the tensorboard logger needs tensorboard_dir")
        if "jsonl" in loggers and metrics_file is None:
            raise ValueError("the jsonl logger needs metrics_file")
        if rank is None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.is_writer = rank == 0
        self.loggers = tuple(loggers)
        self.console_keys = tuple(console_keys)
        self.progress = ProgressEstimate(total_steps, start_step)
        self._console = console_stream or sys.stdout
        self._tensorboard = None
        self._jsonl: TextIO | None = None
        if not self.is_writer:
            return
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events of steps after the checkpoint we resumed from.
            self._tensorboard = SummaryWriter(str(tensorboard_dir), purge_step=start_step + 1 if start_step else None)
        if "jsonl" in loggers:
            metrics_file = Path(metrics_file)
            metrics_file.parent.mkdir(parents=True, exist_ok=True)
            if start_step and metrics_file.exists():
                _drop_rows_after(metrics_file, start_step)
            self._jsonl = open(metrics_file, "a")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (flat name -> scalar; None values skipped) for ``step``."""
        values = {name: _as_float(name, value) for name, value in metrics.items() if value is not None}
        if not self.is_writer:
            return
        if "console" in self.loggers:
            print(format_console_line(self.progress.describe(step), values, self.console_keys),
                  file=self._console, flush=True)
        if self._tensorboard is not None:
            for name, value in values.items():
                self._tensorboard.add_scalar(name, value, global_step=step)
            self._tensorboard.flush()
        if self._jsonl is not None:
            # JSON has no NaN/inf: write them as null, keep the key so the row shows it was logged.
            row = {"step": step, **{k: (v if math.isfinite(v) else None) for k, v in values.items()}}
            self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
            self._jsonl.flush()

    def log_text(self, tag: str, text: str, step: int = 0) -> None:
        """A text entry in TensorBoard (e.g. the resolved config); nothing on other sinks."""
        if self.is_writer and self._tensorboard is not None:
            self._tensorboard.add_text(tag, text, global_step=step)
            self._tensorboard.flush()

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
