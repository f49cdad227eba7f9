"""Benchmark: the three ways the actor's weights reach SGLang, on the same model and layout.

    python -m benchmarks.weight_push --out DIR [--models tiny demo] [--repeats 3] [--lora-rank 8]

One torchrun launch of 2 ranks per model: the actor at training TP 2 with LoRA adapters (B drawn
non-zero, so that the adapters change the outputs), and one real SGLang server at generation TP 2
with LoRA enabled (on CPU: SGLang's CPU engine, gloo). Each mode pushes into the same server, the
adapters first (on the base weights the server loaded), then the merged weights both ways:

- ``full``: whole HF tensors on both generation ranks (``weight_sync_target=full``), LoRA merged;
- ``sharded``: each rank its own SGLang shard, handed to its own TP worker (``weight_sync_target=sharded``);
- ``adapters``: the LoRA adapters only (``lora_sync=adapters``), the server keeping its base weights.

Per mode: ``seconds`` (median over ``--repeats`` after a warm-up, slowest rank: reshard + hand-over +
the server's load), ``max_received_bytes`` (bytes a rank receives from other ranks, measured by the
executor; the adapters: their size), ``lower_bound_bytes`` (the plan's), ``engine_bytes_per_gpu``
(what each GPU's SGLang worker loads), ``peak_extra_bytes`` (the sync's staging peak on a rank), and
the greedy tokens of three probe prompts after the push (the modes must agree). The planner's
extrapolation of each mode to ``yaml/llama3-70b_ppo_8node.yaml`` and
``yaml/llama3-70b_lora_grpo_1node.yaml`` (bf16, H100 layout) is added. Writes ``DIR/weight_push.json``
and ``DIR/weight_push.png``.

Models: ``tiny`` (a random Llama: vocab 8192, hidden 256, 4 layers, as benchmarks.reshard) and
``demo`` (the demo's SFT'd tiny Llama, prepared as ``make demo`` does).
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

from benchmarks.reshard import _max_over_ranks
from parallel.state import find_free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
MODES = ("full", "sharded", "adapters")
# The adapters first, while the server still holds its base weights (the merged pushes replace them).
PUSH_ORDER = ("adapters", "full", "sharded")
PROBES = [[5, 6, 7], [9, 3, 12, 4], [20, 21]]
EXTRAPOLATED = ("yaml/llama3-70b_ppo_8node.yaml", "yaml/llama3-70b_lora_grpo_1node.yaml")


def tiny_model(directory: Path) -> Path:
    import torch
    import transformers

    from benchmarks.reshard import MODEL

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL, bos_token_id=1, eos_token_id=2)).save_pretrained(directory)
    return directory


# ------------------------------------------------------------------------------------ worker


def merged_reference(hf_dir: str, state_dict: dict, folder: Path):
    """transformers' model of the actor (the merged HF export), for the probes' log-probs."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(hf_dir) / "config.json", folder)
    save_file(state_dict, str(folder / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def reference_log_probs(model, prompt: list[int], response: list[int]):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].double()
    predicted = logits[len(prompt) - 1: len(prompt) + len(response) - 1]
    return torch.log_softmax(predicted, dim=-1).gather(1, torch.tensor(response).view(-1, 1)).squeeze(1)


def bench_model(hf_dir: str, run_dir: str, repeats: int, lora_rank: int) -> dict:
    import torch
    import torch.distributed as dist

    from engine.config import RolloutConfig
    from engine.models.checkpoint import load_hf_weights
    from engine.models.gpt import build_model_chunks
    from engine.models.lora import LoRASettings, add_lora, adapters
    from engine.rollout.base import SamplingParams
    from engine.sync import WeightSynchronizer
    from parallel.layout import ParallelLayout
    from engine.rollout import create_rollout_engine
    from parallel.state import initialize_model_parallel

    layout = ParallelLayout(tensor_model_parallel_size=2)
    initialize_model_parallel(layout, seed=5)
    chunks = build_model_chunks(hf_dir, layout)
    load_hf_weights(chunks, hf_dir)  # the base the server loads too: the adapters push relies on it
    settings = LoRASettings(lora_rank, 2.0 * lora_rank)
    add_lora(chunks, settings)
    with torch.no_grad():
        for chunk in chunks:
            for index, (_, adapter) in enumerate(adapters(chunk)):
                # B is split over TP for column-parallel layers, whole (the same on every rank) otherwise.
                seed = 2 * index + 1 + (1000 * adapter.tp_rank if adapter.column_parallel else 0)
                generator = torch.Generator().manual_seed(seed)
                adapter.lora_B.copy_(torch.randn(adapter.lora_B.shape, generator=generator) * 0.02)
    syncs = {mode: WeightSynchronizer(chunks, layout, RolloutConfig(
        name="sglang", tensor_model_parallel_size=2, dtype="float32", update_weights_bucket_megabytes=64,
        weight_sync_target="full" if mode == "full" else "sharded", lora_sync="adapters" if mode == "adapters" else "merged"),
        target="full" if mode == "full" else "sharded") for mode in MODES}
    from engine.models.checkpoint import export_hf_state_dict

    merged = export_hf_state_dict(chunks)  # the actor as one HF model (adapters merged), on rank 0
    reference = merged_reference(hf_dir, merged, Path(run_dir) / "merged") if merged else None
    engine = None
    if syncs["full"].is_replica_leader:
        engine = create_rollout_engine(RolloutConfig(name="sglang", tensor_model_parallel_size=2, dtype="float32",
                                                     gpu_memory_utilization=0.05, weight_update_timeout_s=300),
                                       hf_dir, run_dir=run_dir, lora=settings)
    result: dict = {"model_bytes": syncs["full"].plan.model_bytes(), "modes": {}}
    for mode in PUSH_ORDER:
        sync = syncs[mode]
        times, report = [], None
        for _ in range(repeats + 1):  # the first is the warm-up
            dist.barrier()
            start = time.perf_counter()
            report = sync.sync(engine)
            times.append(_max_over_ranks(time.perf_counter() - start))
        tokens, gap = None, None
        if engine is not None:
            samples = [sample for (sample,) in engine.generate(
                PROBES, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))]
            tokens = [sample.token_ids for sample in samples]
            gap = max(float((reference_log_probs(reference, prompt, sample.token_ids)
                             - torch.tensor(sample.log_probs, dtype=torch.float64)).abs().max())
                      for prompt, sample in zip(PROBES, samples))
        result["modes"][mode] = {
            "seconds": statistics.median(times[1:] or times),
            "max_received_bytes": int(_max_over_ranks(report.stats.bytes_received)),
            "lower_bound_bytes": int(_max_over_ranks(report.lower_bound_bytes)),
            "engine_bytes_per_gpu": int(_max_over_ranks(report.stats.bytes_output)),
            "peak_extra_bytes": int(_max_over_ranks(report.stats.peak_staging_bytes or report.stats.bytes_output)),
            "probe_tokens": tokens,
            "max_log_prob_gap_to_transformers": gap,
        }
    if engine is not None:
        engine.shutdown()
    return result


def worker(args) -> None:
    import torch.distributed as dist

    from engine.lifecycle import start_reaper
    from parallel.state import destroy_model_parallel

    start_reaper()  # the SGLang server goes with this rank, however it ends
    record = bench_model(args.hf_dir, args.run_dir, args.repeats, args.lora_rank)
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(record))
    destroy_model_parallel()


# ------------------------------------------------------------------------------------ driver


def launch(hf_dir: Path, run_dir: Path, repeats: int, lora_rank: int, timeout: float) -> dict:
    out = run_dir / "record.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "launch.torchrun", "--nproc_per_node=2", f"--master_port={find_free_port()}",
               "-m", "benchmarks.weight_push", "--worker-out", str(out), "--hf-dir", str(hf_dir), "--run-dir",
               str(run_dir), "--repeats", str(repeats), "--lora-rank", str(lora_rank)]
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if completed.returncode != 0:
        raise SystemExit(f"torchrun x2 failed (logs in {run_dir}):\n{completed.stdout[-4000:]}\n{completed.stderr[-8000:]}")
    return json.loads(out.read_text())


def extrapolated() -> dict:
    """The planner's bytes per GPU per sync of each mode for the 70B experiments."""
    from launch.plan import make_plan

    plans = {}
    for experiment in EXTRAPOLATED:
        report = make_plan(experiment)
        plans[experiment] = {"bytes_per_gpu_by_mode": report.sync_bytes_by_mode, "loop_mode": report.loop_sync_mode,
                             "model_bytes": int(report.memory.sync.model_bytes)}
    return plans


def plot(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    models = list(results["models"])
    figure, (bytes_axis, time_axis) = pyplot.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(MODES)
    for index, mode in enumerate(MODES):
        positions = [m + index * width for m in range(len(models))]
        bytes_axis.bar(positions, [max(1, results["models"][m]["modes"][mode]["engine_bytes_per_gpu"]) / 2**20
                                   for m in models], width, label=f"{mode}: loaded per GPU")
        bytes_axis.scatter(positions, [max(1e-3, results["models"][m]["modes"][mode]["max_received_bytes"] / 2**20)
                                       for m in models], color="black", marker="x", zorder=3)
        time_axis.bar(positions, [results["models"][m]["modes"][mode]["seconds"] for m in models], width, label=mode)
    for axis in (bytes_axis, time_axis):
        axis.set_xticks([m + width * (len(MODES) - 1) / 2 for m in range(len(models))], models)
    bytes_axis.set_yscale("log")
    bytes_axis.set_ylabel("MiB per GPU per sync (x: received from other GPUs)")
    time_axis.set_ylabel("seconds per sync (CPU, SGLang TP2)")
    bytes_axis.legend(fontsize=8)
    time_axis.legend(fontsize=8)
    figure.tight_layout()
    path = out / "weight_push.png"
    figure.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results folder")
    parser.add_argument("--models", nargs="+", default=["tiny", "demo"], choices=["tiny", "demo"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        worker(args)
        return
    if args.out is None:
        parser.error("--out DIR is required")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"models": {}, "lora_rank": args.lora_rank, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            if model == "tiny":
                hf_dir = tiny_model(Path(scratch) / "tiny")
            else:
                from launch.prepare_demo_model import prepare_demo_model

                hf_dir = prepare_demo_model(REPO_ROOT / ".cache" / "models" / "demo-arith").model_dir
            run_dir = args.out / f"run_{model}"
            run_dir.mkdir(exist_ok=True)
            print(f"[weight_push] {model}: 3 modes x {args.repeats + 1} pushes into SGLang TP2 (logs in {run_dir})", flush=True)
            record = launch(Path(hf_dir), run_dir, args.repeats, args.lora_rank, args.timeout)
            tokens = {mode: record["modes"][mode]["probe_tokens"] for mode in MODES}
            record["modes_agree"] = tokens["full"] == tokens["sharded"] == tokens["adapters"]
            results["models"][model] = record
    results["extrapolated"] = extrapolated()
    (args.out / "weight_push.json").write_text(json.dumps(results, indent=1))
    print(json.dumps({model: {mode: {k: v for k, v in r.items() if k != "probe_tokens"} for mode, r in record["modes"].items()}
                      for model, record in results["models"].items()}, indent=1))
    print(f"[weight_push] wrote {args.out / 'weight_push.json'} and {plot(results, args.out)}")


if __name__ == "__main__":
    main()
