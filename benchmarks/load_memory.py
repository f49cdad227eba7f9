"""Peak resident memory per rank while loading SmolLM2-135M-Instruct into Megatron, TP1 vs TP2.

    python -m benchmarks.load_memory --out load_memory.json

Each layout runs as its own torchrun world (gloo). Per rank we reset the kernel's peak-RSS mark
(``/proc/self/clear_refs``) once torch, megatron and the process groups are up, then build the
model chunks (no random init) and ``load_hf_weights``; reported: the RSS before, the peak during
build + load, the difference, and the bytes of the parameters the rank holds. Loading reads only
the slices a rank owns, so the increase should follow the shard, not the 538 MB checkpoint.
Reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel.state import find_free_port

MIB = 1024 * 1024


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # 5: reset VmHWM to the current RSS
        return True
    except OSError:
        return False


def worker(hf_dir: Path, tensor_model_parallel_size: int, out_dir: Path) -> None:
    """One rank: build + load, then write this rank's numbers to ``out_dir/rank{N}.json``."""
    import torch

    from engine.models.checkpoint import load_hf_weights
    from engine.models.gpt import build_model_chunks
    from parallel.layout import ParallelLayout
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    layout = ParallelLayout(tensor_model_parallel_size=tensor_model_parallel_size)
    initialize_model_parallel(layout, seed=0)
    import megatron.core.models.gpt  # noqa: F401  (imports count as baseline, not as loading)

    peak_was_reset = reset_peak_rss()
    baseline_kib = status_kib("VmRSS")
    started = time.perf_counter()
    chunks = build_model_chunks(hf_dir, layout, initialize_weights=False)
    built = time.perf_counter()
    load_hf_weights(chunks, hf_dir)
    loaded = time.perf_counter()
    param_bytes = sum(p.numel() * p.element_size() for chunk in chunks for p in chunk.parameters())
    result = {
        "rank": torch.distributed.get_rank(),
        "baseline_rss_mib": baseline_kib / 1024,
        "peak_rss_mib": status_kib("VmHWM") / 1024,
        "peak_minus_baseline_mib": (status_kib("VmHWM") - baseline_kib) / 1024,
        "final_rss_anon_mib": status_kib("RssAnon") / 1024,
        "final_rss_file_mib": status_kib("RssFile") / 1024,
        "shard_param_mib": param_bytes / MIB,
        "peak_reset_after_imports": peak_was_reset,
        "build_s": built - started,
        "load_s": loaded - built,
    }
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))
    destroy_model_parallel()


def run_layout(hf_dir: Path, tensor_model_parallel_size: int) -> list[dict]:
    repo_root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(repo_root), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "launch.torchrun", f"--nproc_per_node={tensor_model_parallel_size}",
                   "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={find_free_port()}",
                   str(Path(__file__).resolve()), "--worker", "--hf-dir", str(hf_dir),
                   "--tp", str(tensor_model_parallel_size), "--worker-out", scratch]
        completed = subprocess.run(command, cwd=repo_root, env=env, capture_output=True, text=True)
        if completed.returncode != 0:
            raise RuntimeError(f"TP{tensor_model_parallel_size} run failed:\n{completed.stderr[-4000:]}")
        return [json.loads(path.read_text()) for path in sorted(Path(scratch).glob("rank*.json"))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="peak RSS per rank when loading SmolLM2 into Megatron")
    parser.add_argument("--out", type=Path, help="JSON result file")
    parser.add_argument("--hf-dir", type=Path, help="HF folder (default: the converted SmolLM2)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes to run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        worker(args.hf_dir, args.tp[0], args.worker_out)
        return
    if args.out is None:
        parser.error("--out is required")
    from engine.models import smollm2

    hf_dir = args.hf_dir or smollm2.convert()
    checkpoint_bytes = sum(path.stat().st_size for path in hf_dir.glob("*.safetensors"))
    runs = [{"tensor_model_parallel_size": tp, "ranks": run_layout(hf_dir, tp)} for tp in args.tp]
    report = {
        "benchmark": "load_memory",
        "model": str(hf_dir),
        "checkpoint_mib": checkpoint_bytes / MIB,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "runs": runs,
    }
    args.out.write_text(json.dumps(report, indent=2))
    for run in runs:
        for rank in run["ranks"]:
            print(f"TP{run['tensor_model_parallel_size']} rank {rank['rank']}: peak {rank['peak_rss_mib']:.0f} MiB "
                  f"(+{rank['peak_minus_baseline_mib']:.0f} over {rank['baseline_rss_mib']:.0f}), "
                  f"shard {rank['shard_param_mib']:.0f} MiB, load {rank['load_s']:.1f} s")


if __name__ == "__main__":
    main()
