"""``data.*``: the prompt files and the prompt/response length budget (read by ``engine.data``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

TRUNCATION_MODES = ("error", "left", "right")


@dataclass
class DataConfig:
    """Prompt data (verl's ``data.*`` keys): the one settings class of the prompt pipeline.

    Attributes:
        train_files: Parquet files with the training prompts (a single path is accepted too).
        val_files: Parquet files with the validation prompts; empty disables validation.
        prompt_key: the column holding the prompt (a list of chat messages).
        train_batch_size: prompts per PPO iteration, summed over all data-parallel ranks; each is
            answered ``actor_rollout_ref.rollout.n`` times.
        val_batch_size: prompts per validation batch; null = the whole validation set at once.
        max_prompt_length: longest prompt in tokens after the chat template.
        max_response_length: most tokens generated per response (the rollout's ``max_new_tokens``).
        filter_overlong_prompts: drop prompts longer than ``max_prompt_length`` (counted) instead of
            applying ``truncation``.
        truncation: over-long prompts that are not filtered: "error" stops with the file and row,
            "left" keeps the last ``max_prompt_length`` tokens, "right" the first.
        shuffle: reshuffle the training prompts every epoch.
        seed: seed of the shuffling (epoch e uses the permutation drawn from (seed, e)).
        drop_last: drop each epoch's last, incomplete global batch.
    """

    train_files: list[str] = MISSING
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    train_batch_size: int = 1024
    val_batch_size: int | None = None
    max_prompt_length: int = 512
    max_response_length: int = 512
    filter_overlong_prompts: bool = False
    truncation: str = "error"
    shuffle: bool = True
    seed: int = 1
    drop_last: bool = True
