"""Prompt datasets: verl-schema Parquet files, chat templates, length filtering, DP-aware resumable sampling."""
from engine.data.batch import PromptBatch, PromptDataLoader, collate_prompts
from engine.data.dataset import PromptDataset, PromptDatasetStats, PromptSample, render_chat_prompts
from engine.data.sampler import PromptSampler
from engine.data.schema import (PromptRecord, PromptSchemaError, make_prompt_row, read_prompt_file,
                                read_prompt_files, write_prompt_parquet)

__all__ = [
    "PromptBatch", "PromptDataLoader", "PromptDataset", "PromptDatasetStats", "PromptRecord",
    "PromptSample", "PromptSampler", "PromptSchemaError", "collate_prompts", "make_prompt_row",
    "read_prompt_file", "read_prompt_files", "render_chat_prompts", "write_prompt_parquet",
]
