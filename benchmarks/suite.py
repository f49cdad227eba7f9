"""Trident's throughput benchmarking suite: a declared matrix of PPO cases, peers side by side.

    python -m benchmarks.suite --matrix {quick,cpu,gpu} --out DIR [--steps 8] [--warmup 2] [--repeats N]
                               [--cpu-threads N]
                               [--cases NAME ...] [--compare OLD_DIR]

Every case is one real PPO job on one workload, run to completion in its own processes:

- ``trident``: ``launch.main`` under torchrun with the case's layout, rollout engine and dtype; the
  numbers come from the job's own ``metrics.jsonl``.
- ``plain``: ``benchmarks.plain_ppo``, a minimal single-process PyTorch PPO loop doing the same work
  (the floor Trident's per-step overhead is measured against).
- ``trl``: TRL's PPO trainer (``trl.experimental.ppo``, trl 1.12.0, the last release with PPO) on the
  same model and prompts, when ``requirements/trl.txt`` is installed (not part of the base install).

The first ``--warmup`` steps of each case are dropped; the rest are summarised by their median.
Per case, ``DIR/<case>.json`` holds the raw per-step rows and:

- ``tokens_per_s``: HybridFlow's end-to-end throughput, prompt + response tokens of the step's batch
  over the step's wall time; ``tokens_per_s_per_device`` divides by the ranks (CPU processes or GPUs);
- ``phases_s``: median seconds of each phase (``timing_s/<phase>``: gen, old_log_prob, ref, values,
  reward, adv, update_critic, update_actor, update_weights);
- ``weight_sync_s`` / ``weight_sync_mb``: the actor -> rollout engine push and the bytes this rank received;
- ``peak_memory_gb``: per phase, the peak resident set (CPU) or allocated device memory (GPU);
- ``mfu_actor``: model FLOPs utilisation of the actor update, where the device's peak is known (GPU, bf16);
- ``noise``: the step-to-step spread of throughput (interquartile range / median) or, with
  ``--repeats``, the spread between the jobs' medians if larger: the band ``--compare`` allows before
  it calls a change a regression;
- ``ratio_to_baseline``: tokens/s over the baseline case's (the plain loop on the same workload).

``DIR/summary.json`` and ``DIR/summary.md`` hold the table of all cases, ``DIR/phases.png`` the per-phase
stacked bars and ``DIR/scaling.png`` tokens/s against ranks. ``--compare OLD_DIR`` writes
``DIR/compare.md`` and exits 1 when a case lost more throughput than both runs' noise allows.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
PHASES = ("gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic", "update_actor", "update_weights")
# Every Trident job of the suite times PPO steps only: no checkpoints, validation, export or resume.
QUIET = ["trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "trainer.export_hf_at_end=false", "trainer.resume_mode=disable", "trainer.logger=[jsonl]"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One cell of the matrix.

    Attributes:
        name: the case's file name and table row.
        runner: "trident", "plain" (the minimal PyTorch loop) or "trl".
        model: "demo" (the ``make demo`` 4-layer Llama, hidden 128, on its arithmetic prompts) or a
            random model with a published architecture's shapes (``launch.plan.KNOWN_ARCHITECTURES``)
            on GSM8K-format stand-in prompts, e.g. "qwen2.5-0.5b".
        ranks: processes (CPU) or GPUs of the job.
        tp, pp: the actor's and critic's training layout (data parallel = the rest).
        rollout: the generation engine, "torch" (embedded) or "sglang".
        dtype: parameter and rollout dtype, "float32" or "bfloat16".
        prompts, response: prompts per step and new tokens per response.
        overrides: further ``key=value`` overrides of the Trident job.
        baseline: the case whose tokens/s this one's ratio is taken against.
        gpu: needs CUDA devices (skipped without enough of them).
    """

    name: str
    runner: str
    model: str = "demo"
    ranks: int = 1
    tp: int = 1
    pp: int = 1
    rollout: str = "torch"
    dtype: str = "float32"
    prompts: int = 32
    response: int = 8
    overrides: tuple[str, ...] = ()
    baseline: str | None = None
    gpu: bool = False


_TINY = dict(model="demo", prompts=32, response=8)
_H200 = dict(model="qwen2.5-0.5b", dtype="bfloat16", prompts=64, response=128, gpu=True)
_NODE = dict(model="qwen2.5-7b", dtype="bfloat16", prompts=256, response=256, gpu=True)

MATRICES: dict[str, list[Case]] = {
    # The tiny workload of issue 15 (1 rank, all cores): Trident, the floor, TRL. Minutes; runs in `make test`.
    "quick": [
        Case("plain-tiny", "plain", **_TINY),
        Case("trident-tiny", "trident", **_TINY, baseline="plain-tiny"),
        Case("trident-tiny-rollout-logprobs", "trident", **_TINY, baseline="plain-tiny",
             overrides=("actor_rollout_ref.actor.use_rollout_log_probs=true",)),
        Case("trl-tiny", "trl", **_TINY, baseline="plain-tiny"),
    ],
    "gpu": [
        # One H200: the gpu_smoke model (random Qwen2.5-0.5B shapes), embedded rollout (SGLang is not
        # carried to the lent machine), bf16; the plain loop on the same model is the floor.
        Case("h200-plain-qwen0.5b", "plain", **_H200),
        Case("h200-trident-qwen0.5b", "trident", **_H200, baseline="h200-plain-qwen0.5b"),
        Case("h200-trident-qwen0.5b-rollout-logprobs", "trident", **_H200, baseline="h200-plain-qwen0.5b",
             overrides=("actor_rollout_ref.actor.use_rollout_log_probs=true",)),
        # One 8-GPU node: yaml/qwen2.5-7b_gsm8k.yaml's layout (TP4 x DP2, SGLang TP2) on a random 7B.
        Case("node8-trident-qwen7b-tp4", "trident", **_NODE, ranks=8, tp=4, rollout="sglang"),
        Case("node8-trident-qwen7b-tp2-pp2", "trident", **_NODE, ranks=8, tp=2, pp=2, rollout="sglang"),
    ],
}
# CPU: the quick cases, then layouts, bf16 and the SGLang engine on the same workload (2 cores: the
# multi-rank cases share them, so they show overhead, not speed-up).
MATRICES["cpu"] = MATRICES["quick"] + [
    # The schema's layout: THD-packed rows (a dense block mask on CPU; the demo runs left-aligned rows).
    Case("trident-tiny-packed", "trident", **_TINY, baseline="plain-tiny",
         overrides=("actor_rollout_ref.model.use_remove_padding=true",)),
    Case("trident-tiny-bf16", "trident", **{**_TINY, "dtype": "bfloat16"}, baseline="plain-tiny"),
    Case("trident-tiny-dp2", "trident", **_TINY, ranks=2, baseline="trident-tiny"),
    Case("trident-tiny-tp2", "trident", **_TINY, ranks=2, tp=2, baseline="trident-tiny"),
    Case("trident-tiny-pp2", "trident", **_TINY, ranks=2, pp=2, baseline="trident-tiny"),
    Case("trident-tiny-sglang", "trident", **_TINY, rollout="sglang", baseline="trident-tiny"),
]


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass
class Workload:
    """What a case runs on: the experiment file, the model folder and the prompts."""

    experiment: Path
    model_dir: Path
    train_file: Path
    overrides: list[str]


def prepare_workload(case: Case, work: Path) -> Workload:
    if case.model == "demo":
        from launch.prepare_demo_model import prepare_demo_model

        demo = prepare_demo_model()  # the folder yaml/demo_cpu.yaml reads, built once
        return Workload(REPO_ROOT / "yaml" / "demo_cpu.yaml", demo.model_dir, demo.train_file, [])
    from launch.plan import KNOWN_ARCHITECTURES
    from launch.rehearse import write_gsm8k_stand_in, write_tiny_model

    written = dict(KNOWN_ARCHITECTURES[case.model])
    theta = written.pop("rope_theta")
    written.pop("use_sliding_window", None)
    model_dir = work / f"model-{case.model}"
    if not (model_dir / "config.json").exists():
        write_tiny_model({**written, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                          "initializer_range": 0.02}, model_dir)
    train, val = write_gsm8k_stand_in(work / "data", train_prompts=case.prompts * 16, val_prompts=8)
    experiment = "qwen2.5-0.5b_gsm8k.yaml" if case.model == "qwen2.5-0.5b" else "qwen2.5-7b_gsm8k.yaml"
    return Workload(REPO_ROOT / "yaml" / experiment, model_dir, train,
                    [f"data.val_files={val}", "data.max_prompt_length=128"])


def trident_command(case: Case, workload: Workload, steps: int, run_dir: Path) -> list[str]:
    mini = min(case.prompts, 32) if case.model == "demo" else case.prompts // 2
    overrides = [
        f"actor_rollout_ref.model.path={workload.model_dir}", f"data.train_files={workload.train_file}",
        *workload.overrides, f"data.train_batch_size={case.prompts}", f"data.max_response_length={case.response}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", f"critic.ppo_mini_batch_size={mini}",
        f"trainer.total_training_steps={steps}", "trainer.nnodes=1", f"trainer.n_gpus_per_node={case.ranks}",
        f"trainer.default_local_dir={run_dir}", *QUIET, f"actor_rollout_ref.rollout.name={case.rollout}",
        f"actor_rollout_ref.rollout.dtype={case.dtype}", "reward_model.num_workers=0",
    ]
    for role in ("actor_rollout_ref.actor", "critic"):
        overrides += [f"{role}.megatron.tensor_model_parallel_size={case.tp}",
                      f"{role}.megatron.pipeline_model_parallel_size={case.pp}",
                      f"{role}.megatron.param_dtype={case.dtype}"]
    if case.rollout == "torch":
        overrides.append("actor_rollout_ref.rollout.tensor_model_parallel_size=1")
    from parallel.state import find_free_port

    return [sys.executable, "-m", "launch.torchrun", f"--nproc_per_node={case.ranks}",
            "--master_addr=127.0.0.1", f"--master_port={find_free_port()}", "-m", "launch.main",
            str(workload.experiment), *overrides, *case.overrides]


def plain_command(case: Case, workload: Workload, steps: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.plain_ppo", "--model", str(workload.model_dir),
            "--data", str(workload.train_file), "--metrics", str(run_dir / "metrics.jsonl"), "--steps", str(steps),
            "--prompts", str(case.prompts), "--max-response-length", str(case.response), "--dtype", case.dtype]


def trl_command(case: Case, workload: Workload, steps: int, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.trl_ppo", "--model", str(workload.model_dir),
            "--data", str(workload.train_file), "--metrics", str(run_dir / "metrics.jsonl"), "--steps", str(steps),
            "--prompts", str(case.prompts), "--max-response-length", str(case.response), "--work", str(run_dir)]


COMMANDS = {"trident": trident_command, "plain": plain_command, "trl": trl_command}


def skip_reason(case: Case) -> str | None:
    """Why this machine cannot run the case, or None."""
    import torch

    if case.gpu and torch.cuda.device_count() < case.ranks:
        return f"needs {case.ranks} CUDA device(s), this machine has {torch.cuda.device_count()}"
    if not case.gpu and case.ranks > 1 and (os.cpu_count() or 1) < case.ranks:
        return f"needs {case.ranks} CPU cores"
    if case.runner == "trl" and importlib.util.find_spec("trl") is None:
        return "trl is not installed (optional tier: .venv/bin/pip install -r requirements/trl.txt)"
    if case.rollout == "sglang" and importlib.util.find_spec("sglang") is None:
        return "SGLang is not installed (make test installs its CPU tier)"
    return None


# ----------------------------------------------------------------------------- running and summarising


def run_case(case: Case, steps: int, warmup: int, work: Path, repeat: int = 0, cpu_threads: int | None = None) -> dict[str, Any]:
    """One job of ``case``; ``status`` "ok" with its summary, or "skipped" / "failed" with a reason.
    ``cpu_threads``: the CPU job's threads in all (None: every core)."""
    result: dict[str, Any] = {"case": dataclasses.asdict(case), "status": "skipped"}
    reason = skip_reason(case)
    if reason is not None:
        result["reason"] = reason
        print(f"[suite] {case.name}: skipped ({reason})", file=sys.stderr, flush=True)
        return result
    run_dir = work / case.name / f"run{repeat}"
    run_dir.mkdir(parents=True, exist_ok=True)
    workload = prepare_workload(case, work)
    command = COMMANDS[case.runner](case, workload, steps, run_dir)
    # All cores to a 1-rank job (the "1 rank, 2 threads"); ranks of a CPU job share them.
    threads = max(1, (cpu_threads or os.cpu_count() or 1) // case.ranks) if not case.gpu else 8
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TORCHDYNAMO_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = run_dir / "job.log"
    print(f"[suite] {case.name}: running ({steps} steps; log {log})", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with log.open("w") as log_file:
        code = subprocess.run(command, cwd=REPO_ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT).returncode
    result["wall_s"] = time.perf_counter() - start
    metrics_file = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    rows = [row for row in rows if "timing_s/step" in row]
    if code != 0 or len(rows) <= warmup:
        tail = log.read_text()[-2000:]
        result.update(status="failed", reason=f"exit {code}, {len(rows)} steps; log tail:\n{tail}")
        print(f"[suite] {case.name}: FAILED (exit {code}); see {log}", file=sys.stderr, flush=True)
        return result
    result.update(status="ok", command=command[1:], steps=rows, timed=rows[warmup:])
    print(f"[suite] {case.name}: step {statistics.median(r['timing_s/step'] for r in rows[warmup:]):.3f} s (median)",
          file=sys.stderr, flush=True)
    return result


def merge_repeats(runs: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    """One case's result over its repeated jobs: the summary of all their timed steps, the first
    job's raw rows, and the noise widened to the spread between the jobs' medians."""
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        return failed[0]
    timed = [row for r in runs for row in r["timed"]]
    result = {**runs[0], "repeats": len(runs), **summarise(timed, ranks),
              "repeat_step_s": [statistics.median(row["timing_s/step"] for row in r["timed"]) for r in runs]}
    del result["timed"]
    if len(runs) > 1:
        medians = [statistics.median(row["perf/total_num_tokens"] / row["timing_s/step"] for row in r["timed"]) for r in runs]
        result["run_to_run_spread"] = (max(medians) - min(medians)) / result["tokens_per_s"]
        result["noise"] = max(result["noise"], result["run_to_run_spread"])
    return result


def summarise(rows: list[dict], ranks: int) -> dict[str, Any]:
    step_s = statistics.median(r["timing_s/step"] for r in rows)
    per_step = sorted(r["perf/total_num_tokens"] / r["timing_s/step"] for r in rows)
    tokens_per_s = statistics.median(per_step)
    quartiles = statistics.quantiles(per_step, n=4) if len(per_step) >= 2 else [tokens_per_s] * 3
    phases = {p: statistics.median(r[f"timing_s/{p}"] for r in rows) for p in PHASES if f"timing_s/{p}" in rows[0]}
    memory = {}
    for key in rows[0]:
        if key.startswith(("perf/max_memory_allocated_gb/", "perf/max_rss_gb/")):
            memory[key.rsplit("/", 1)[1]] = max(r[key] for r in rows)
    mfu = [r["perf/mfu/actor"] for r in rows if r.get("perf/mfu/actor") is not None]
    return {
        "timed_steps": len(rows), "step_s": step_s, "tokens_per_step": statistics.median(r["perf/total_num_tokens"] for r in rows),
        "tokens_per_s": tokens_per_s, "tokens_per_s_per_device": tokens_per_s / ranks,
        "noise": (quartiles[2] - quartiles[0]) / tokens_per_s, "phases_s": phases,
        "weight_sync_s": phases.get("update_weights"),
        "weight_sync_mb": statistics.median(r["perf/weight_sync_received_mb"] for r in rows)
        if "perf/weight_sync_received_mb" in rows[0] else None,
        "peak_memory_gb": memory, "mfu_actor": statistics.median(mfu) if mfu else None,
        "score_mean": statistics.fmean(r["critic/score/mean"] for r in rows) if "critic/score/mean" in rows[0] else None,
    }


def add_ratios(results: dict[str, dict]) -> None:
    """Ratios to the baseline case; the step-time ratio is the median over repeats of each repeat's
    ratio, since jobs of one round ran back to back and share the machine's state of the moment."""
    for result in results.values():
        base = results.get(result["case"]["baseline"] or "")
        if result["status"] == "ok" and base is not None and base["status"] == "ok":
            result["ratio_to_baseline"] = result["tokens_per_s"] / base["tokens_per_s"]
            result["step_time_over_baseline"] = statistics.median(
                mine / theirs for mine, theirs in zip(result["repeat_step_s"], base["repeat_step_s"]))


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def markdown_table(results: dict[str, dict], machine: dict[str, Any]) -> str:
    header = ["case", "runner", "ranks", "layout", "dtype", "tokens/s", "per device", "step s", "x baseline (step time)",
              *PHASES, "sync MB", "peak GB", "MFU"]
    lines = [f"Machine: {machine['cpu']} ({machine['cpu_count']} cores), {machine['device']}; torch {machine['torch']}",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in results.items():
        case = r["case"]
        if r["status"] != "ok":
            lines.append(f"| {name} | {case['runner']} | {case['ranks']} | | | {r['status']}: {r['reason'].splitlines()[0]} |")
            continue
        peak = max(r["peak_memory_gb"].values()) if r["peak_memory_gb"] else None
        ratio = r.get("step_time_over_baseline")
        lines.append("| " + " | ".join([
            name, case["runner"], str(case["ranks"]), f"tp{case['tp']} pp{case['pp']}", case["dtype"],
            f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_s_per_device']:.0f}", f"{r['step_s']:.3f}",
            f"{ratio:.2f}" if ratio else "-", *[_fmt(r["phases_s"].get(p)) for p in PHASES],
            _fmt(r["weight_sync_mb"]), _fmt(peak), _fmt(r["mfu_actor"])]) + " |")
    lines += ["", "tokens/s: prompt + response tokens per second of a whole PPO step (HybridFlow); phases in "
              "seconds (median of the timed steps); x baseline: step time over the baseline case's."]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {name: r for name, r in results.items() if r["status"] == "ok"}
    figure, axes = plt.subplots(figsize=(max(6, 1.3 * len(ok)), 4.5))
    bottom = [0.0] * len(ok)
    for phase in PHASES:
        heights = [r["phases_s"].get(phase, 0.0) for r in ok.values()]
        axes.bar(list(ok), heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    axes.set_ylabel("seconds per PPO step (median)")
    axes.set_title("Where a step's time goes, per case")
    axes.legend(fontsize=7, ncol=3)
    plt.setp(axes.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    figure.tight_layout()
    phases_png = out / "phases.png"
    figure.savefig(phases_png, dpi=110)
    plt.close(figure)

    figure, axes = plt.subplots(figsize=(6, 4))
    groups: dict[str, list[tuple[int, float]]] = {}
    for r in ok.values():
        case = r["case"]
        groups.setdefault(f"{case['runner']} {case['model']} {case['dtype']}", []).append((case["ranks"], r["tokens_per_s"]))
    for label, points in groups.items():
        best = {}
        for ranks, tps in points:
            best[ranks] = max(best.get(ranks, 0.0), tps)
        ranks = sorted(best)
        axes.plot(ranks, [best[k] for k in ranks], marker="o", label=label)
    axes.set_xlabel("ranks (CPU processes or GPUs)")
    axes.set_ylabel("tokens/s (best layout per rank count)")
    axes.set_title("Scaling with ranks")
    axes.legend(fontsize=7)
    figure.tight_layout()
    scaling_png = out / "scaling.png"
    figure.savefig(scaling_png, dpi=110)
    plt.close(figure)
    return [phases_png, scaling_png]


def compare(new: dict[str, dict], old: dict[str, dict]) -> tuple[str, list[str]]:
    """Markdown of tokens/s changes per case, and the cases that regressed beyond both runs' noise."""
    lines = ["| case | old tokens/s | new tokens/s | change | allowed (noise) | verdict |", "|---|---|---|---|---|---|"]
    regressions = []
    for name, r in new.items():
        before = old.get(name)
        if r["status"] != "ok" or before is None or before.get("status") != "ok":
            continue
        change = r["tokens_per_s"] / before["tokens_per_s"] - 1
        allowed = max(r["noise"], before["noise"], 0.02)
        verdict = "regression" if change < -allowed else ("faster" if change > allowed else "same")
        if verdict == "regression":
            regressions.append(name)
        lines.append(f"| {name} | {before['tokens_per_s']:.0f} | {r['tokens_per_s']:.0f} | {change:+.1%} | "
                     f"{allowed:.1%} | {verdict} |")
    return "\n".join(lines) + "\n", regressions


def machine_info() -> dict[str, Any]:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "device": device, "torch": torch.__version__,
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--matrix", choices=sorted(MATRICES), default="quick")
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON, the table and the plots")
    parser.add_argument("--steps", type=int, default=8, help="PPO steps per case, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps dropped from the summary")
    parser.add_argument("--repeats", type=int, default=1,
                        help="jobs per case, run round-robin over the matrix (noise then includes their spread)")
    parser.add_argument("--cases", nargs="*", help="run only these cases of the matrix")
    parser.add_argument("--cpu-threads", type=int, help="threads of a CPU case in all, split over its ranks "
                        "(default: every core; give fewer where the machine is shared: OpenMP threads that "
                        "spin on a busy core slow a step many times over)")
    parser.add_argument("--compare", type=Path, help="an earlier --out folder: flag regressions beyond noise")
    args = parser.parse_args(argv)
    if args.steps < args.warmup + 2:
        parser.error("--steps must leave at least 2 timed steps after --warmup")
    cases = MATRICES[args.matrix]
    if args.cases:
        unknown = sorted(set(args.cases) - {c.name for c in cases})
        if unknown:
            parser.error(f"not in matrix {args.matrix}: {unknown}; its cases: {[c.name for c in cases]}")
        cases = [c for c in cases if c.name in args.cases]
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "runs"
    runs: dict[str, list[dict]] = {case.name: [] for case in cases}
    for repeat in range(args.repeats):  # round-robin, so a slow spell of the machine hits every case
        for case in cases:
            runs[case.name].append(run_case(case, args.steps, args.warmup, work, repeat, args.cpu_threads))
    results = {case.name: merge_repeats(runs[case.name], case.ranks) for case in cases}
    add_ratios(results)
    for name, result in results.items():
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2))
    machine = machine_info()
    summary = {"matrix": args.matrix, "machine": machine, "cpu_threads": args.cpu_threads, "steps": args.steps, "warmup": args.warmup,
               "cases": {name: {k: v for k, v in r.items() if k != "steps"} for name, r in results.items()}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = markdown_table(results, machine)
    (args.out / "summary.md").write_text(table)
    plots = plot(results, args.out)
    print(table)
    print(f"[suite] results: {args.out}/summary.md, summary.json, one JSON per case, {', '.join(p.name for p in plots)}; "
          f"job logs under {work}", file=sys.stderr)
    failed = [name for name, r in results.items() if r["status"] == "failed"]
    if args.compare is not None:
        old = json.loads((args.compare / "summary.json").read_text())["cases"]
        text, regressions = compare(results, old)
        (args.out / "compare.md").write_text(text)
        print(text)
        if regressions:
            print(f"[suite] regressions beyond noise: {regressions}", file=sys.stderr)
            return 1
    if failed:
        print(f"[suite] failed cases: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
