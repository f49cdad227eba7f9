"""Convert the GSM8K you already have (JSONL or Parquet with `question`, `answer`) to prompt Parquet.

    python -m launch.data.gsm8k --input train.jsonl [--test-input test.jsonl] [--tools] --out DIR

writes DIR/train.parquet and DIR/test.parquet. ``--tools``: the instruction offers the tools of a
multi-turn run (``yaml/qwen3-8b_tools_gsm8k.yaml``) for the arithmetic. Without --test-input, a seeded --test-fraction of
--input is held out as the test split. The ground truth is the number after "####" in `answer`.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from engine.data.schema import make_prompt_row, write_prompt_parquet
from engine.rewards.gsm8k import extract_final_answer

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TOOL_INSTRUCTION = ('Let\'s think step by step, using the tools for any arithmetic, and output the final answer '
                    'after "####".')


def read_gsm8k_file(path: str) -> list[dict[str, Any]]:
    """Rows of a GSM8K .jsonl or .parquet file; each must have string `question` and `answer`."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--input {path}: no such file")
    if file.suffix == ".parquet":
        rows = pq.read_table(file).to_pylist()
    elif file.suffix in (".jsonl", ".json"):
        rows = []
        for line_number, line in enumerate(file.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path}, line {line_number}: not valid JSON ({error})") from error
    else:
        raise ValueError(f"{path}: expected a .jsonl or .parquet file")
    if not rows:
        raise ValueError(f"{path}: no rows")
    for index, row in enumerate(rows):
        for key in ("question", "answer"):
            if not isinstance(row.get(key), str):
                raise ValueError(f"{path}, row {index}: key {key!r} missing or not a string")
    return rows


def convert_row(row: dict[str, Any], split: str, index: int, source: str, instruction: str = INSTRUCTION) -> dict[str, Any]:
    """One GSM8K row in the prompt schema; the answer must contain "#### <number>"."""
    ground_truth = extract_final_answer(row["answer"])
    if ground_truth is None:
        raise ValueError(f"{source}, row {index}: the answer has no '#### <number>' final line: "
                         f"{row['answer'][-80:]!r}")
    prompt = [{"role": "user", "content": f"{row['question']} {instruction}"}]
    return make_prompt_row(DATA_SOURCE, prompt, ground_truth, ability="math",
                           extra_info={"split": split, "index": index, "question": row["question"],
                                       "answer": row["answer"]})


def convert(input_path: str, out_dir: str, test_input: str | None = None, test_fraction: float = 0.1,
            seed: int = 0, instruction: str = INSTRUCTION) -> dict[str, int]:
    """Write out_dir/train.parquet and out_dir/test.parquet; returns the row count of each split."""
    train_rows = read_gsm8k_file(input_path)
    if test_input is not None:
        test_rows, test_source = read_gsm8k_file(test_input), test_input
        train_pairs = list(enumerate(train_rows))
        test_pairs = list(enumerate(test_rows))
    else:
        if not 0 < test_fraction < 1:
            raise ValueError(f"--test-fraction {test_fraction}: must be in (0, 1) when --test-input is not given")
        order = list(range(len(train_rows)))
        random.Random(seed).shuffle(order)
        num_test = max(1, round(len(order) * test_fraction))
        if num_test >= len(order):
            raise ValueError(f"{input_path}: {len(order)} rows are too few to hold out a test split")
        test_pairs = [(i, train_rows[i]) for i in sorted(order[:num_test])]
        train_pairs = [(i, train_rows[i]) for i in sorted(order[num_test:])]
        test_source = input_path
    # `index` is the row number in the source file, so a converted row can be traced back.
    splits = {"train": [convert_row(row, "train", i, input_path, instruction) for i, row in train_pairs],
              "test": [convert_row(row, "test", i, test_source, instruction) for i, row in test_pairs]}
    for split, rows in splits.items():
        write_prompt_parquet(rows, Path(out_dir) / f"{split}.parquet")
    return {split: len(rows) for split, rows in splits.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="GSM8K train split (.jsonl or .parquet)")
    parser.add_argument("--test-input", help="GSM8K test split; default: hold out --test-fraction of --input")
    parser.add_argument("--test-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0, help="seed of the held-out split")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--tools", action="store_true", help="an instruction that offers the tools (multi-turn runs)")
    args = parser.parse_args(argv)
    try:
        counts = convert(args.input, args.out, args.test_input, args.test_fraction, args.seed,
                         TOOL_INSTRUCTION if args.tools else INSTRUCTION)
    except (ValueError, FileNotFoundError) as error:
        parser.exit(2, f"error: {error}\n")
    print(json.dumps({"out": args.out, **counts}))


if __name__ == "__main__":
    main()
