"""The Parquet prompt schema (the one verl users already have on disk), read and written with pyarrow.

One row is one prompt::

    data_source   str                                   picks the reward function (e.g. "openai/gsm8k")
    prompt        list<struct<role: str, content: str>>  chat messages, rendered by the model's chat template
    ability       str                                   free-form tag (e.g. "math"); optional
    reward_model  struct<style: str, ground_truth: str>  what the reward function compares against
    extra_info    struct / map                          anything else (split, index, task config); optional

Every file is validated completely before training starts: a problem raises one `PromptSchemaError`
naming the file, the row and the key.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

PROMPT_COLUMN = "prompt"  # the default of data.prompt_key
REQUIRED_COLUMNS = ("data_source", PROMPT_COLUMN, "reward_model")
OPTIONAL_COLUMNS = ("ability", "extra_info")
CHAT_ROLES = ("system", "user", "assistant", "tool")

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_MODEL_TYPE = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])


class PromptSchemaError(ValueError):
    """A prompt file does not follow the schema; the message names file, row and key."""

    def __init__(self, path: str | os.PathLike, message: str, *, row: int | None = None, key: str | None = None):
        where = f"{path}"
        if row is not None:
            where += f", row {row}"
        if key is not None:
            where += f", key '{key}'"
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.row = row
        self.key = key


@dataclass
class PromptRecord:
    """One validated row; `source_file`/`source_row` say where it came from (for later error messages)."""

    data_source: str
    messages: list[dict[str, str]]
    ground_truth: Any
    ability: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)
    source_file: str = ""
    source_row: int = -1


def as_file_list(files: str | os.PathLike | Sequence[str | os.PathLike] | None, key: str) -> list[str]:
    """Normalise `data.train_files` / `data.val_files` (a path or a list of paths) to a list of paths."""
    if files is None:
        raise ValueError(f"{key} is not set: give a Parquet file or a list of Parquet files")
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [str(f) for f in files]
    if not paths:
        raise ValueError(f"{key} is an empty list: give at least one Parquet file")
    return paths


def _mapping_to_dict(value: Any) -> Any:
    """pyarrow returns a Parquet MAP as a list of (key, value) tuples; callers want a dict."""
    if isinstance(value, list) and all(isinstance(item, tuple) and len(item) == 2 for item in value):
        return dict(value)
    return value


def _validate_messages(path: str, row: int, prompt: Any, key: str) -> list[dict[str, str]]:
    if not isinstance(prompt, list) or not prompt:
        raise PromptSchemaError(
            path, f"expected a non-empty list of chat messages {{role, content}}, got {type(prompt).__name__} "
            f"{str(prompt)[:80]!r}", row=row, key=key)
    messages = []
    for position, message in enumerate(prompt):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise PromptSchemaError(path, f"message {position} is not a {{role, content}} mapping: "
                                    f"{str(message)[:80]!r}", row=row, key=key)
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise PromptSchemaError(path, f"message {position} has role {role!r}; expected one of {CHAT_ROLES}",
                                    row=row, key=key)
        if not isinstance(content, str):
            raise PromptSchemaError(path, f"message {position} content is {type(content).__name__}, not a string",
                                    row=row, key=key)
        messages.append({"role": role, "content": content})
    return messages


def read_prompt_file(path: str | os.PathLike, prompt_key: str = PROMPT_COLUMN,
                     files_key: str = "data.train_files") -> list[PromptRecord]:
    """Read and validate one Parquet prompt file; raises `PromptSchemaError` on the first problem.

    ``prompt_key`` (``data.prompt_key``) names the column that holds the chat messages;
    ``files_key`` the config key that listed the file."""
    path = str(path)
    if not Path(path).is_file():
        raise PromptSchemaError(path, f"file not found (listed in {files_key})")
    try:
        # One file: ParquetFile reads it without read_table's import of pyarrow.dataset (~0.35 s a process).
        table = pq.ParquetFile(path).read()
    except (pa.ArrowInvalid, OSError) as error:
        raise PromptSchemaError(path, f"not a readable Parquet file ({error})") from error
    required = ("data_source", prompt_key, "reward_model")
    for column in required:
        if column not in table.column_names:
            hint = " (data.prompt_key)" if column == prompt_key else ""
            raise PromptSchemaError(path, f"missing column{hint} (file has columns {table.column_names})", key=column)
    if table.num_rows == 0:
        raise PromptSchemaError(path, "the dataset is empty (0 rows)")

    columns = {name: table.column(name).to_pylist() for name in required + OPTIONAL_COLUMNS
               if name in table.column_names}
    abilities = columns.get("ability", [""] * table.num_rows)
    extra_infos = columns.get("extra_info", [None] * table.num_rows)
    records = []
    for row in range(table.num_rows):
        data_source = columns["data_source"][row]
        if not isinstance(data_source, str) or not data_source:
            raise PromptSchemaError(path, f"expected a non-empty string, got {data_source!r}", row=row,
                                    key="data_source")
        messages = _validate_messages(path, row, columns[prompt_key][row], prompt_key)
        reward_model = _mapping_to_dict(columns["reward_model"][row])
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise PromptSchemaError(path, f"expected a struct with a non-null 'ground_truth', got "
                                    f"{str(reward_model)[:80]!r}", row=row, key="reward_model.ground_truth")
        ability = abilities[row] or ""
        extra_info = _mapping_to_dict(extra_infos[row])
        if extra_info is None:
            extra_info = {}
        if not isinstance(extra_info, dict):
            raise PromptSchemaError(path, f"expected a struct or map, got {type(extra_info).__name__}", row=row,
                                    key="extra_info")
        records.append(PromptRecord(data_source=data_source, messages=messages,
                                    ground_truth=reward_model["ground_truth"], ability=str(ability),
                                    extra_info=extra_info, source_file=path, source_row=row))
    return records


def read_prompt_files(files: str | os.PathLike | Sequence[str | os.PathLike], key: str = "data.train_files",
                      prompt_key: str = PROMPT_COLUMN) -> list[PromptRecord]:
    """Read and validate every file of `data.train_files` / `data.val_files`, in order."""
    records: list[PromptRecord] = []
    for path in as_file_list(files, key):
        records.extend(read_prompt_file(path, prompt_key, key))
    return records


def make_prompt_row(data_source: str, messages: list[dict[str, str]], ground_truth: str, ability: str = "",
                    extra_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build one row in the schema (the converters in `launch/data` use this)."""
    return {"data_source": data_source, PROMPT_COLUMN: messages, "ability": ability,
            "reward_model": {"style": "rule", "ground_truth": str(ground_truth)},
            "extra_info": extra_info or {}}


def write_prompt_parquet(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write rows from `make_prompt_row` to a Parquet file, with explicit types for the fixed columns.

    `extra_info`'s struct type is inferred from the rows (its keys differ between data sources).
    """
    if not rows:
        raise ValueError(f"refusing to write an empty prompt dataset to {path}")
    columns = {
        "data_source": pa.array([r["data_source"] for r in rows], type=pa.string()),
        PROMPT_COLUMN: pa.array([r[PROMPT_COLUMN] for r in rows], type=pa.list_(MESSAGE_TYPE)),
        "ability": pa.array([r["ability"] for r in rows], type=pa.string()),
        "reward_model": pa.array([r["reward_model"] for r in rows], type=REWARD_MODEL_TYPE),
    }
    if any(r.get("extra_info") for r in rows):
        columns["extra_info"] = pa.array([r.get("extra_info") or None for r in rows])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), str(path))
