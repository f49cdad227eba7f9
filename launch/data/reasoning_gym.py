"""Generate prompt Parquet for a reasoning-gym task (the embedded, offline data of the CPU demo).

    python -m launch.data.reasoning_gym --task chain_sum --train-size 1000 --val-size 100 --seed 0 --out DIR

writes DIR/train.parquet and DIR/val.parquet with data_source "reasoning_gym/<task>". The two splits
share no question (duplicates are skipped while generating). Each row keeps the task config and the
generated entry in `extra_info`, from which `engine.rewards` rebuilds the task's own scorer.

By default the prompt carries reasoning-gym's "default" system prompt and the scorer reads the last
<answer>...</answer>. SmolLM2-135M-Instruct never writes those tags (0 of 16 greedy responses), so
its demo data uses `--system-prompt none --answer-extraction last_number`; with
`--task-config '{"max_terms": 3, "max_digits": 2}'` its greedy chain_sum score is 5/32.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from engine.data.schema import make_prompt_row, write_prompt_parquet
from engine.rewards.reasoning_gym_tasks import (ANSWER_EXTRACTIONS, data_source_for_task, entry_extra_info,
                                                task_config_dict)

# How many generator indices to try per requested question before giving up (small task spaces).
MAX_TRIES_PER_QUESTION = 20
NO_SYSTEM_PROMPT = "none"


def generate(task: str, train_size: int, val_size: int, seed: int, out_dir: str,
             task_config: dict[str, Any] | None = None, system_prompt: str = "default",
             answer_extraction: str = "answer_tag") -> dict[str, int]:
    """Write out_dir/train.parquet and out_dir/val.parquet; returns the row count of each split.

    `system_prompt` names one of reasoning-gym's SYSTEM_PROMPTS (they ask for <answer> tags) or "none";
    `answer_extraction` (stored per row) says how the scorer finds the answer in a response.
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS
    from reasoning_gym.utils import SYSTEM_PROMPTS

    if task not in DATASETS:
        raise ValueError(f"--task {task!r} is not a reasoning-gym task; some known tasks: "
                         f"{sorted(DATASETS)[:40]} ...")
    if system_prompt != NO_SYSTEM_PROMPT and system_prompt not in SYSTEM_PROMPTS:
        raise ValueError(f"--system-prompt {system_prompt!r}: expected one of {sorted(SYSTEM_PROMPTS)} or "
                         f"{NO_SYSTEM_PROMPT!r}")
    if answer_extraction not in ANSWER_EXTRACTIONS:
        raise ValueError(f"--answer-extraction {answer_extraction!r}: expected one of {ANSWER_EXTRACTIONS}")
    if train_size <= 0 or val_size < 0:
        raise ValueError(f"--train-size {train_size} must be > 0 and --val-size {val_size} >= 0")
    total = train_size + val_size
    # One generator for both splits: distinct indices draw distinct problems, and dedup removes repeats.
    try:
        dataset = reasoning_gym.create_dataset(task, **{**(task_config or {}), "seed": seed,
                                                        "size": total * MAX_TRIES_PER_QUESTION})
    except (TypeError, AssertionError, ValueError) as error:
        raise ValueError(f"--task-config {task_config} is not valid for {task}: {error}") from error
    config = task_config_dict(dataset)

    entries, seen = [], set()  # (generator index, entry)
    for index in range(total * MAX_TRIES_PER_QUESTION):
        entry = dataset[index]
        if entry["question"] not in seen:
            seen.add(entry["question"])
            entries.append((index, entry))
            if len(entries) == total:
                break
    if len(entries) < total:
        raise ValueError(f"{task} produced only {len(entries)} distinct questions in "
                         f"{total * MAX_TRIES_PER_QUESTION} tries, fewer than the {total} asked for; lower the "
                         f"sizes or widen --task-config")

    system = [] if system_prompt == NO_SYSTEM_PROMPT else [{"role": "system", "content": SYSTEM_PROMPTS[system_prompt]}]
    splits = {"train": entries[:train_size], "val": entries[train_size:]}
    counts = {}
    for split, split_entries in splits.items():
        rows = []
        for position, (generator_index, entry) in enumerate(split_entries):
            extra_info = {"split": split, "index": position,
                          **entry_extra_info(task, config, generator_index, entry, answer_extraction)}
            messages = system + [{"role": "user", "content": entry["question"]}]
            rows.append(make_prompt_row(data_source_for_task(task), messages, entry["answer"], ability="reasoning",
                                        extra_info=extra_info))
        if rows:  # --val-size 0 writes no val file
            write_prompt_parquet(rows, Path(out_dir) / f"{split}.parquet")
        counts[split] = len(rows)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, help="reasoning-gym task, e.g. chain_sum, countdown, "
                        "basic_arithmetic, gsm_symbolic")
    parser.add_argument("--train-size", type=int, required=True)
    parser.add_argument("--val-size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--task-config", default="{}",
                        help='JSON overrides of the task config, e.g. \'{"min_terms": 2, "max_terms": 3}\'')
    parser.add_argument("--system-prompt", default="default",
                        help=f"a reasoning_gym.utils.SYSTEM_PROMPTS key, or {NO_SYSTEM_PROMPT!r}")
    parser.add_argument("--answer-extraction", default="answer_tag", choices=ANSWER_EXTRACTIONS,
                        help="answer_tag: the last <answer>...</answer>; last_number: the last number")
    args = parser.parse_args(argv)
    try:
        task_config = json.loads(args.task_config)
        if not isinstance(task_config, dict):
            raise ValueError(f"--task-config must be a JSON object, got {args.task_config!r}")
        counts = generate(args.task, args.train_size, args.val_size, args.seed, args.out, task_config,
                          args.system_prompt, args.answer_extraction)
    except ValueError as error:  # json.JSONDecodeError is a ValueError too
        parser.exit(2, f"error: {error}\n")
    print(json.dumps({"out": args.out, "task": args.task, **counts}))


if __name__ == "__main__":
    main()
