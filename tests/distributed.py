"""Run worker scripts under torchrun (gloo on CPU) from pytest.

A torchrun launch costs 5-9 s here (imports + rendezvous), so workers check several things per
launch. A worker signals failure by raising; its output is attached to the pytest failure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "dist_workers"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={nproc}", "--nnodes=1",
        f"--master_addr=127.0.0.1", f"--master_port={_free_port()}",
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
