"""The device a process computes on, decided once, at its start, before anything initialises CUDA.

Every later device decision (``parallel.state``, ``parallel.cpu_compat``, the SGLang server's CPU
engine) reads ``torch.cuda.is_available()``, so the decision is made where that answer can still be
trusted and made to hold:

- ``trainer.device=cpu``: the CPU on purpose, on any machine. ``CUDA_VISIBLE_DEVICES`` is emptied, so
  every later ``is_available()`` in this process and its children (ranks, servers) answers False.
- ``auto`` (default) or ``cuda``: GPUs where CUDA initialises. Where the NVIDIA driver shows GPUs
  (``/proc/driver/nvidia/version``, ``nvidia-smi``) but CUDA cannot initialise (a driver older than
  torch's CUDA needs, a CPU-only torch) the job stops with one line naming the driver, torch's CUDA
  and what to install, instead of running on gloo and SGLang's CPU engine without a word.
  ``cuda`` on a machine without GPUs stops too.

``PYTORCH_NVML_BASED_CUDA_CHECK`` makes ``is_available()`` count GPUs with NVML, which sees GPUs that
CUDA cannot use; a preload sets it while importing (``engine.preload``). It is unset here, before
the question is asked, so a rank never inherits NVML's answer.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from pathlib import Path

DEVICES = ("auto", "cuda", "cpu")
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA Toolkit release notes, table
# "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version Compatibility").
MINIMUM_DRIVER = {11: (450, 80), 12: (525, 60), 13: (580, 0)}


class DeviceError(RuntimeError):
    """The machine's GPUs cannot be used as asked (a user's setup to fix, reported in one line)."""


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    kind: str  # "cuda" or "cpu"
    gpus: int  # GPUs this process sees (CUDA's count; 0 on the CPU)
    driver: str | None  # the NVIDIA driver's version, where one is installed
    torch_cuda: str | None  # the CUDA torch was built for (None: a CPU-only build)
    why: str

    def banner(self) -> str:
        if self.kind == "cuda":
            return f"device: cuda ({self.gpus} GPU(s), driver {self.driver or '?'}, CUDA {self.torch_cuda}, NCCL)"
        return f"device: cpu, gloo ({self.why})"


_CHOICE: list[DeviceChoice] = []


def driver_version() -> str | None:
    """The installed NVIDIA driver's version ("580.65.06"), from the kernel module or ``nvidia-smi``."""
    if DRIVER_VERSION_FILE.is_file():
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", DRIVER_VERSION_FILE.read_text())
        if found:
            return found.group(1)
    answer = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
    return answer[0] if answer else None


def gpus_seen_by_driver() -> int:
    """GPUs the driver lists (``nvidia-smi -L``), whether or not CUDA can use them."""
    return len([line for line in _nvidia_smi("-L") if line.startswith("GPU ")])


def _nvidia_smi(*args: str) -> list[str]:
    executable = shutil.which("nvidia-smi")
    if executable is None:
        return []
    try:
        result = subprocess.run([executable, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in result.stdout.splitlines() if line.strip()] if result.returncode == 0 else []


def minimum_driver(torch_cuda: str | None) -> str | None:
    """The oldest driver that runs ``torch_cuda`` ("13.0" -> "580"), where known."""
    if not torch_cuda:
        return None
    needed = MINIMUM_DRIVER.get(int(torch_cuda.split(".")[0]))
    return None if needed is None else f"{needed[0]}.{needed[1]:02d}" if needed[1] else str(needed[0])


def _older(driver: str, minimum: str) -> bool:
    return tuple(int(part) for part in driver.split(".")[:2]) < tuple(int(part) for part in minimum.split(".")[:2])


def decide(requested: str = "auto") -> DeviceChoice:
    """This process's device (see the module docstring); the first call decides, later ones return it.
    Raises ``DeviceError`` where GPUs are present but unusable, or ``cuda`` was asked of a machine
    without them."""
    if _CHOICE:
        return _CHOICE[0]
    if requested not in DEVICES:
        raise DeviceError(f"trainer.device={requested!r}: expected one of {', '.join(DEVICES)}")
    os.environ.pop(NVML_CHECK, None)
    import torch

    driver, torch_cuda = driver_version(), torch.version.cuda
    if requested == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read when CUDA initialises, here and in every child
        choice = DeviceChoice("cpu", 0, driver, torch_cuda, "trainer.device=cpu")
    elif torch.cuda.is_available():
        choice = DeviceChoice("cuda", torch.cuda.device_count(), driver, torch_cuda, "CUDA initialised")
    elif driver is not None or gpus_seen_by_driver():
        raise DeviceError(_unusable_gpus_message(driver, torch_cuda, torch.__version__))
    elif requested == "cuda":
        raise DeviceError("trainer.device=cuda, but this machine has no NVIDIA GPU (no driver, no nvidia-smi); "
                          "set trainer.device=cpu or auto to run on the CPU")
    else:
        choice = DeviceChoice("cpu", 0, None, torch_cuda, "no NVIDIA GPU on this machine")
    _CHOICE.append(choice)
    return choice


def _unusable_gpus_message(driver: str | None, torch_cuda: str | None, torch_version: str) -> str:
    seen = gpus_seen_by_driver()
    gpus = f"{seen} NVIDIA GPU(s)" if seen else "an NVIDIA driver"
    if torch_cuda is None:
        return (f"this machine has {gpus} (driver {driver or 'unknown'}) but torch {torch_version} is a CPU-only "
                "build: install torch built for CUDA (make install), or set trainer.device=cpu to run on the CPU")
    minimum = minimum_driver(torch_cuda)
    if driver is not None and minimum is not None and _older(driver, minimum):
        return (f"this machine has {gpus} with driver {driver}, but torch {torch_version} is built for CUDA "
                f"{torch_cuda}, which needs driver {minimum} or newer: install a driver of the R{minimum.split('.')[0]} "
                "series or newer (or torch built for an older CUDA), or set trainer.device=cpu to run on the CPU")
    return (f"this machine has {gpus} (driver {driver or 'unknown'}) but CUDA cannot initialise for torch "
            f"{torch_version} (CUDA {torch_cuda}): check nvidia-smi, CUDA_VISIBLE_DEVICES and the driver install, "
            "or set trainer.device=cpu to run on the CPU")
