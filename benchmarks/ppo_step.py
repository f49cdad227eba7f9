"""Tokens/s per PPO stage and end to end for the demo workload, per layout, beside a 1-rank baseline.

    python -m benchmarks.ppo_step --out FILE.json [--steps 6] [--layouts dp1 dp2 tp2]

Each layout is a real ``launch.main`` job on ``yaml/demo_cpu.yaml`` (the ``make demo`` model,
data and hyper-parameters, validation and checkpoints off) under torchrun; the numbers come
from the job's own ``metrics.jsonl`` (``timing_s/*``). The first iteration is a warm-up and is
dropped; each stage reports its median time over the rest and the tokens it processed per
second: generated response tokens for ``gen``, prompt + response tokens for the forward passes
and updates (for the updates once per PPO epoch), all tokens of the step for ``step``. The
baseline is the same job on one rank; ``ratio_to_baseline`` is end-to-end tokens/s over the
baseline's (wall-clock, so on 2 CPU cores two ranks compete for the same cores).
The JSON holds ``{"workload": {...}, "layouts": {name: {"stages": {stage: {...}}, ...}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from parallel.state import find_free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = "yaml/demo_cpu.yaml"
# name -> (ranks, training TP)
LAYOUTS = {"dp1": (1, 1), "dp2": (2, 1), "tp2": (2, 2)}
FORWARD_STAGES = ("old_log_prob", "ref", "values")
UPDATE_STAGES = ("update_critic", "update_actor")


def run_job(name: str, steps: int, run_dir: Path) -> list[dict]:
    ranks, tp = LAYOUTS[name]
    overrides = [f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
                 f"trainer.n_gpus_per_node={ranks}", "trainer.save_freq=-1", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.export_hf_at_end=false", "trainer.resume_mode=disable",
                 "trainer.logger=[jsonl]", f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
                 f"critic.megatron.tensor_model_parallel_size={tp}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
               f"--master_port={find_free_port()}", "-m", "launch.main", EXPERIMENT, *overrides]
    print(f"[ppo_step] {name}: {' '.join(command[2:])}", file=sys.stderr, flush=True)
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"[ppo_step] {name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "timing_s/step" in row]


def summarise(rows: list[dict], ppo_epochs: int, batch_rows: int) -> dict:
    timed = rows[1:]  # the first iteration builds caches and warms the allocator
    total_tokens = statistics.median(r["perf/total_num_tokens"] for r in timed)
    response_tokens = statistics.median(r["response_length/mean"] * batch_rows for r in timed)
    tokens = {"gen": response_tokens, "step": total_tokens,
              **{stage: total_tokens for stage in FORWARD_STAGES},
              **{stage: total_tokens * ppo_epochs for stage in UPDATE_STAGES}}
    stages = {}
    for key in sorted({k for r in timed for k in r if k.startswith("timing_s/")}):
        stage = key.removeprefix("timing_s/")
        seconds = statistics.median(r[key] for r in timed)
        entry = {"median_s": seconds, "share_of_step": seconds / statistics.median(r["timing_s/step"] for r in timed)}
        if stage in tokens:
            entry.update(tokens=tokens[stage], tokens_per_s=tokens[stage] / seconds)
        stages[stage] = entry
    return {"timed_steps": len(timed), "stages": stages, "tokens_per_s": stages["step"]["tokens_per_s"],
            "mean_score": statistics.fmean(r["critic/score/mean"] for r in timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results")
    parser.add_argument("--steps", type=int, default=6, help="PPO iterations per job (the first is a warm-up)")
    parser.add_argument("--layouts", nargs="+", default=["dp2", "tp2"], choices=sorted(set(LAYOUTS) - {"dp1"}),
                        help="layouts timed against the 1-rank baseline")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first iteration is a warm-up)")

    from engine.config import load_config
    from launch.prepare_demo_model import prepare_demo_model

    prepare_demo_model()  # the folder yaml/demo_cpu.yaml reads
    cfg = load_config(REPO_ROOT / EXPERIMENT)
    ppo_epochs = cfg.actor_rollout_ref.actor.ppo_epochs
    batch_rows = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    report = {"workload": {"experiment": EXPERIMENT, "steps": args.steps, "batch_rows": batch_rows,
                           "ppo_epochs": ppo_epochs, "max_response_length": cfg.data.max_response_length,
                           "cpu_count": os.cpu_count()},
              "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["dp1", *args.layouts]:
            report["layouts"][name] = summarise(run_job(name, args.steps, Path(tmp) / name), ppo_epochs, batch_rows)
    base = report["layouts"]["dp1"]["tokens_per_s"]
    for entry in report["layouts"].values():
        entry["ratio_to_baseline"] = entry["tokens_per_s"] / base
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
