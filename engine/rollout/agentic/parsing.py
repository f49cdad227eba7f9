"""Tool calls in an assistant turn's text.

``hermes`` (the default; Qwen2.5/Qwen3, Hermes and most open chat templates): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per turn allowed. The text is
decoded only to find the calls; the trainer trains on the engine's own token ids.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOL_CALL_FORMATS = ("hermes",)
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for; ``error`` is set when it could not be read (the model is told)."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str, format: str = "hermes") -> list[ToolCall]:
    """The calls in ``text``, in order; a call whose JSON is malformed comes back with ``error``."""
    if format not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool-call format {format!r} is not one of {TOOL_CALL_FORMATS}")
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            calls.append(ToolCall("", error=f"the tool call is not valid JSON ({error.msg} at {error.pos})"))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(ToolCall("", error='a tool call must be {"name": ..., "arguments": {...}}'))
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some templates serialise the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(ToolCall(call["name"], error=f"the arguments of {call['name']!r} must be a JSON object"))
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls
