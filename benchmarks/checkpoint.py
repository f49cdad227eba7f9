"""What a checkpoint save costs: synchronous vs ``trainer.checkpoint.async_save``, and the two
distributed-optimizer formats (``trainer.checkpoint.optimizer_format``).

    python -m benchmarks.checkpoint --out DIR [--ranks 2] [--hidden 512] [--layers 8] [--repeats 2]

One torchrun job (``--ranks`` ranks, data parallel, megatron DDP + distributed Adam, fp32 on CPU,
bf16 on GPUs) trains a Llama-shaped megatron GPT and saves it with Trident's ``CheckpointManager``
in both modes, alternately, in the same processes (so the baseline is measured beside the change):

- ``stall_s``: how long ``save()`` blocks the training loop (async: until every rank's tensors are
  set aside and the writer has started);
- ``complete_s``: from the save's start until the checkpoint is complete (manifest, rename,
  ``latest``), training steps running meanwhile with ``finalize()`` at each step boundary as the
  PPO loop does;
- ``steps_while_writing`` and ``slowdown_s``: the training steps that ran before it was complete,
  and how much longer they took in all than as many steps without a save (the writer shares the
  machine's cores and disk);
- ``training_lost_s`` = ``stall_s`` + ``slowdown_s``: what the save cost the training loop.

Then each optimizer format, saved synchronously (issue 45, defect 6):

- ``save_s``: the save's time;
- ``host_peak_gb``: the largest rise of a rank's resident host memory during the save over its
  resident memory before (sampled every 2 ms; the largest over the ranks): ``fully_reshardable``
  gathers the whole data-parallel group's Adam state on every rank, ``dp_reshardable`` writes each
  rank's shard as it is;
- ``device_peak_gb`` (GPUs): the same for allocated device memory;
- ``checkpoint_bytes``.

Each number is the median over ``--repeats`` saves (after one warm-up save of each).
Writes ``DIR/checkpoint.json`` and prints it; the checkpoints themselves are deleted at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SEQ = 128
MICRO_BATCHES = 2
MODES = ("sync", "async")
SAMPLE_S = 0.002


def hf_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                       max_position_embeddings=SEQ, tie_word_embeddings=False)


def build(args):
    """The model, its distributed optimizer and a function that runs one training step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from engine.models.gpt import build_model_chunks
    from engine.trainer.checkpoint import CheckpointTarget
    from parallel.layout import ParallelLayout

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    chunks = build_model_chunks(hf_config(args), ParallelLayout(), params_dtype=dtype)
    config = chunks[0].config
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True)
    chunks = [DistributedDataParallel(config, ddp, chunk) for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, use_distributed_optimizer=True,
                                                       bf16=dtype == torch.bfloat16, params_dtype=dtype), chunks)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, 4096, (MICRO_BATCHES, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(SEQ, device=device).unsqueeze(0)

    def forward_step(iterator, model):
        batch = next(iterator)
        output = model(batch, positions, None, labels=batch)
        return output, lambda out: (out.float().mean(), {})

    def train_step() -> float:
        start = time.perf_counter()
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(tokens.split(1)),
                                    model=chunks[0], num_microbatches=MICRO_BATCHES, seq_length=SEQ,
                                    micro_batch_size=1, forward_only=False)
        optimizer.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return {"actor": CheckpointTarget(chunks, optimizer)}, train_step


def measure(manager, targets, train_step, step: int, baseline_step_s: float) -> dict:
    from engine.trainer.checkpoint import METADATA_FILE

    import torch.distributed as dist

    started = time.perf_counter()
    final_dir = manager.save(step, targets, extra_state={"step": step})
    stall = time.perf_counter() - started
    steps, stepping = 0, 0.0
    while True:
        manager.finalize()  # at the step boundary, as the PPO loop does
        # Complete on every rank at once (finalize is collective); rank 0 decides for all.
        complete = torch.tensor([float((final_dir / METADATA_FILE).exists())])
        dist.broadcast(complete, src=0)
        if complete.item():
            break
        stepping += train_step()
        steps += 1
    complete_s = time.perf_counter() - started
    slowdown = max(0.0, stepping - steps * baseline_step_s)
    return {"stall_s": stall, "complete_s": complete_s, "steps_while_writing": steps, "slowdown_s": slowdown,
            "training_lost_s": stall + slowdown}


def save_with_peaks(manager, targets, step: int) -> dict:
    """One synchronous save, timed, with the rise of resident host memory (and allocated device
    memory) it caused on this rank, the largest over the ranks."""
    import threading

    import psutil
    import torch.distributed as dist

    process = psutil.Process()

    def resident_bytes() -> int:
        return process.memory_info().rss

    before, peak, done = resident_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], resident_bytes())
            done.wait(SAMPLE_S)

    sampler = threading.Thread(target=sample, daemon=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    device_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    sampler.start()
    started = time.perf_counter()
    final_dir = manager.save(step, targets, extra_state={"step": step})
    seconds = time.perf_counter() - started
    done.set()
    sampler.join()
    device_peak = torch.cuda.max_memory_allocated() - device_before if torch.cuda.is_available() else 0
    rises = torch.tensor([float(max(peak[0], resident_bytes()) - before), float(device_peak), seconds])
    dist.all_reduce(rises, op=dist.ReduceOp.MAX)
    from engine.trainer.checkpoint import MANIFEST_KEY, read_checkpoint_metadata

    size = sum(size for size, _ in read_checkpoint_metadata(final_dir)[MANIFEST_KEY].values())
    return {"save_s": rises[2].item(), "host_peak_gb": rises[0].item() / 2**30,
            "device_peak_gb": rises[1].item() / 2**30, "checkpoint_bytes": size}


def worker(args) -> None:
    import torch.distributed as dist

    from engine.config.trainer import OPTIMIZER_FORMATS
    from engine.trainer.checkpoint import CheckpointManager, MANIFEST_KEY, latest_checkpoint, read_checkpoint_metadata
    from parallel.layout import ParallelLayout
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    initialize_model_parallel(ParallelLayout(), seed=1)
    targets, train_step = build(args)
    for _ in range(2):
        train_step()  # warm-up (and the optimizer's state exists)
    baseline = statistics.median(train_step() for _ in range(5))
    managers = {mode: CheckpointManager(Path(args.out) / "checkpoints" / mode, async_save=mode == "async")
                for mode in MODES}
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    step = 0
    for repeat in range(args.repeats + 1):  # the first round warms up
        for mode in MODES:
            step += 1
            measured = measure(managers[mode], targets, train_step, step, baseline)
            if repeat:
                results[mode].append(measured)
    for manager in managers.values():
        manager.close()
    by_format = {name: CheckpointManager(Path(args.out) / "checkpoints" / name, optimizer_format=name)
                 for name in OPTIMIZER_FORMATS}
    formats: dict[str, list[dict]] = {name: [] for name in OPTIMIZER_FORMATS}
    for repeat in range(args.repeats + 1):
        for name, manager in by_format.items():
            step += 1
            measured = save_with_peaks(manager, targets, step)
            if repeat:
                formats[name].append(measured)
    if dist.get_rank() == 0:
        latest = read_checkpoint_metadata(latest_checkpoint(Path(args.out) / "checkpoints" / "sync"))
        report = {
            "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
                        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"},
            "ranks": dist.get_world_size(), "hidden": args.hidden, "layers": args.layers,
            "checkpoint_bytes": sum(size for size, _ in latest[MANIFEST_KEY].values()),
            "baseline_step_s": baseline, "repeats": args.repeats,
            "modes": {mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                      for mode, runs in results.items()},
            "optimizer_formats": {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                                  for name, runs in formats.items()},
        }
        Path(args.out, "checkpoint.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
        shutil.rmtree(Path(args.out) / "checkpoints")  # GBs of by-product; the numbers are the result
    destroy_model_parallel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from parallel.state import find_free_port

    args.out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "launch.torchrun", f"--nproc_per_node={args.ranks}", "--master_addr=127.0.0.1",
               f"--master_port={find_free_port()}", "-m", "benchmarks.checkpoint", "--worker", "--out", str(args.out),
               "--hidden", str(args.hidden), "--layers", str(args.layers), "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(command, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
