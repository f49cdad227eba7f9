"""A run's curves as PNG files and one HTML page, from its ``metrics.jsonl``; two runs side by side.

    python -m launch.report RUN_DIR [OTHER_RUN_DIR] [--out DIR]

Writes ``<RUN_DIR>/report/`` by default: one PNG per group of metrics (scores, validation, KL,
entropy, response length, losses, per-phase time, memory, throughput) and ``index.html`` with a
summary table. With two run directories every curve is drawn once per run, labelled by run.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

# group file name -> (title, y label, metric names or name prefixes ending in "/")
GROUPS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "scores": ("Training reward", "score", ("critic/score/mean", "critic/greedy_score/mean")),
    "validation": ("Validation", "score", ("val/",)),
    "kl": ("KL to the reference", "KL", ("actor/reward_kl_penalty", "actor/ppo_kl", "actor/kl_loss")),
    "entropy": ("Policy entropy", "nats / token", ("actor/entropy",)),
    "response_length": ("Response length", "tokens", ("response_length/mean", "response_length/max")),
    "losses": ("Losses", "loss", ("actor/pg_loss", "critic/vf_loss")),
    "timing": ("Time per phase", "seconds", ("timing_s/",)),
    "memory": ("Peak memory per step", "GiB", ("perf/max_memory_allocated_gb", "perf/max_rss_gb")),
    "throughput": ("Throughput", "tokens / s / device", ("perf/throughput",)),
}


@dataclass
class Run:
    name: str
    rows: list[dict[str, float | None]]

    @classmethod
    def read(cls, run_dir: Path) -> "Run":
        metrics_file = run_dir / "metrics.jsonl"
        if not metrics_file.is_file():
            raise ReportError(f"{run_dir} has no metrics.jsonl (is it a run directory? trainer.logger needs 'jsonl')")
        rows = []
        for number, line in enumerate(metrics_file.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise ReportError(f"{metrics_file}:{number} is not a JSON row") from None
        if not rows:
            raise ReportError(f"{metrics_file} has no rows yet")
        return cls(run_dir.resolve().name, rows)

    def keys(self) -> set[str]:
        return {key for row in self.rows for key in row if key != "step"}

    def series(self, key: str) -> tuple[list[int], list[float]]:
        points = [(row["step"], row[key]) for row in self.rows if row.get(key) is not None]
        return [step for step, _ in points], [value for _, value in points]


class ReportError(Exception):
    pass


def group_keys(runs: Sequence[Run], patterns: Sequence[str]) -> list[str]:
    present = set().union(*(run.keys() for run in runs))
    keys = [key for pattern in patterns for key in sorted(present)
            if (key.startswith(pattern) if pattern.endswith("/") else key == pattern)]
    # Per-phase memory (perf/max_rss_gb/gen ...) belongs to the per-phase tables, not these curves.
    return [key for key in dict.fromkeys(keys) if not (key.startswith("perf/max_") and key.count("/") > 1)]


def plot_group(runs: Sequence[Run], title: str, ylabel: str, keys: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    styles = ("-", "--")
    for run_index, run in enumerate(runs):
        for key_index, key in enumerate(keys):  # a metric keeps its colour; the run sets the line style
            steps, values = run.series(key)
            if steps:
                label = key if len(runs) == 1 else f"{run.name}: {key}"
                axes.plot(steps, values, styles[run_index % 2], color=f"C{key_index % 10}",
                          marker="." if len(steps) < 30 else None, label=label)
    axes.set(title=title, xlabel="step", ylabel=ylabel)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def summary_rows(run: Run) -> list[tuple[str, str]]:
    trained = [row for row in run.rows if "timing_s/step" in row]
    rows = [("steps", str(max((row["step"] for row in run.rows), default=0)))]
    if trained:
        step_time = [row["timing_s/step"] for row in trained if row["timing_s/step"] is not None]
        rows.append(("mean step time (s)", f"{sum(step_time) / len(step_time):.3g}"))
    for key in ("val/accuracy", "val/score/mean", "critic/score/mean"):
        steps, values = run.series(key)
        finite = [(v, s) for s, v in zip(steps, values) if math.isfinite(v)]
        if finite:
            best, best_step = max(finite)
            rows.append((key, f"first {values[0]:.4g}, final {values[-1]:.4g}, best {best:.4g} (step {best_step})"))
    return rows


def write_report(run_dirs: Sequence[Path], out_dir: Path) -> Path:
    runs = [Run.read(Path(run_dir)) for run_dir in run_dirs]
    if len(runs) == 2 and runs[0].name == runs[1].name:
        runs[1].name += " (2)"
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = []
    for name, (title, ylabel, patterns) in GROUPS.items():
        keys = group_keys(runs, patterns)
        if keys:
            plot_group(runs, title, ylabel, keys, out_dir / f"{name}.png")
            figures.append(name)
    tables = "".join(
        f"<h2>{html.escape(run.name)}</h2><table>"
        + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary_rows(run))
        + "</table>" for run in runs)
    images = "".join(f'<h3>{html.escape(GROUPS[name][0])}</h3><img src="{name}.png">' for name in figures)
    title = " vs ".join(run.name for run in runs)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>Trident report: {html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em} th{text-align:left;padding-right:1em}</style></head>"
            f"<body><h1>Trident report: {html.escape(title)}</h1>{tables}{images}</body></html>")
    index = out_dir / "index.html"
    index.write_text(page)
    return index


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one run directory, or two to compare")
    parser.add_argument("--out", type=Path, help="where to write (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    if len(args.run_dirs) > 2:
        parser.error("give one run directory, or two to compare")
    try:
        index = write_report(args.run_dirs, args.out or Path(args.run_dirs[0]) / "report")
    except ReportError as error:
        print(f"[trident] error: {error}", file=sys.stderr)
        return 2
    print(f"[trident] report: {index} ({len(list(index.parent.glob('*.png')))} plots)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
