"""Multi-turn rollouts: trajectories that go on on their own vs a turn-by-turn batch barrier.

    python -m benchmarks.agentic --out DIR [--engines torch sglang] [--trajectories 32]
                                 [--latency 0.2] [--repeats 3]

A batch of ``--trajectories`` conversations on the demo model (``launch.prepare_demo_model``),
trajectory i needing 1 + (i mod 4) assistant turns: "Calculate a + b.", the model's answer, then a
tool's reply after its latency, which asks the next sum. The demo model writes no tool calls, so an
environment stands in for the tool: it sleeps the call's latency on the tool loop and appends a tool
message. For the scheduler that is the same round trip as a tool call (a coroutine on the tool loop,
then the appended tokens and the next turn).

Tool latencies, both measured: ``exponential`` (each call draws its own, mean ``--latency``: real
tools, searches and sandboxes, vary and have long tails) and ``fixed`` (every call exactly
``--latency``).

Two schedules of the same code (``engine.rollout.agentic.generate_trajectories``):

- ``continuous`` (what the trainer runs): each trajectory's next turn starts as soon as its tool
  returns. SGLang gets each turn as a request of its own; the embedded engine generates whichever
  trajectories are ready.
- ``barrier`` (``barrier=True``): a turn starts only when every trajectory has finished the one
  before, generation and tools included.

``engines``: "torch" (the embedded engine) and "sglang" (a real CPU server; skipped when the SGLang
tier is not installed). Reported per engine and latency: the median wall time of the batch in each
schedule, their ratio, the sampled tokens and the turns. Writes ``agentic.json`` and ``agentic.png``.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from benchmarks.suite import machine_info
from engine.rollout.agentic.environment import Environment, EnvironmentFactory, EnvironmentStep
from engine.rollout.agentic.messages import MessageTokens
from engine.rollout.agentic.trajectory import Agent, TrajectoryTask, generate_trajectories
from engine.rollout.base import SamplingParams

SCHEDULES = ("continuous", "barrier")


LATENCIES = ("exponential", "fixed")


class ToolRoundTrip(Environment):
    """Stands in for a tool: after the call's latency, the next question, until the row's turn count."""

    async def reset(self, row: dict) -> None:
        self.turns, self.replies = row["extra_info"]["turns"], 0
        self.random = random.Random(row["extra_info"]["seed"])

    async def step(self, assistant_message: str) -> EnvironmentStep:
        mean = self.config["latency_s"]
        await asyncio.sleep(self.random.expovariate(1 / mean) if self.config["distribution"] == "exponential" else mean)
        self.replies += 1
        question = f"Calculate {self.random.randint(1, 99)} + {self.random.randint(1, 99)}."
        return EnvironmentStep([{"role": "tool", "content": question}], done=self.replies >= self.turns)


def start_engine(name: str, model: Path, run_dir: Path):
    from engine.config import RolloutConfig
    from engine.rollout import create_rollout_engine

    if name == "torch":
        return create_rollout_engine(RolloutConfig(name="torch", dtype="float32"), str(model), device="cpu")
    settings = RolloutConfig(name="sglang", gpu_memory_utilization=0.05, dtype="float32", startup_timeout_s=600)
    return create_rollout_engine(settings, str(model), run_dir=str(run_dir))


def tasks_of(prompts: list[list[int]], repeat: int) -> list[TrajectoryTask]:
    return [TrajectoryTask(prompt, {"extra_info": {"turns": 1 + i % 4, "seed": 1000 * repeat + i}})
            for i, prompt in enumerate(prompts)]


def measure(engine, prompts: list[list[int]], agent: Agent, params: SamplingParams, repeats: int) -> dict:
    """Both schedules, ``repeats`` times each, alternating, on the same latencies per repeat."""
    results = {schedule: {"seconds": [], "sampled_tokens": [], "assistant_turns": []} for schedule in SCHEDULES}
    for repeat in range(repeats):
        for schedule in SCHEDULES:
            torch.manual_seed(repeat)
            start = time.perf_counter()
            trajectories = generate_trajectories(engine, tasks_of(prompts, repeat), params, agent,
                                                 barrier=schedule == "barrier")
            result = results[schedule]
            result["seconds"].append(time.perf_counter() - start)
            result["sampled_tokens"].append(sum(sum(t.loss_mask) for t in trajectories))
            result["assistant_turns"].append(sum(t.stats.turns for t in trajectories))
    for result in results.values():
        result["median_s"] = statistics.median(result["seconds"])
    results["barrier_over_continuous"] = results["barrier"]["median_s"] / results["continuous"]["median_s"]
    return results


def plot(report: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    cases = [(engine, latency) for engine, by_latency in report["engines"].items() for latency in by_latency]
    figure, axis = pyplot.subplots(figsize=(7, 4))
    width = 0.35
    for offset, schedule in enumerate(SCHEDULES):
        axis.bar([i + offset * width for i in range(len(cases))],
                 [report["engines"][e][latency][schedule]["median_s"] for e, latency in cases], width, label=schedule)
    axis.set_xticks([i + width / 2 for i in range(len(cases))], [f"{e}\n{latency} latency" for e, latency in cases])
    axis.set_ylabel("seconds per batch (median)")
    settings = report["settings"]
    axis.set_title(f"{settings['trajectories']} trajectories of 1-4 turns, tool calls of {settings['latency_s']} s (mean)")
    axis.legend()
    figure.tight_layout()
    path = out / "agentic.png"
    figure.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--engines", nargs="+", choices=("torch", "sglang"), default=["torch", "sglang"])
    parser.add_argument("--trajectories", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per tool call (the mean, exponential)")
    parser.add_argument("--budget", type=int, default=96, help="response tokens per trajectory, all turns")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    engines = [e for e in args.engines if e != "sglang" or importlib.util.find_spec("sglang") is not None]
    for skipped in sorted(set(args.engines) - set(engines)):
        print(f"[agentic] {skipped}: not installed, skipped")
    from launch.prepare_demo_model import prepare_demo_model

    demo = prepare_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(demo.model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Calculate {3 + i} + {40 - i}."}],
                                             add_generation_prompt=True, return_dict=False) for i in range(args.trajectories)]
    params = SamplingParams(max_new_tokens=args.budget, temperature=1.0)
    report = {"machine": machine_info(), "settings": {"trajectories": args.trajectories, "latency_s": args.latency,
                                                      "budget": args.budget, "repeats": args.repeats,
                                                      "turns": "1 + i mod 4", "model": str(demo.model_dir)}, "engines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in engines:
            engine = start_engine(name, demo.model_dir, Path(tmp) / f"run_{name}")
            report["engines"][name] = {}
            try:
                for latency in LATENCIES:
                    tool = {"latency_s": args.latency, "distribution": latency}
                    agent = Agent(MessageTokens(tokenizer), environments=EnvironmentFactory(
                        {"tool": lambda: ToolRoundTrip(tool)}, "benchmark"), max_assistant_turns=4, max_user_turns=3)
                    generate_trajectories(engine, tasks_of(prompts[:4], 0), params, agent)  # warm-up
                    result = report["engines"][name][latency] = measure(engine, prompts, agent, params, args.repeats)
                    print(f"[agentic] {name}, {latency} latency: continuous {result['continuous']['median_s']:.2f} s, "
                          f"barrier {result['barrier']['median_s']:.2f} s per batch ({result['barrier_over_continuous']:.2f}x)")
            finally:
                engine.shutdown()
    (args.out / "agentic.json").write_text(json.dumps(report, indent=1))
    print(f"[agentic] results: {args.out / 'agentic.json'}, plot: {plot(report, args.out)}")


if __name__ == "__main__":
    main()
