"""An LLM judge (generative reward) behind an OpenAI-compatible chat endpoint (``reward_model.judge``).

Every response becomes one ``/v1/chat/completions`` request; a rank sends its share of the batch
concurrently (the server batches what is in flight) and the ranks' results are all-gathered, so
every rank holds every judge score. A request that fails (connection refused, timeout, HTTP error)
is retried with back-off; one whose reply holds no score is not (a greedy judge would repeat it).
When requests keep failing the run stops on every rank with an error naming the endpoint, unless
``fallback_score`` is set. Nothing waits without a deadline: each request has ``timeout_s``.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import time
from dataclasses import dataclass
from typing import Sequence

import requests
import torch

from engine.config.reward_model import JudgeConfig
from engine.rewards.spmd import strided_on_all_ranks


class JudgeError(RuntimeError):
    """The judge could not score responses and no ``reward_model.judge.fallback_score`` is set."""


@dataclass
class Verdict:
    """One response's judge score in [0, 1], or why there is none."""

    score: float | None
    error: str | None = None


def conversation_text(messages: Sequence[dict[str, str]]) -> str:
    """The prompt as the judge reads it: a lone user turn as is, else ``role: content`` lines."""
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n".join(f"{message['role']}: {message['content']}" for message in messages)


class JudgeClient:
    """Scores responses with the judge at ``url`` (``http://host:port``).

    Args:
        config: ``reward_model.judge``.
        url: the endpoint's base URL.
        server_log: where the server Trident started writes its log (named in errors), if any.
    """

    def __init__(self, config: JudgeConfig, url: str, server_log: str | None = None) -> None:
        self.config = config
        self.url = url.rstrip("/")
        self.server_log = server_log
        self.pattern = re.compile(config.score_pattern)
        self.headers = {}
        if config.api_key_env:
            key = os.environ.get(config.api_key_env)
            if not key:
                raise JudgeError(f"reward_model.judge.api_key_env={config.api_key_env!r}: that environment variable "
                                 f"is not set on this rank")
            self.headers["Authorization"] = f"Bearer {key}"
        self.model_name = config.model.name or self._served_model()

    def _where(self) -> str:
        return f"judge at {self.url}" + (f" (server log {self.server_log})" if self.server_log else "")

    def _served_model(self) -> str:
        """The first model the endpoint lists (what SGLang serves)."""
        name, error = self._with_retries(lambda: requests.get(
            f"{self.url}/v1/models", headers=self.headers, timeout=self.config.timeout_s), lambda body: body["data"][0]["id"])
        if name is None:
            raise JudgeError(f"{self._where()}: /v1/models did not answer: {error}")
        return name

    def _with_retries(self, send, read):
        """``read(send().json())``, tried 1 + ``max_retries`` times with back-off from 1 s; returns
        (value, "") or (None, why the last try failed)."""
        config, error = self.config, ""
        for attempt in range(config.max_retries + 1):
            if attempt:
                time.sleep(min(2.0 ** (attempt - 1), 30.0))
            try:
                response = send()
                response.raise_for_status()
                return read(response.json()), ""
            except requests.Timeout:
                error = f"no answer within reward_model.judge.timeout_s={config.timeout_s:g}s"
            except (requests.RequestException, KeyError, IndexError, ValueError) as caught:
                error = f"{type(caught).__name__}: {caught}"
        return None, f"{config.max_retries + 1} tries failed (reward_model.judge.max_retries), last: {error}"

    def parse(self, reply: str) -> float | None:
        """The reply's score scaled to [0, 1]; None if it holds no number."""
        match = self.pattern.search(reply)
        if match is None:
            return None
        try:
            value = float(match.group(1) if match.groups() else match.group(0))
        except ValueError:
            return None
        return min(max(value, 0.0), self.config.max_score) / self.config.max_score

    def judge_one(self, prompt: str, response: str) -> Verdict:
        config = self.config
        payload = {
            "model": self.model_name,
            "messages": [{"role": "user", "content": config.prompt_template.format(prompt=prompt, response=response)}],
            "max_tokens": config.max_tokens, "temperature": config.temperature,
        }
        reply, error = self._with_retries(
            lambda: requests.post(f"{self.url}/v1/chat/completions", json=payload, headers=self.headers,
                                  timeout=config.timeout_s),
            lambda body: body["choices"][0]["message"]["content"] or "")
        if reply is None:
            return Verdict(None, error)
        score = self.parse(reply)
        if score is None:
            return Verdict(None, f"reply {reply[:200]!r} has no score matching reward_model.judge.score_pattern")
        return Verdict(score)

    def judge(self, pairs: Sequence[tuple[str, str]]) -> list[Verdict]:
        """Verdicts of (prompt, response) pairs, in order; up to ``max_concurrency`` in flight."""
        if not pairs:
            return []
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(self.config.max_concurrency, len(pairs))) as pool:
            return list(pool.map(lambda pair: self.judge_one(*pair), pairs))

    def score_on_all_ranks(self, messages: Sequence[Sequence[dict[str, str]]], responses: Sequence[str]
                           ) -> tuple[torch.Tensor, dict[str, float]]:
        """Judge scores of the global batch (every rank passes the same one; rank r sends rows
        r, r + W, ...), ``[B]`` float32 on every rank, and ``reward/judge/failed_fraction``.

        Raises ``JudgeError`` on every rank when a response has no verdict and no fallback is set."""
        prompts = [conversation_text(m) for m in messages]
        verdicts = strided_on_all_ranks(self.judge, list(zip(prompts, responses)))
        failed, fallback = [v for v in verdicts if v.score is None], self.config.fallback_score
        if failed and fallback is None:
            raise JudgeError(f"{self._where()} could not score {len(failed)} of {len(verdicts)} responses; first: "
                             f"{failed[0].error}. Set reward_model.judge.fallback_score to train on regardless.")
        scores = [fallback if v.score is None else v.score for v in verdicts]
        return (torch.tensor(scores, dtype=torch.float32),
                {"reward/judge/failed_fraction": len(failed) / max(len(verdicts), 1)})
