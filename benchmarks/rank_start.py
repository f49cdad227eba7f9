"""How long a job takes to start its ranks: torch's torchrun vs ``launch.torchrun`` (forked ranks).

    python -m benchmarks.rank_start --out rank_start.json [--ranks 2 4] [--repeats 2]

Each case runs one job whose ranks import what a Trident rank imports before its first step
(``launch.main``, the trainer, megatron-core's GPT layers, transformers' tokenizers), join a gloo
group and pass one barrier, then exit. Reported per launcher and rank count: the job's wall time
with every process pinned to one core (the CPU the start costs: what a 2-core CI box pays per job)
and unpinned; the least of ``--repeats`` runs. Both launchers run in the same invocation, so the
baseline is measured beside the change.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from parallel.state import find_free_port

LAUNCHERS = ("torch.distributed.run", "launch.torchrun")


def worker() -> None:
    """One rank: the imports of a Trident rank, a gloo group, one barrier."""
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import torch.distributed as dist
    from transformers import AutoTokenizer  # noqa: F401

    import engine.trainer.ppo_trainer  # noqa: F401
    import launch.main  # noqa: F401

    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()


def run_job(launcher: str, ranks: int, pinned: bool) -> float:
    """Seconds from starting ``launcher`` to its exit."""
    command = [sys.executable, "-m", launcher, f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={find_free_port()}", "-m", "benchmarks.rank_start", "--worker"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    first_core = min(os.sched_getaffinity(0))
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600,
                            preexec_fn=(lambda: os.sched_setaffinity(0, {first_core})) if pinned else None)
    elapsed = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{launcher} x{ranks} failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("rank_start.json"))
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker()
        return 0
    cases = []
    for ranks in args.ranks:
        for pinned in (True, False):
            for launcher in LAUNCHERS:
                seconds = min(run_job(launcher, ranks, pinned) for _ in range(args.repeats))
                cases.append({"launcher": launcher, "ranks": ranks, "one_core": pinned, "wall_s": round(seconds, 2)})
                print(f"{launcher:22s} ranks={ranks} {'one core' if pinned else 'all cores'}: {seconds:6.2f} s",
                      flush=True)
    report = {"benchmark": "rank_start", "cpus": len(os.sched_getaffinity(0)), "python": platform.python_version(),
              "repeats": args.repeats, "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
