"""Tokens/s of the actor's PPO update per layout, beside a plain single-process transformers loop.

    python -m benchmarks.train_step --out FILE.json [--layouts 1,1,0 2,1,0 1,2,0] [--steps 3]

Both sides run the same update on the same batch: a tiny Llama from ``LlamaConfig`` (no hub
access), PPO clipped loss + entropy bonus from ``engine.algo``, AdamW, gradient accumulation over
micro-batches, one optimizer step per mini-batch. The baseline is transformers' model with
``torch.optim.AdamW`` on padded batches; the Megatron side is ``engine.roles.MegatronActor`` under
torchrun (gloo on CPU, NCCL on GPU) with sequence packing. Throughput counts real (unpadded)
tokens of the batch per second of update, after one warm-up update. The JSON holds
``{"baseline": {...}, "layouts": {name: {..., "tokens_per_s", "ratio_to_baseline"}}}``.
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

from parallel.state import find_free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


def model_config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads // 2,
        max_position_embeddings=2 * (args.prompt + args.response), tie_word_embeddings=False,
    )


def make_batch(args):
    """Left-padded prompts + right-padded responses of varied lengths (seeded)."""
    from engine.roles import RolloutBatch

    generator = torch.Generator().manual_seed(0)
    width = args.prompt + args.response
    input_ids = torch.randint(0, args.vocab, (args.batch, width), generator=generator)
    attention_mask = torch.zeros(args.batch, width, dtype=torch.long)
    for row in range(args.batch):
        p = int(torch.randint(args.prompt // 2, args.prompt + 1, (1,), generator=generator))
        r = int(torch.randint(args.response // 2, args.response + 1, (1,), generator=generator))
        attention_mask[row, args.prompt - p: args.prompt + r] = 1
    response_mask = attention_mask[:, args.prompt:].clone()
    old = -torch.rand(args.batch, args.response, generator=generator) * 5
    advantages = torch.randn(args.batch, args.response, generator=generator)
    return RolloutBatch(input_ids, attention_mask, response_mask, old_log_probs=old, advantages=advantages)


def actor_config(args, micro_batch_size_per_gpu: int):
    """The actor's settings of this benchmark: AdamW 1e-5, entropy bonus 0.01, the mini-batch as given."""
    from engine.config import ActorConfig, OptimConfig

    return ActorConfig(ppo_mini_batch_size=args.mini_batch, ppo_micro_batch_size_per_gpu=micro_batch_size_per_gpu,
                       entropy_coeff=0.01, optim=OptimConfig(lr=1e-5, betas=[0.9, 0.95]))


def baseline(args, hf_dir: Path) -> dict:
    """The same update as a plain transformers + torch.optim loop on one process."""
    from transformers import LlamaForCausalLM

    from engine.algo.losses import LossScale, compute_actor_loss

    torch.set_num_threads(args.threads)
    model = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.01)
    batch = make_batch(args)
    config = actor_config(args, args.micro_batch)
    response = args.response

    def update():
        for start in range(0, args.batch, args.mini_batch):
            mini = batch.select(range(start, start + args.mini_batch))
            scale = LossScale.from_response_masks([mini.response_mask])
            optimizer.zero_grad()
            for mb_start in range(0, args.mini_batch, args.micro_batch):
                mb = mini.select(range(mb_start, mb_start + args.micro_batch))
                positions = (mb.attention_mask.cumsum(-1) - 1).clamp(min=0)
                logits = model(mb.input_ids, attention_mask=mb.attention_mask, position_ids=positions).logits
                logits = logits[:, -response - 1:-1].float()
                log_softmax = torch.log_softmax(logits, -1)
                log_probs = log_softmax.gather(-1, mb.input_ids[:, -response:, None])[..., 0]
                entropy = -(log_softmax.exp() * log_softmax).sum(-1)
                out = compute_actor_loss(mb.old_log_probs, log_probs, mb.advantages, mb.response_mask, config,
                                         scale, entropy=entropy)
                out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

    update()  # warm-up
    start = time.perf_counter()
    for _ in range(args.steps):
        update()
    seconds = (time.perf_counter() - start) / args.steps
    tokens = int(batch.attention_mask.sum())
    return {"seconds_per_update": seconds, "tokens_per_update": tokens, "tokens_per_s": tokens / seconds}


def worker(args) -> None:
    """Runs under torchrun: one layout's actor update, timed; rank 0 writes --worker-out."""
    from parallel.layout import ParallelLayout
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    tp, pp, vpp = (int(x) for x in args.layout.split(","))
    layout = ParallelLayout(tp, pp, vpp or None)
    initialize_model_parallel(layout, seed=1)
    from megatron.core import parallel_state

    from engine.models.checkpoint import load_hf_weights
    from engine.models.gpt import build_model_chunks
    from engine.roles import MegatronActor, MicroBatchConfig

    chunks = build_model_chunks(args.hf_dir, layout,
                                params_dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32)
    load_hf_weights(chunks, args.hf_dir)
    dp = parallel_state.get_data_parallel_world_size()
    config = actor_config(args, max(1, args.micro_batch // dp))
    actor = MegatronActor(chunks, config, log_prob_batches=MicroBatchConfig(), samples_per_prompt=1,
                          total_optimizer_steps=100, seed=1, use_remove_padding=True)
    batch = make_batch(args)
    actor.update_policy(batch, temperature=1.0)  # warm-up
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        actor.update_policy(batch, temperature=1.0)
    torch.distributed.barrier()
    seconds = (time.perf_counter() - start) / args.steps
    if torch.distributed.get_rank() == 0:
        tokens = int(batch.attention_mask.sum())
        Path(args.worker_out).write_text(json.dumps({
            "world_size": torch.distributed.get_world_size(), "data_parallel_size": dp,
            "seconds_per_update": seconds, "tokens_per_update": tokens, "tokens_per_s": tokens / seconds,
        }))
    destroy_model_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="JSON file for the results")
    parser.add_argument("--layouts", nargs="+", default=["1,1,0", "2,1,0", "1,2,0"], help="tp,pp,vpp (vpp 0 = none)")
    parser.add_argument("--steps", type=int, default=3, help="timed updates after one warm-up")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--mini-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1")),
                        help="torch threads of the baseline; each torchrun rank gets OMP_NUM_THREADS=1")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--hf-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.out is None:
        parser.error("--out FILE.json is required")
    if args.batch % args.mini_batch or args.mini_batch % args.micro_batch:
        parser.error("--batch must be a multiple of --mini-batch, and --mini-batch of --micro-batch")

    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        LlamaForCausalLM(model_config(args)).save_pretrained(hf_dir)
        report = {"settings": {k: v for k, v in vars(args).items() if k not in ("worker", "layout", "hf_dir", "worker_out", "out")},
                  "device": "cuda" if torch.cuda.is_available() else "cpu",
                  "baseline": baseline(args, hf_dir), "layouts": {}}
        for layout in args.layouts:
            tp, pp, _ = (int(x) for x in layout.split(","))
            worker_out = Path(tmp) / f"{layout.replace(',', '_')}.json"
            command = [sys.executable, "-m", "launch.torchrun", f"--nproc_per_node={tp * pp}",
                       "--master_addr=127.0.0.1", f"--master_port={find_free_port()}", "-m", "benchmarks.train_step",
                       "--worker", "--layout", layout, "--hf-dir", str(hf_dir), "--worker-out", str(worker_out),
                       *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                         ("steps", "batch", "mini_batch", "micro_batch", "prompt", "response", "vocab")]]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
            done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                report["layouts"][layout] = {"error": done.stderr[-2000:]}
                continue
            result = json.loads(worker_out.read_text())
            result["ratio_to_baseline"] = result["tokens_per_s"] / report["baseline"]["tokens_per_s"]
            report["layouts"][layout] = result
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
