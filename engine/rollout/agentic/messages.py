"""Token ids of the messages appended between turns, as the chat template renders them.

A trajectory's tokens are the prompt, then each assistant turn exactly as the engine sampled it,
then the appended messages (tool results, an environment's user turns) tokenized on their own.
Nothing the model wrote is decoded and tokenized again, so the trainer trains on the sampled ids.

The appended text is the chat template's own: the template renders a fixed conversation ending in an
assistant turn, then the same conversation with the new messages (and the generation prompt); the
difference is what the model would see. What the template writes after the assistant turn's
end-of-turn token (Qwen's newline after ``<|im_end|>``) the model did not sample, so it leads the
appended text.
"""
from __future__ import annotations

from typing import Any

_PLACEHOLDER = "TRIDENT_PLACEHOLDER"
_BASE = ({"role": "user", "content": _PLACEHOLDER}, {"role": "assistant", "content": _PLACEHOLDER})


class MessageTokens:
    """Renders appended messages with ``tokenizer``'s chat template (once per distinct last token)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._base = tokenizer.apply_chat_template(list(_BASE), tokenize=False)
        cut = self._base.rfind(_PLACEHOLDER)
        if cut < 0:
            raise ValueError("the chat template does not render an assistant message's content; "
                             "multi-turn rollouts need one that does")
        self._after_assistant = self._base[cut + len(_PLACEHOLDER):]  # e.g. "<|im_end|>\n"
        self._separators: dict[int, str] = {}

    def _separator(self, last_token: int | None) -> str:
        """What the template writes after the assistant's content that ``last_token`` did not write."""
        if last_token not in self._separators:
            written = "" if last_token is None else self.tokenizer.decode([last_token], skip_special_tokens=False)
            tail = self._after_assistant
            self._separators[last_token] = tail[len(written):] if written and tail.startswith(written) else tail
        return self._separators[last_token]

    def text(self, messages: list[dict], last_token: int | None) -> str:
        """The text ``messages`` add after an assistant turn ending in ``last_token``, generation prompt included."""
        rendered = self.tokenizer.apply_chat_template([*_BASE, *messages], add_generation_prompt=True, tokenize=False)
        if not rendered.startswith(self._base):
            raise ValueError(f"the chat template renders an earlier conversation differently once "
                             f"{[m['role'] for m in messages]} messages follow; multi-turn rollouts need a "
                             f"template that only appends")
        return self._separator(last_token) + rendered[len(self._base):]

    def ids(self, messages: list[dict], last_token: int | None) -> list[int]:
        return self.tokenizer(self.text(messages, last_token), add_special_tokens=False)["input_ids"]
