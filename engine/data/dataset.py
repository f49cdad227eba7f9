"""`PromptDataset`: validated Parquet prompts, rendered with the model's chat template and tokenized up front."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from engine.config.data import TRUNCATION_MODES, DataConfig
from engine.data.schema import PROMPT_COLUMN, PromptRecord, PromptSchemaError, as_file_list, read_prompt_files

logger = logging.getLogger(__name__)


@dataclass
class PromptDatasetStats:
    """What happened to the rows while the dataset was built (logged once, also returned to the trainer)."""

    num_rows_read: int
    num_filtered_overlong: int
    num_truncated: int
    num_prompts: int
    max_prompt_tokens: int


@dataclass
class PromptSample:
    """One prompt after the chat template: token ids (at most `max_prompt_length`) plus its row."""

    prompt_ids: list[int]
    record: PromptRecord


def render_chat_prompts(tokenizer: Any, records: Sequence[PromptRecord], prompt_key: str = PROMPT_COLUMN,
                        tools: list[dict] | None = None) -> list[str]:
    """Apply the model's chat template (with the generation prompt) to every record's messages;
    ``tools``: the schemas of the tools the model may call (multi-turn rollouts), which the template
    lists where it lists tools (Qwen: in the system prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; prompts are chat messages "
                         f"and need one (set tokenizer.chat_template or use an instruct model's tokenizer)")
    texts = []
    for record in records:
        try:
            texts.append(tokenizer.apply_chat_template(record.messages, add_generation_prompt=True,
                                                       tokenize=False, **({"tools": tools} if tools else {})))
        except Exception as error:  # a template may reject a role order (e.g. no system role)
            raise PromptSchemaError(record.source_file, f"the chat template rejected the messages: {error}",
                                    row=record.source_row, key=prompt_key) from error
    return texts


class PromptDataset:
    """Prompts from one or more Parquet files, validated, templated, tokenized and length-checked.

    Over-long prompts (more than `max_prompt_length` tokens after the template) are dropped when
    `filter_overlong_prompts` is set, otherwise handled by `truncation`: "error" raises naming the
    first offending file/row, "left" keeps the last tokens (the question end and generation prompt),
    "right" keeps the first. The counts are in `self.stats` and logged.
    """

    def __init__(self, files: str | os.PathLike | Sequence[str | os.PathLike], tokenizer: Any, *,
                 max_prompt_length: int, filter_overlong_prompts: bool = False,
                 truncation: Literal["error", "left", "right"] = "error", files_key: str = "data.train_files",
                 prompt_key: str = PROMPT_COLUMN, tools: list[dict] | None = None):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation={truncation!r}: expected one of {TRUNCATION_MODES}")
        self.files = as_file_list(files, files_key)
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.pad_token_id = self._pad_token_id(tokenizer)

        records = read_prompt_files(self.files, key=files_key, prompt_key=prompt_key)
        texts = render_chat_prompts(tokenizer, records, prompt_key, tools)
        # The template already wrote any BOS/special tokens as text: do not add them a second time.
        token_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]

        samples, num_filtered, num_truncated = [], 0, 0
        overlong = [(record, len(ids)) for record, ids in zip(records, token_ids) if len(ids) > max_prompt_length]
        if overlong and not filter_overlong_prompts and truncation == "error":
            record, length = overlong[0]
            raise PromptSchemaError(
                record.source_file, f"prompt has {length} tokens after the chat template, more than "
                f"data.max_prompt_length={max_prompt_length} ({len(overlong)} of {len(records)} prompts are over "
                f"the limit); set data.filter_overlong_prompts=true or data.truncation=left|right",
                row=record.source_row, key=prompt_key)
        for record, ids in zip(records, token_ids):
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    num_filtered += 1
                    continue
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                num_truncated += 1
            samples.append(PromptSample(prompt_ids=list(ids), record=record))
        if not samples:
            raise PromptSchemaError(", ".join(self.files), f"no prompt is left after filtering the {len(records)} "
                                    f"rows longer than data.max_prompt_length={max_prompt_length}")
        self.samples = samples
        self.stats = PromptDatasetStats(num_rows_read=len(records), num_filtered_overlong=num_filtered,
                                        num_truncated=num_truncated, num_prompts=len(samples),
                                        max_prompt_tokens=max(len(s.prompt_ids) for s in samples))
        logger.info("prompt dataset %s: %d rows read, %d over-long filtered, %d truncated, %d prompts "
                    "(longest %d tokens)", self.files, self.stats.num_rows_read, num_filtered, num_truncated,
                    len(samples), self.stats.max_prompt_tokens)

    @classmethod
    def from_config(cls, config: DataConfig, tokenizer: Any, split: Literal["train", "val"] = "train",
                    tools: list[dict] | None = None) -> "PromptDataset":
        """Build the training (`data.train_files`) or validation (`data.val_files`) dataset (``tools``:
        as in ``render_chat_prompts``)."""
        files = config.train_files if split == "train" else config.val_files
        return cls(files, tokenizer, max_prompt_length=config.max_prompt_length,
                   filter_overlong_prompts=config.filter_overlong_prompts, truncation=config.truncation,
                   files_key=f"data.{split}_files", prompt_key=config.prompt_key, tools=tools)

    @staticmethod
    def _pad_token_id(tokenizer: Any) -> int:
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_token_id is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has neither pad_token nor eos_token; "
                             f"left padding needs one")
        return int(pad_token_id)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> PromptSample:
        return self.samples[index]

    @property
    def data_sources(self) -> set[str]:
        """The distinct `data_source` values (the reward manager checks it can score each one)."""
        return {sample.record.data_source for sample in self.samples}
