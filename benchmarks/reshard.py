"""Benchmark: the HybridEngine reshard against gathering the whole model on every rank.

    python -m benchmarks.reshard --out FILE.json [--layouts pp,tp,dp,vpp,tp_gen ...]

For each layout (one torchrun launch per world size, gloo on CPU / NCCL on GPU), on a megatron-core
Llama-shaped actor with random weights, bf16 transfer from fp32 parameters:

- ``hybrid_full``: every generation rank gets full HF tensors (what SGLang / the embedded engine take);
- ``hybrid_sharded``: each generation rank gets exactly its generation TP shard (zero redundancy);
- ``naive_gather_all``: ``engine.models.checkpoint.export_hf_state_dict(destination_rank=None)``,
  the whole HF model gathered on every rank in one go, then sliced.

Reported per method: wall time (median of repeats, slowest rank), bytes received per rank (max)
against the layout's lower bound for the target, and peak extra memory per rank. The lower bound
of ``naive_gather_all`` is that of ``hybrid_full`` (every rank ends with the whole model); its bytes
are counted in its own fp32 and are also given in bf16 units for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parallel.state import find_free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
# (pp, tp, dp, vpp, tp_gen): the layouts of the tests, and tp_gen > tp.
DEFAULT_LAYOUTS = ["2,2,1,0,1", "2,2,1,0,2", "1,4,1,0,2", "2,1,2,2,1", "1,2,2,0,2", "2,1,2,0,2", "2,2,2,0,2",
                   "1,4,2,0,2"]
MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)


def parse_layout(text: str) -> tuple[int, int, int, int | None, int]:
    pp, tp, dp, vpp, tg = (int(x) for x in text.split(","))
    return pp, tp, dp, vpp or None, tg


# ------------------------------------------------------------------------------------ worker


def _max_over_ranks(value: float) -> float:
    import torch
    import torch.distributed as dist

    from parallel.state import device

    tensor = torch.tensor([float(value)], dtype=torch.float64, device=device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def _timed(run, repeats: int) -> tuple[float, object]:
    """Median over ``repeats`` (after one warm-up) of the slowest rank's wall time."""
    import torch.distributed as dist

    result = run()
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        result = run()
        times.append(_max_over_ranks(time.perf_counter() - start))
    return statistics.median(times), result


def bench_layout(text: str, repeats: int, bucket_megabytes: float) -> dict:
    import torch
    import torch.distributed as dist
    import transformers
    from megatron.core import parallel_state

    from engine.models.checkpoint import export_hf_state_dict
    from engine.models.gpt import build_model_chunks
    from engine.config import RolloutConfig
    from engine.sync import WeightSynchronizer
    from parallel.layout import ParallelLayout
    from parallel.state import device, initialize_model_parallel

    pp, tp, dp, vpp, tg = parse_layout(text)
    layout = ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    initialize_model_parallel(layout, seed=5)
    chunks = build_model_chunks(transformers.LlamaConfig(**MODEL), layout)
    rank = dist.get_rank()
    result: dict = {"layout": None, "world_size": dist.get_world_size(), "methods": {}}

    for target in ("full", "sharded"):
        sync = WeightSynchronizer(chunks, layout, RolloutConfig(
            tensor_model_parallel_size=tg, update_weights_bucket_megabytes=bucket_megabytes, dtype="bfloat16"),
            target=target)
        result["layout"] = sync.layout.describe()

        def run():
            for bucket in sync.iter_weight_shards():
                del bucket
            return sync.executor.stats

        seconds, stats = _timed(run, repeats)
        report = sync.plan.report()
        bound = report["max_lower_bound_bytes"]
        received = _max_over_ranks(stats.bytes_received)
        assert received == report["max_received_bytes"], (received, report["max_received_bytes"])
        result["model_bytes_bf16"] = report["model_bytes"]
        result["methods"][f"hybrid_{target}"] = {
            "seconds": seconds,
            "max_received_bytes": int(received),
            "lower_bound_bytes": bound,
            "received_over_lower_bound": report["received_over_lower_bound"],
            "hybridflow_formula_bytes": report["hybridflow_bound_bytes"],
            "peak_extra_bytes": int(_max_over_ranks(stats.peak_staging_bytes)),
            "bucket_bytes": int(bucket_megabytes * 2**20),
            "num_buckets": stats.num_buckets,
        }
        if target == "full":
            full_bound = bound
    result["methods"]["hybrid_full"]["extra_over_zero_redundancy_bytes"] = (
        result["methods"]["hybrid_full"]["max_received_bytes"] - result["methods"]["hybrid_sharded"]["lower_bound_bytes"]
    )

    def naive():
        state = export_hf_state_dict(chunks, destination_rank=None)
        # every rank then converts the whole model to the serving dtype
        return {name: tensor.to(torch.bfloat16) for name, tensor in state.items()}, state

    seconds, (converted, state) = _timed(naive, repeats)
    full_bytes = sum(t.numel() * t.element_size() for t in state.values())
    # export: TP shards all-gathered on dp 0, then every tensor broadcast from TP rank 0 of dp 0 of
    # its stage; a rank receives every tensor it did not itself assemble (counted in fp32).
    coordinates = sync.layout.training.coordinates(rank)
    sourced = sum(
        t.numel() * t.element_size() for name, t in state.items()
        if coordinates.tensor == 0 and coordinates.data == 0 and coordinates.context == 0
        and next(p for p in sync.plan.tensors if p.name == name).pipeline_rank == coordinates.pipeline
    )
    naive_received = _max_over_ranks(full_bytes - sourced)
    result["methods"]["naive_gather_all"] = {
        "seconds": seconds,
        "max_received_bytes": int(naive_received),
        "max_received_bytes_in_bf16_units": int(naive_received // 2),
        "lower_bound_bytes": full_bound,
        "received_over_lower_bound": (naive_received // 2) / full_bound if full_bound else None,
        "peak_extra_bytes": int(_max_over_ranks(full_bytes + sum(t.numel() * t.element_size() for t in converted.values()))),
    }
    del converted, state
    if device().type == "cuda":
        torch.cuda.empty_cache()
    return result


def worker(args) -> None:
    import torch.distributed as dist

    from parallel.state import destroy_model_parallel

    records = [bench_layout(text, args.repeats, args.bucket_megabytes) for text in args.layouts]
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(records))
    destroy_model_parallel()


# ------------------------------------------------------------------------------------ driver


def launch(layouts: list[str], world_size: int, repeats: int, bucket_megabytes: float, timeout: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "records.json"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TORCHDYNAMO_DISABLE": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "launch.torchrun", f"--nproc_per_node={world_size}",
                   f"--master_port={find_free_port()}", "-m", "benchmarks.reshard", "--worker-out", str(out),
                   "--repeats", str(repeats), "--bucket-megabytes", str(bucket_megabytes), "--layouts", *layouts]
        completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if completed.returncode != 0:
            raise SystemExit(f"torchrun x{world_size} failed:\n{completed.stdout[-4000:]}\n{completed.stderr[-8000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="JSON results file")
    parser.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, help="pp,tp,dp,vpp,tp_gen (vpp 0 = none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-megabytes", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        worker(args)
        return
    if args.out is None:
        parser.error("--out is required")
    by_world: dict[int, list[str]] = {}
    for text in args.layouts:
        pp, tp, dp, vpp, tg = parse_layout(text)
        by_world.setdefault(pp * tp * dp, []).append(text)
    import torch

    records = []
    for world_size, layouts in sorted(by_world.items()):
        records.extend(launch(layouts, world_size, args.repeats, args.bucket_megabytes, args.timeout))
    summary = {
        "benchmark": "reshard",
        "device": "cuda" if torch.cuda.is_available() else "cpu (gloo)",
        "model": MODEL,
        "transfer_dtype": "bfloat16",
        "bucket_megabytes": args.bucket_megabytes,
        "results": records,
    }
    args.out.write_text(json.dumps(summary, indent=1))
    for record in records:
        methods = record["methods"]
        print(f"{record['layout']:>28}: " + "  ".join(
            f"{name} {m['seconds'] * 1e3:.1f} ms, {m['max_received_bytes'] / 2**20:.2f} MiB "
            f"(x{m['received_over_lower_bound'] or 0:.3f} of bound), peak {m['peak_extra_bytes'] / 2**20:.1f} MiB"
            for name, m in methods.items()))


if __name__ == "__main__":
    main()
