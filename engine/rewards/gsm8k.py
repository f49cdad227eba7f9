"""The GSM8K rule: the number after the last "####" in the response must equal the ground truth."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# "#### 1,234", "#### $18", "#### -3.5." — digits with the separators people write, sentence dot allowed.
_FINAL_ANSWER = re.compile(r"####\s*\$?\s*(-?\$?[0-9][0-9,]*(?:\.[0-9]+)?)")


def normalize_number(text: str) -> str:
    """Strip `$`, thousands commas, surrounding space and a trailing dot: "$1,234." -> "1234"."""
    return text.replace("$", "").replace(",", "").strip().rstrip(".")


def extract_final_answer(solution_str: str) -> str | None:
    """The normalised number after the last "####", or None when the response has none."""
    matches = _FINAL_ANSWER.findall(solution_str)
    return normalize_number(matches[-1]) if matches else None


def _same_number(answer: str, ground_truth: str) -> bool:
    try:
        return Decimal(answer) == Decimal(ground_truth)  # "18.0" equals "18"
    except InvalidOperation:
        return answer == ground_truth


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` if the last "#### N" equals the ground truth, `format_score` if it exists but differs, else 0."""
    answer = extract_final_answer(solution_str)
    if answer is None:
        return 0.0
    return score if _same_number(answer, normalize_number(str(ground_truth))) else format_score
