"""Colocated vs disaggregated rollout, on-policy, off-policy and with partial rollouts, on one workload.

    python -m benchmarks.async_rollout --out DIR [--steps 8] [--warmup 2] [--prompts 64] [--response 32]
                                       [--trainer-cpus 0] [--server-cpus 1] [--workload demo|long_tail]

Real PPO jobs (one trainer rank and SGLang), run one after the other. ``--workload demo``: the demo
model on its prompts (every response 3-5 tokens). ``long_tail``: a random 2-layer Llama of the demo's
character vocabulary on the same prompts, whose responses end at a random EOS (about one token in
40), so their lengths fall off geometrically up to ``--response``: most batches wait on a few long
responses, the case partial rollouts are for. The cases:

- ``colocated``: the engine shares the trainer's devices; generation and training take turns, each
  with every core (``--trainer-cpus`` and ``--server-cpus`` together);
- ``disaggregated``: a server of its own (``rollout.mode=disaggregated``), on-policy: the trainer
  waits while the server generates and the server waits while the trainer trains;
- ``off_policy``: the same with ``trainer.max_staleness=1``: the server generates batch k + 1 while
  the trainer trains on batch k;
- ``partial``: the same with ``rollout.partial_rollout=true``: the weight push pauses the batch
  still generating instead of waiting for it, and it continues with the new weights.

On a machine without GPUs the sides are CPU cores: the trainer runs under ``taskset`` on
``--trainer-cpus`` and every thread of the server's processes is pinned to ``--server-cpus`` (the
job's processes are found by a marker in their environment, the server's by its process group).

Per case (medians over the steps after ``--warmup``): ``tokens_per_s`` (prompt + response tokens
per step over the step's time), ``step_s``, ``generation_s`` (the server busy generating one
batch), ``trainer_idle_s`` (the trainer waiting for a batch or for the server to finish before the
weight push), ``server_idle_s`` (the step minus the server's busy time). ``overlap`` compares the
off-policy step with its ideal: on-policy, a step is generation + the rest; with perfect overlap it
would be the longer of the two, so ``achieved = (on_policy_step - off_policy_step) /
(on_policy_step - ideal_step)`` (1 = all the overlap there is to get).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from benchmarks.suite import REPO_ROOT, Case, Workload, machine_info, prepare_workload, trident_command
from engine.rollout.sglang_server import SERVER_MODULE

MARKER = "TRIDENT_ASYNC_ROLLOUT_JOB"
DISAGGREGATED = ("actor_rollout_ref.rollout.mode=disaggregated", "actor_rollout_ref.rollout.num_gpus=1")
CASES = {
    "colocated": (),
    "disaggregated": DISAGGREGATED,
    "off_policy": (*DISAGGREGATED, "trainer.max_staleness=1"),
    "partial": (*DISAGGREGATED, "trainer.max_staleness=1", "actor_rollout_ref.rollout.partial_rollout=true"),
}
# The long-tail workload's random model: the demo's vocabulary, so the demo's prompts fit it.
LONG_TAIL_MODEL = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                       tie_word_embeddings=False)


def _job_processes(marker: str) -> list[int]:
    pids = []
    for folder in Path("/proc").glob("[0-9]*"):
        try:
            if marker.encode() in (folder / "environ").read_bytes():
                pids.append(int(folder.name))
        except OSError:
            continue
    return pids


def _pin_servers(marker: str, cpus: set[int], stop: threading.Event, pinned: set[int]) -> None:
    """Keep every thread of the job's SGLang servers on ``cpus`` (threads appear while they start);
    ``pinned`` collects the thread ids, as evidence that the pinning took place."""
    while not stop.wait(0.5):
        for pid in _job_processes(marker):
            try:
                group = os.getpgid(pid)
                launcher = (Path(f"/proc/{group}/cmdline").read_bytes() if group != os.getpgid(0) else b"")
                if SERVER_MODULE.encode() not in launcher:
                    continue
                for task in Path(f"/proc/{pid}/task").iterdir():
                    os.sched_setaffinity(int(task.name), cpus)
                    pinned.add(int(task.name))
            except (OSError, ProcessLookupError):
                continue


def workload(case: Case, kind: str, work: Path) -> Workload:
    """The demo's workload, or for ``long_tail`` the same prompts on a random model (built once)."""
    demo = prepare_workload(case, work)
    if kind == "demo":
        return demo
    from engine.models.char_tokenizer import build_char_tokenizer
    from launch.rehearse import write_tiny_model

    model_dir = work / "model-long-tail"
    if not (model_dir / "config.json").exists():
        write_tiny_model({**LONG_TAIL_MODEL, "vocab_size": len(build_char_tokenizer())}, model_dir)
    return dataclasses.replace(demo, model_dir=model_dir)


def run(name: str, overrides: tuple[str, ...], args, work: Path) -> dict:
    case = Case(name, "trident", rollout="sglang", prompts=args.prompts, response=args.response,
                overrides=("actor_rollout_ref.rollout.gpu_memory_utilization=0.05", *overrides))
    run_dir = work / name
    command = trident_command(case, workload(case, args.workload, work), args.steps, run_dir)
    marker = uuid.uuid4().hex
    disaggregated = name != "colocated"
    trainer_cpus = set(args.trainer_cpus) if disaggregated else set(args.trainer_cpus) | set(args.server_cpus)
    env = {**os.environ, MARKER: marker, "OMP_NUM_THREADS": str(len(trainer_cpus)), "TORCHDYNAMO_DISABLE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    command = ["taskset", "-c", ",".join(map(str, sorted(trainer_cpus))), *command]
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "job.log"
    print(f"[async_rollout] {name}: running {args.steps} steps (log {log})", file=sys.stderr, flush=True)
    stop, pinned = threading.Event(), set()
    pinning = threading.Thread(target=_pin_servers, args=(marker, set(args.server_cpus), stop, pinned), daemon=True)
    if disaggregated:
        pinning.start()
    try:
        with log.open("w") as out:
            code = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    finally:
        stop.set()
    if code != 0:
        raise SystemExit(f"[async_rollout] {name} failed (exit {code}); see {log}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = [row for row in rows if "timing_s/step" in row][args.warmup:]
    if not timed:
        raise SystemExit(f"[async_rollout] {name}: no steps after the {args.warmup} warm-up steps; raise --steps")

    def median(values) -> float:
        return statistics.median(list(values))

    step_s = median(row["timing_s/step"] for row in timed)
    generation_s = median(row["perf/rollout_generation_s"] for row in timed)
    return {
        "trainer_cpus": sorted(trainer_cpus), "server_cpus": sorted(args.server_cpus) if disaggregated else None,
        "server_threads_pinned": len(pinned),
        "tokens_per_s": median(row["perf/total_num_tokens"] / row["timing_s/step"] for row in timed),
        "step_s": step_s, "generation_s": generation_s,
        "trainer_idle_s": median(row["timing_s/gen"] + row["perf/wait_rollout_ahead_s"] for row in timed),
        "server_idle_s": max(0.0, step_s - generation_s),
        "response_length_max": median(row["response_length/max"] for row in timed),
        "response_length_mean": median(row["response_length/mean"] for row in timed),
        "staleness": [row["rollout/staleness/max"] for row in timed],
        "partial_fraction": [row["rollout/partial/fraction"] for row in timed], "steps": rows,
    }


def overlap(on_policy: dict, off_policy: dict) -> dict:
    rest = on_policy["step_s"] - on_policy["trainer_idle_s"]  # everything but waiting for generation
    ideal = max(on_policy["generation_s"], rest)
    gain, possible = on_policy["step_s"] - off_policy["step_s"], on_policy["step_s"] - ideal
    return {"on_policy_step_s": on_policy["step_s"], "off_policy_step_s": off_policy["step_s"],
            "ideal_step_s": ideal, "achieved": gain / possible if possible > 0 else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--trainer-cpus", type=int, nargs="+", default=[0])
    parser.add_argument("--server-cpus", type=int, nargs="+", default=[1])
    parser.add_argument("--workload", choices=("demo", "long_tail"), default="demo")
    args = parser.parse_args(argv)
    if set(args.trainer_cpus) & set(args.server_cpus):
        parser.error("--trainer-cpus and --server-cpus must not share a core")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {name: run(name, overrides, args, args.out) for name, overrides in CASES.items()}
    report = {"machine": machine_info(), "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
              "cases": results, "overlap": overlap(results["disaggregated"], results["off_policy"]),
              "partial_overlap": overlap(results["disaggregated"], results["partial"])}
    (args.out / "async_rollout.json").write_text(json.dumps(report, indent=1))
    print(f"{'case':<14} {'tokens/s':>9} {'step s':>7} {'gen s':>6} {'trainer idle s':>15} {'server idle s':>14} "
          f"{'partial':>8}")
    for name, result in results.items():
        print(f"{name:<14} {result['tokens_per_s']:>9.1f} {result['step_s']:>7.3f} {result['generation_s']:>6.3f} "
              f"{result['trainer_idle_s']:>15.3f} {result['server_idle_s']:>14.3f} "
              f"{statistics.mean(result['partial_fraction']):>8.2f}")
    achieved = report["overlap"]["achieved"]
    print(f"overlap: off-policy step {report['overlap']['off_policy_step_s']:.3f} s, ideal "
          f"{report['overlap']['ideal_step_s']:.3f} s, on-policy {report['overlap']['on_policy_step_s']:.3f} s: "
          f"{'n/a' if achieved is None else f'{achieved:.0%}'} of the ideal overlap; {args.out / 'async_rollout.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
