"""reasoning-gym tasks as prompt rows, and their own scorers rebuilt from the row's `extra_info`.

A row generated from reasoning-gym task T has `data_source = "reasoning_gym/T"` and keeps, in
`extra_info`, the task name, the task config (JSON), the generator index and the generated entry
(JSON: question, answer, metadata). Some scorers need more than the answer string (countdown checks
the numbers used against `metadata`), so the scorer gets the entry back as the generator produced
it. An entry with values JSON cannot hold (gsm_symbolic's metadata has Fractions) is stored empty and
regenerated at scoring time from the config and index (generators are seeded by config and index).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any

DATA_SOURCE_PREFIX = "reasoning_gym/"
# How the answer is cut out of a response before the task's scorer sees it. "answer_tag" (the last
# <answer>...</answer> span) is reasoning-gym's own convention; "last_number" suits small models that
# never learned the tags (SmolLM2-135M writes none) on numeric tasks such as chain_sum.
ANSWER_EXTRACTIONS = ("answer_tag", "last_number")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def data_source_for_task(task: str) -> str:
    return DATA_SOURCE_PREFIX + task


def task_of_data_source(data_source: str) -> str:
    if not data_source.startswith(DATA_SOURCE_PREFIX):
        raise ValueError(f"data_source {data_source!r} is not a reasoning-gym source ({DATA_SOURCE_PREFIX}<task>)")
    return data_source[len(DATA_SOURCE_PREFIX):]


def task_config_dict(dataset: Any) -> dict[str, Any]:
    """A reasoning-gym dataset's config as plain JSON-able values (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(dataset.config)))


def entry_extra_info(task: str, config: dict[str, Any], index: int, entry: dict[str, Any],
                     answer_extraction: str = "answer_tag") -> dict[str, Any]:
    """The `extra_info` fields that let `compute_score` rebuild the scorer and the entry (`index` = generator index)."""
    if answer_extraction not in ANSWER_EXTRACTIONS:
        raise ValueError(f"answer extraction {answer_extraction!r}: expected one of {ANSWER_EXTRACTIONS}")
    try:
        entry_json = json.dumps(entry, sort_keys=True)
    except TypeError:  # e.g. Fraction values: regenerate the entry when scoring instead
        entry_json = ""
    return {"reasoning_gym_task": task, "reasoning_gym_config": json.dumps(config, sort_keys=True),
            "reasoning_gym_index": index, "reasoning_gym_entry": entry_json,
            "reasoning_gym_answer_extraction": answer_extraction}


def extract_response_answer(solution_str: str, answer_extraction: str) -> str | None:
    """The answer part of a response (None when there is none), per `ANSWER_EXTRACTIONS`."""
    from reasoning_gym.utils import extract_answer

    if answer_extraction == "answer_tag":
        return extract_answer(solution_str, tag_name="answer")
    if answer_extraction == "last_number":
        numbers = _NUMBER.findall(solution_str)
        return numbers[-1].replace(",", "") if numbers else None
    raise ValueError(f"answer extraction {answer_extraction!r}: expected one of {ANSWER_EXTRACTIONS}")


@functools.lru_cache(maxsize=64)
def _scorer_dataset(task: str, config_json: str) -> Any:
    import reasoning_gym  # imported lazily: ~1.3 s, only needed when such rows are scored

    return reasoning_gym.create_dataset(task, **json.loads(config_json))


def compute_score(data_source: str, solution_str: str, extra_info: dict[str, Any]) -> float:
    """reasoning-gym's own `score_answer` for the task, applied to the answer cut out of the response."""
    task = task_of_data_source(data_source)
    required = ("reasoning_gym_config", "reasoning_gym_index", "reasoning_gym_entry")
    missing = [key for key in required if key not in (extra_info or {})]
    if missing:
        raise KeyError(f"extra_info lacks {missing}: regenerate the data with `python -m launch.data.reasoning_gym`")
    dataset = _scorer_dataset(task, extra_info["reasoning_gym_config"])
    if extra_info["reasoning_gym_entry"]:
        entry = json.loads(extra_info["reasoning_gym_entry"])
    else:
        entry = dataset[int(extra_info["reasoning_gym_index"])]
    answer = extract_response_answer(solution_str, extra_info.get("reasoning_gym_answer_extraction", "answer_tag"))
    return float(dataset.score_answer(answer, entry))
