"""Rollout throughput and weight-push cost, embedded torch engine vs a real SGLang server, one run.

    python -m benchmarks.rollout --out rollout.json                 # random Llama (~8M params), ~2 min
    python -m benchmarks.rollout --model-path DIR --out rollout.json  # any HF folder, e.g. SmolLM2:
                                                                      # python -m engine.models.smollm2

Both engines get the same prompts and sampling settings (temperature 1, fixed length via
``ignore_eos``). Reported per engine: generated tokens/s (after one warm-up call) and, per bucket
size, the time of a full weight push and its seconds per MB. SGLang is skipped (with the reason in
the JSON) when it is not installed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from engine.config import RolloutConfig
from engine.rollout import RolloutEngine, SamplingParams, create_rollout_engine


def build_random_llama(directory: Path, seed: int = 0) -> Path:
    """A Llama with SmolLM2-like proportions, scaled down so the default run stays short."""
    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def make_prompts(vocab_size: int, num_prompts: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)]


def measure_generation(engine: RolloutEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    generated = sum(len(s.token_ids) for samples in results for s in samples)
    return {
        "generated_tokens": generated,
        "prompt_tokens": sum(len(p) for p in prompts) * params.n,
        "seconds": seconds,
        "tokens_per_s": generated / seconds,
    }


def measure_weight_push(engine: RolloutEngine, state: dict[str, torch.Tensor], bucket_megabytes: list[float]) -> list[dict[str, Any]]:
    rows = []
    for bucket in bucket_megabytes:
        stats = engine.update_weights(state.items(), bucket_megabytes=bucket)
        megabytes = stats.total_bytes / 2**20
        rows.append(
            {
                "bucket_megabytes": bucket,
                "buckets": stats.num_buckets,
                "megabytes": megabytes,
                "seconds": stats.seconds,
                "seconds_per_megabyte": stats.seconds / megabytes,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--model-path", help="HF model folder (default: a random ~8M-parameter Llama)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--bucket-megabytes", type=float, nargs="+", default=[1.0, 8.0, 64.0])
    parser.add_argument("--engines", nargs="+", default=["torch", "sglang"], choices=["torch", "sglang"])
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="trident_rollout_bench_") as scratch:
        report = run(args, Path(scratch))
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"[rollout bench] wrote {args.out}")


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model_path = Path(args.model_path) if args.model_path else build_random_llama(workdir / "model")
    model_config = transformers.AutoConfig.from_pretrained(model_path)
    prompts = make_prompts(model_config.vocab_size, args.num_prompts, 16, 64)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0, n=args.samples_per_prompt, ignore_eos=True)
    # New weights of the same shapes, pushed in full by every engine.
    new_state = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    new_state = {name: tensor + 1e-3 for name, tensor in new_state.items()}

    report: dict[str, Any] = {
        "model_path": str(model_path),
        "parameters": sum(t.numel() for t in new_state.values()),
        "num_prompts": args.num_prompts,
        "samples_per_prompt": args.samples_per_prompt,
        "max_new_tokens": args.max_new_tokens,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "engines": {},
    }
    for name in args.engines:
        if name == "sglang" and importlib.util.find_spec("sglang") is None:
            report["engines"][name] = {"skipped": "sglang is not installed (bash launch/install/sglang_cpu.sh .venv/bin/python)"}
            continue
        rollout = RolloutConfig(name=name, dtype="float32",
                                gpu_memory_utilization=0.05 if not torch.cuda.is_available() else 0.6)
        launch = {"run_dir": str(workdir / "sglang")} if name == "sglang" else {}
        start = time.perf_counter()
        engine = create_rollout_engine(rollout, str(model_path), **launch)
        entry: dict[str, Any] = {"startup_seconds": time.perf_counter() - start}
        try:
            entry["generation"] = measure_generation(engine, prompts, params)
            entry["weight_push_tensor"] = measure_weight_push(engine, new_state, args.bucket_megabytes)
            if name == "sglang":
                engine.weight_transport = "distributed"
                entry["weight_push_distributed"] = measure_weight_push(engine, new_state, args.bucket_megabytes)
        finally:
            engine.shutdown()
        report["engines"][name] = entry
        print(f"[rollout bench] {name}: {json.dumps(entry)}", flush=True)
    return report


if __name__ == "__main__":
    main()
