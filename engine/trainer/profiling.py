"""``trainer.profile``: a torch profiler trace, or an Nsight Systems capture range, around chosen steps.

The phases of a step are ranges in both (``engine.trainer.tracking.phase``), so a trace shows
gen / old_log_prob / ref / values / update_critic / update_actor / update_weights side by side.
    nsys profile -t cuda,nvtx --capture-range=cudaProfilerApi --capture-range-end=repeat \\
        -o trident_%q{RANK} trident yaml/X.yaml trainer.profile.tool=nvtx 'trainer.profile.steps=[3]'
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

from engine.config.errors import ConfigError
from engine.config.trainer import ProfileConfig
from engine.trainer.console import say


class StepProfiler:
    def __init__(self, config: ProfileConfig, rank: int, out_dir: Path) -> None:
        if config.tool == "nvtx" and config.steps and not torch.cuda.is_available():
            raise ConfigError("trainer.profile.tool='nvtx' brackets steps for Nsight Systems and needs CUDA GPUs; "
                              "on this machine use trainer.profile.tool=torch")
        self.steps = set(config.steps) if rank in config.ranks else set()
        self.tool, self.rank, self.out_dir = config.tool, rank, out_dir

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step not in self.steps:
            yield
        elif self.tool == "nvtx":
            torch.cuda.profiler.start()
            try:
                yield
            finally:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as profile:
                yield
            self.out_dir.mkdir(parents=True, exist_ok=True)
            trace = self.out_dir / f"step_{step}_rank_{self.rank}.json"
            profile.export_chrome_trace(str(trace))
            say(f"[trident] step {step} profiled: {trace} (chrome://tracing or https://ui.perfetto.dev)")
