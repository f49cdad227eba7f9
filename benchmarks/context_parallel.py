"""Per-rank activation peak and step time of one long packed batch at context parallelism 1, 2 and 4.

    python -m benchmarks.context_parallel --out DIR [--cp 1 2 4] [--comm a2a p2p] [--tokens 4096]

One torchrun world per (CP, comm type), as many ranks as CP (data parallel 1), each running the actor's
PPO update (``engine.roles.MegatronActor``) on the same batch: a tiny Llama from ``LlamaConfig`` and
sequences of ``--tokens`` tokens in all, packed into one micro-batch (THD rows). Per rank:

- ``activation_peak_mib``: the most bytes the micro-batch's forward pass saved for its backward (model
  and loss), counted by ``torch.autograd.graph.saved_tensors_hooks`` as distinct storages: what the
  update holds between forward and backward, the quantity CP divides;
- ``peak_rss_mib``: the process's peak resident memory (``VmHWM``, reset before the timed updates), for
  what the allocator really took;
- ``seconds_per_update``: wall time of one update after a warm-up, slowest rank.

``DIR/context_parallel.json`` holds every run and each one's ratio to CP1's activation peak;
``DIR/context_parallel.png`` plots them. On CPU the comm types run the stand-in for Transformer
Engine's kernels (``parallel.context_parallel``); CP4 puts 4 ranks on however many cores there are.
``--comm`` takes the comm types that run packed rows (``parallel.layout.PACKED_ROW_COMM_TYPES``):
Transformer Engine's all_gather refuses them, and so does the stand-in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.load_memory import reset_peak_rss, status_kib
from parallel.layout import PACKED_ROW_COMM_TYPES
from parallel.state import find_free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


def make_batch(args):
    """``--sequences`` sequences (prompt 64, response the rest) of ``--tokens`` tokens in all, seeded."""
    from engine.roles import RolloutBatch

    generator = torch.Generator().manual_seed(0)
    prompt, response = 64, args.tokens // args.sequences - 64
    input_ids = torch.randint(0, args.vocab, (args.sequences, prompt + response), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    response_mask = attention_mask[:, prompt:].clone()
    old = -torch.rand(args.sequences, response, generator=generator) * 5
    advantages = torch.randn(args.sequences, response, generator=generator)
    return RolloutBatch(input_ids, attention_mask, response_mask, old_log_probs=old, advantages=advantages)


class SavedActivations:
    """The bytes of distinct storages saved for backward since the last model forward began, and
    their peak: the forward of one micro-batch starts a new count (its predecessor's backward ran)."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.peak = 0

    def start_forward(self, *_args) -> None:
        self.live = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.live[storage.data_ptr()] = storage.nbytes()
        self.peak = max(self.peak, sum(self.live.values()))
        return tensor


def worker(args) -> None:
    """Under torchrun: one CP size's update, measured; rank 0 writes --worker-out."""
    import torch.distributed as dist

    from parallel.layout import ParallelLayout
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    layout = ParallelLayout(context_parallel_size=args.cp_size, cp_comm_type=args.comm_type)
    initialize_model_parallel(layout, seed=1)
    from engine.config import ActorConfig, OptimConfig
    from engine.models.checkpoint import load_hf_weights
    from engine.models.gpt import build_model_chunks
    from engine.roles import MegatronActor, MicroBatchConfig

    chunks = build_model_chunks(args.hf_dir, layout)
    load_hf_weights(chunks, args.hf_dir)
    batch = make_batch(args)
    config = ActorConfig(ppo_mini_batch_size=args.sequences, ppo_micro_batch_size_per_gpu=args.sequences,
                         entropy_coeff=0.01, optim=OptimConfig(lr=1e-5))
    actor = MegatronActor(chunks, config, log_prob_batches=MicroBatchConfig(), samples_per_prompt=1,
                          total_optimizer_steps=100, seed=1, use_remove_padding=True)
    actor.update_policy(batch, temperature=1.0)  # warm-up
    saved = SavedActivations()
    hook = chunks[0].register_forward_pre_hook(saved.start_forward)
    reset_peak_rss()
    dist.barrier()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda tensor: tensor):
        for _ in range(args.steps):
            actor.update_policy(batch, temperature=1.0)
    seconds = torch.tensor([(time.perf_counter() - start) / args.steps])
    hook.remove()
    rank = {"activation_peak_mib": saved.peak / 2**20, "peak_rss_mib": status_kib("VmHWM") / 1024}
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rank)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps({
            "cp": args.cp_size, "cp_comm_type": args.comm_type, "tokens": int(batch.attention_mask.sum()),
            "seconds_per_update": float(seconds), "ranks": ranks,
            "max_activation_peak_mib": max(r["activation_peak_mib"] for r in ranks),
            "max_peak_rss_mib": max(r["peak_rss_mib"] for r in ranks)}))
    destroy_model_parallel()


def plot(report: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, (memory_axis, time_axis) = pyplot.subplots(1, 2, figsize=(10, 4))
    for comm in report["settings"]["comm"]:
        runs = [run for run in report["runs"] if run["cp_comm_type"] == comm or run["cp"] == 1]
        sizes = [run["cp"] for run in runs]
        memory_axis.plot(sizes, [run["max_activation_peak_mib"] for run in runs], marker="o", label=f"{comm}: activations")
        memory_axis.plot(sizes, [run["max_peak_rss_mib"] for run in runs], marker="x", linestyle=":",
                         label=f"{comm}: peak RSS")
        time_axis.plot(sizes, [run["seconds_per_update"] for run in runs], marker="o", label=comm)
    memory_axis.set_xlabel("context_parallel_size")
    memory_axis.set_ylabel("MiB per rank (largest rank)")
    time_axis.set_xlabel("context_parallel_size")
    time_axis.set_ylabel(f"seconds per update ({report['device']})")
    for axis in (memory_axis, time_axis):
        axis.set_xticks(sorted({run["cp"] for run in report["runs"]}))
        axis.legend(fontsize=8)
    figure.suptitle(f"{report['settings']['tokens']} tokens in one packed micro-batch")
    figure.tight_layout()
    path = out / "context_parallel.png"
    figure.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="results folder")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm", nargs="+", default=["a2a"], choices=PACKED_ROW_COMM_TYPES,
                        help="cp_comm_type(s) for CP > 1 (the batch is packed: p2p needs Transformer Engine)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the batch, all in one micro-batch")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2, help="measured updates after one warm-up")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", help=argparse.SUPPRESS)
    parser.add_argument("--cp-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--comm-type", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_out:
        worker(args)
        return
    if args.out is None:
        parser.error("--out DIR is required")
    if args.tokens % (args.sequences * 2 * max(args.cp)):
        parser.error(f"--tokens must split into --sequences sequences of a multiple of 2 x {max(args.cp)} tokens")
    import transformers

    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
            max_position_embeddings=args.tokens, tie_word_embeddings=False)).save_pretrained(hf_dir)
        for cp in args.cp:
            for comm in (args.comm if cp > 1 else ["a2a"]):  # (CP 1 runs megatron's own attention)
                worker_out = Path(tmp) / f"cp{cp}_{comm}.json"
                print(f"[context_parallel] CP{cp} {comm if cp > 1 else ''}...", flush=True)
                command = [sys.executable, "-m", "launch.torchrun", f"--nproc_per_node={cp}", "--master_addr=127.0.0.1",
                           f"--master_port={find_free_port()}", "-m", "benchmarks.context_parallel",
                           "--worker-out", str(worker_out), "--hf-dir", str(hf_dir), f"--cp-size={cp}",
                           f"--comm-type={comm}", *[f"--{k}={getattr(args, k)}" for k in
                                                    ("tokens", "sequences", "steps", "vocab")]]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
                done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"CP{cp} {comm} failed:\n{done.stderr[-3000:]}")
                runs.append(json.loads(worker_out.read_text()))
    baseline = next(run for run in runs if run["cp"] == 1)
    for run in runs:
        run["activation_peak_vs_cp1"] = run["max_activation_peak_mib"] / baseline["max_activation_peak_mib"]
        run["seconds_vs_cp1"] = run["seconds_per_update"] / baseline["seconds_per_update"]
    report = {"settings": {k: v for k, v in vars(args).items() if k in (
                  "cp", "comm", "tokens", "sequences", "steps", "hidden", "layers", "heads", "vocab")},
              "device": "cuda" if torch.cuda.is_available() else "cpu", "runs": runs}
    (args.out / "context_parallel.json").write_text(json.dumps(report, indent=2))
    figure = plot(report, args.out)
    for run in runs:
        print(f"CP{run['cp']} {run['cp_comm_type'] if run['cp'] > 1 else '':10s} activations {run['max_activation_peak_mib']:8.1f} "
              f"MiB/rank ({run['activation_peak_vs_cp1']:.2f}x CP1), peak RSS {run['max_peak_rss_mib']:7.0f} MiB, "
              f"{run['seconds_per_update']:.2f} s/update")
    print(f"wrote {args.out / 'context_parallel.json'} and {figure}")


if __name__ == "__main__":
    main()
