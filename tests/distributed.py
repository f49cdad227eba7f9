"""Run worker scripts under torchrun (gloo on CPU) from pytest.

A torchrun launch costs 5-9 s here (imports + rendezvous), so workers check several things per
launch. A worker signals failure by raising; its output is attached to the pytest failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from parallel.state import find_free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "dist_workers"


def run_torchrun(
    worker: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``worker`` (a path, or a file name in tests/dist_workers/) on ``nproc`` local ranks.

    Raises AssertionError with the combined output if any rank fails or the run times out.
    """
    script = Path(worker)
    if not script.is_absolute() and not script.exists():
        script = WORKERS / script
    run_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TORCHDYNAMO_DISABLE": "1",  # megatron's jit fuser would compile for ~16 s on CPU
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        **(env or {}),
    }
    command = [
        sys.executable, "-m", "launch.torchrun",
        f"--nproc_per_node={nproc}", "--nnodes=1",
        f"--master_addr=127.0.0.1", f"--master_port={find_free_port()}",
        str(script), *args,
    ]
    try:
        result = subprocess.run(
            command, cwd=REPO_ROOT, env=run_env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        raise AssertionError(f"torchrun {script.name} timed out after {timeout}s\n{out[-6000:]}") from None
    if result.returncode != 0:
        raise AssertionError(
            f"torchrun {script.name} x{nproc} failed (exit {result.returncode})\n"
            f"--- stdout ---\n{result.stdout[-8000:]}\n--- stderr ---\n{result.stderr[-8000:]}"
        )
    return result


def run_main_job(experiment: str, overrides: Sequence[str], nproc: int = 2, timeout: float = 900) -> None:
    """``torchrun --nproc_per_node nproc -m launch.main experiment overrides...`` on this machine."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    command = [sys.executable, "-m", "launch.torchrun", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={find_free_port()}", "-m", "launch.main", experiment, *overrides]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of a run's ``metrics.jsonl``."""
    import json

    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def processes_with(marker: str) -> dict[int, str]:
    """Running processes whose environment holds ``marker`` (e.g. ``NAME=<uuid>`` set for one test's
    job), wherever they were reparented: pid -> the start of its command line. Other tests' processes,
    running beside this one under pytest-xdist, do not carry it."""
    found = {}
    for folder in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (folder / "environ").read_bytes():
                found[int(folder.name)] = (folder / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
        except OSError:
            continue
    return found


def processes_left(marker: str, within_s: float = 30.0) -> dict[int, str]:
    """``processes_with(marker)`` once none is left or ``within_s`` has passed, whichever is first;
    what is still running then is killed (nothing leaks into the next tests) and returned. A job's
    processes may take a moment after its end: torch's shared-memory manager (a session of its own,
    started by a rank that pushed CPU weights to SGLang) exits 2 s after its last client
    (torch/lib/libshm/manager.cpp, SHUTDOWN_TIMEOUT) and unlinks what is left only then."""
    deadline = time.monotonic() + within_s
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = processes_with(marker)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left
