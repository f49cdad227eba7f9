"""Configuration of the prompt data pipeline (the `data.*` keys users know from verl)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

TRUNCATION_MODES = ("error", "left", "right")


@dataclass
class DataConfig:
    """`data.*` settings the prompt pipeline reads.

    Attributes:
        train_files: Parquet file or list of files with the training prompts.
        val_files: Parquet file or list of files with the validation prompts (optional).
        train_batch_size: prompts per global batch, summed over all data-parallel ranks.
        val_batch_size: prompts per validation batch; None = the whole validation set in one batch.
        max_prompt_length: longest prompt in tokens, after the chat template is applied.
        filter_overlong_prompts: drop prompts longer than `max_prompt_length` (counted) instead of
            applying `truncation`.
        truncation: what to do with an over-long prompt that is not filtered: "error" stops with the
            file and row, "left" keeps the last `max_prompt_length` tokens, "right" keeps the first.
        shuffle: reshuffle the training prompts every epoch.
        seed: seed of the shuffling (epoch e uses the permutation drawn from (seed, e)).
        drop_last: drop the last, incomplete global batch of every training epoch.
    """

    train_files: str | Sequence[str] | None = None
    val_files: str | Sequence[str] | None = None
    train_batch_size: int = 1024
    val_batch_size: int | None = None
    max_prompt_length: int = 512
    filter_overlong_prompts: bool = False
    truncation: str = "error"
    shuffle: bool = True
    seed: int = 1
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={self.truncation!r}: expected one of {TRUNCATION_MODES}")
        if self.max_prompt_length <= 0:
            raise ValueError(f"data.max_prompt_length={self.max_prompt_length}: must be positive")
        if self.train_batch_size <= 0:
            raise ValueError(f"data.train_batch_size={self.train_batch_size}: must be positive")
        if self.val_batch_size is not None and self.val_batch_size <= 0:
            raise ValueError(f"data.val_batch_size={self.val_batch_size}: must be positive or null")
