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
from typing import Any, Sequence

import requests
import torch
import torch.distributed as dist

from engine.config.reward_model import JudgeConfig


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
        error: Exception | None = None
        for attempt in range(self.config.max_retries + 1):
            try:
                response = requests.get(f"{self.url}/v1/models", headers=self.headers, timeout=self.config.timeout_s)
                response.raise_for_status()
                return response.json()["data"][0]["id"]
            except (requests.RequestException, KeyError, IndexError, ValueError) as caught:
                error = caught
                time.sleep(min(2.0 ** attempt, 30.0))
        raise JudgeError(f"{self._where()}: /v1/models did not answer after {self.config.max_retries + 1} tries "
                         f"(reward_model.judge.max_retries): {error}")

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
        error = ""
        for attempt in range(config.max_retries + 1):
            if attempt:
                time.sleep(min(2.0 ** (attempt - 1), 30.0))
            try:
                answer = requests.post(f"{self.url}/v1/chat/completions", json=payload, headers=self.headers,
                                       timeout=config.timeout_s)
                answer.raise_for_status()
                reply = answer.json()["choices"][0]["message"]["content"] or ""
            except requests.Timeout:
                error = f"no answer within reward_model.judge.timeout_s={config.timeout_s:g}s"
                continue
            except (requests.RequestException, KeyError, IndexError, ValueError) as caught:
                error = f"{type(caught).__name__}: {caught}"
                continue
            score = self.parse(reply)
            if score is None:
                return Verdict(None, f"reply {reply[:200]!r} has no score matching reward_model.judge.score_pattern")
            return Verdict(score)
        return Verdict(None, f"{config.max_retries + 1} tries failed, last: {error}")

    def judge(self, prompts: Sequence[str], responses: Sequence[str]) -> list[Verdict]:
        """Verdicts of (prompt, response) pairs, in order; up to ``max_concurrency`` in flight."""
        if not responses:
            return []
        workers = min(self.config.max_concurrency, len(responses))
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self.judge_one, prompts, responses))

    def score_on_all_ranks(self, messages: Sequence[Sequence[dict[str, str]]], responses: Sequence[str]
                           ) -> tuple[torch.Tensor, dict[str, float]]:
        """Judge scores of the global batch (every rank passes the same one; rank r sends rows
        r, r + W, ...), ``[B]`` float32 on every rank, and ``reward/judge/failed_fraction``.

        Raises ``JudgeError`` on every rank when a response has no verdict and no fallback is set."""
        prompts = [conversation_text(m) for m in messages]
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = self.judge(prompts[rank::world], responses[rank::world])
        verdicts: list[Any] = [None] * len(responses)
        if world > 1:
            shares: list[Any] = [None] * world
            dist.all_gather_object(shares, mine)
            for owner, share in enumerate(shares):
                verdicts[owner::world] = share
        else:
            verdicts = mine
        failed, fallback = [v for v in verdicts if v.score is None], self.config.fallback_score
        if failed and fallback is None:
            raise JudgeError(f"{self._where()} could not score {len(failed)} of {len(verdicts)} responses; first: "
                             f"{failed[0].error}. Set reward_model.judge.fallback_score to train on regardless.")
        scores = [fallback if v.score is None else v.score for v in verdicts]
        return (torch.tensor(scores, dtype=torch.float32),
                {"reward/judge/failed_fraction": len(failed) / max(len(verdicts), 1)})
