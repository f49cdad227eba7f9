"""Rewrite the planner's numbers in the docs from ``launch.plan``: the per-experiment tables of
docs/planner.md and the memory / weight-sync table of docs/scale.md.

    python -m launch.docs_tables            # rewrite them
    python -m launch.docs_tables --check    # exit 1 if either page differs from what the planner gives

``tests/test_plan.py`` checks both pages against the planner, so a change to a yaml or to the memory
model is followed by this command.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from launch.plan import PlanReport, make_plan, markdown_text

REPO_ROOT = Path(__file__).resolve().parent.parent
PLANNER_PAGE = REPO_ROOT / "docs" / "planner.md"
SCALE_PAGE = REPO_ROOT / "docs" / "scale.md"
GIB = 2**30
# The experiments of docs/scale.md's table, in its order, and how each row describes its layout.
SCALE_ROWS = {
    "yaml/llama3-70b_ppo_8node.yaml": "TP8 PP8 VPP2 DP1",
    "yaml/llama3-70b_ppo_16node.yaml": "TP8 PP4 VPP5 DP4",
    "yaml/qwen2.5-72b_ppo_8node.yaml": "TP8 PP8 VPP2 DP1",
    "yaml/qwen2.5-72b_ppo_16node.yaml": "TP8 PP4 VPP5 DP4",
    "yaml/qwen3-8b_grpo_gsm8k.yaml": "TP2 PP1 DP4 (GRPO: no critic)",
    "yaml/qwen3-8b_grpo_32k_cp.yaml": "TP2 PP1 CP2 (a2a) DP2 (GRPO: no critic; 33k-token sequences)",
    "yaml/qwen3-30b-a3b_grpo_gsm8k.yaml": "TP4 PP2 EP4 ETP1 DP1 (MoE; GRPO: no critic, no reference)",
    "yaml/llama3-70b_lora_grpo_1node.yaml": "TP8 PP1 DP1 (LoRA r32; GRPO: no critic; reference = adapters off)",
    "yaml/qwen2.5-72b_lora_grpo_1node.yaml": "TP8 PP1 DP1 (LoRA r32; GRPO: no critic; reference = adapters off)",
}
# The experiments with a full table in docs/planner.md (each under a "### `yaml/...`" heading).
PLANNER_TABLES = [*list(SCALE_ROWS)[:4], "yaml/qwen3-8b_grpo_32k_cp.yaml"]


def sync_cell(report: PlanReport) -> str:
    """GiB one GPU receives per sync: whole tensors / each its SGLang shard / LoRA adapters only
    ("-" where a mode does not apply), the loop's own in bold."""
    cells = []
    for mode in ("full", "sharded", "adapters"):
        received = report.sync_bytes_by_mode.get(mode)
        text = "-" if received is None else f"{received / GIB:.1f}" if received >= GIB / 20 else f"{received / 2**20:.0f} MiB"
        cells.append(f"**{text}**" if mode == report.loop_sync_mode else text)
    return " / ".join(cells)


def scale_row(experiment: str, report: PlanReport) -> str:
    phases = {phase.phase: phase for phase in report.memory.phases}
    headroom = min(phase.capacity_bytes - phase.total_bytes for phase in report.memory.phases)
    sync = report.memory.sync
    cells = [f"`{experiment}`", f"{report.nodes} x {report.gpus_per_node}", SCALE_ROWS[experiment],
             f"TP{report.rollout.tensor_model_parallel_size}", f"{phases['gen'].total_bytes / GIB:.1f}",
             f"{phases['update_actor'].total_bytes / GIB:.1f}", f"{headroom / GIB:.1f}",
             sync_cell(report)]
    return "| " + " | ".join(cells) + " |"


def rewritten_scale(text: str) -> str:
    for experiment in SCALE_ROWS:
        row = scale_row(experiment, make_plan(experiment))
        text, count = re.subn(rf"^\| `{re.escape(experiment)}` \|.*$", lambda _: row, text, flags=re.M)
        if count != 1:
            raise ValueError(f"{SCALE_PAGE} has {count} rows for {experiment}")
    return text


def rewritten_planner(text: str) -> str:
    for experiment in PLANNER_TABLES:
        # The snippet under the experiment's heading: its summary bullets and table, up to a blank line
        # after the "| headroom |" row.
        pattern = rf"(### `{re.escape(experiment)}`\n\n)- {re.escape(experiment)}:.*?\n\| headroom \|[^\n]*"
        text, count = re.subn(pattern, lambda match: match.group(1) + markdown_text(make_plan(experiment)), text,
                              flags=re.S)
        if count != 1:
            raise ValueError(f"{PLANNER_PAGE} has {count} tables for {experiment}")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    args = parser.parse_args(argv)
    stale = []
    for page, rewrite in ((SCALE_PAGE, rewritten_scale), (PLANNER_PAGE, rewritten_planner)):
        text = page.read_text()
        new = rewrite(text)
        if new != text:
            stale.append(page)
            if not args.check:
                page.write_text(new)
    if args.check and stale:
        print(f"stale: {', '.join(map(str, stale))}: run python -m launch.docs_tables", file=sys.stderr)
        return 1
    print("rewrote " + ", ".join(map(str, stale)) if stale else "up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
