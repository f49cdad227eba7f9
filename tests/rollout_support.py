"""Shared pieces of the rollout tests: a tiny random Llama on disk and an HF teacher-forced reference."""
from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

VOCAB_SIZE = 256
# SGLang's context limit for the tiny model (prompt + max_new_tokens must fit).
MAX_POSITIONS = 512
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [40]]

requires_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="SGLang is not installed (make sglang / bash launch/install/sglang_cpu.sh .venv/bin/python)",
)
SGLANG_MARKS = [pytest.mark.sglang, pytest.mark.slow, requires_sglang]


def start_cpu_sglang(model_path: Path | str, run_dir: Path | str, rollout: dict | None = None, **launch):
    """A real SGLang engine on CPU with the test settings: fp32, a small memory fraction, a long
    start-up allowance, and one OpenMP thread (two shared cores; the server inherits the env).
    ``rollout``: more ``RolloutConfig`` fields; ``launch``: ``SGLangRolloutConfig`` fields."""
    from engine.config import RolloutConfig
    from engine.rollout import create_rollout_engine

    settings = RolloutConfig(name="sglang", gpu_memory_utilization=0.05, dtype="float32", startup_timeout_s=600,
                             **(rollout or {}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        return create_rollout_engine(settings, str(model_path), run_dir=str(run_dir), **launch)


@dataclasses.dataclass
class TinyModel:
    path: Path
    model: transformers.LlamaForCausalLM
    # A prompt whose greedy continuation hits the model's EOS as its 3rd token.
    eos_prompt: list[int]


def tiny_llama_config(eos_token_id: int = 2) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        # Logits of a few units: distributions uneven enough for top-k/top-p to matter, small enough
        # that fp32 round-off stays well under the 1e-5 log-prob tolerance.
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )


def random_llama(seed: int, eos_token_id: int = 2) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(eos_token_id)).float().eval()


@torch.no_grad()
def greedy_tokens(model: transformers.LlamaForCausalLM, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by repeated full forwards (no KV cache, no generate)."""
    sequence = list(prompt)
    for _ in range(steps):
        sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
    return sequence[len(prompt) :]


def build_tiny_model(directory: Path, seed: int = 0) -> TinyModel:
    """Save a random Llama whose EOS is the 3rd greedy token of ``eos_prompt``."""
    model = random_llama(seed)
    eos_prompt = [20, 21, 22]
    first_three = greedy_tokens(model, eos_prompt, 3)
    assert first_three[2] not in first_three[:2], "pick another eos_prompt: EOS would fire earlier"
    model.config.eos_token_id = first_three[2]
    model.generation_config.eos_token_id = first_three[2]
    model.save_pretrained(directory)
    return TinyModel(Path(directory), model, eos_prompt)


@torch.no_grad()
def teacher_forced_logits(model: transformers.LlamaForCausalLM, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Logits that predicted each response token: one unpadded, uncached forward of prompt+response
    by a float64 copy of the model (independent of the engines' fp32 round-off)."""
    sequence = torch.tensor([prompt + response])
    logits = copy.deepcopy(model).double()(sequence).logits[0]
    return logits[len(prompt) - 1 : len(prompt) + len(response) - 1]


def reference_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the response tokens, T = 1 for greedy (the documented definition)."""
    scale = 1.0 if temperature == 0 else temperature
    logits = teacher_forced_logits(model, prompt, response)
    return torch.log_softmax(logits / scale, dim=-1).gather(1, torch.tensor(response).view(-1, 1)).squeeze(1)


@dataclasses.dataclass
class SharedServer:
    """One real SGLang server serving the tiny Llama, shared by the tests of a pytest process that
    only need "a server serving this model" (``tests/conftest.py``, ``shared_tiny_sglang``). Tests
    that kill, restart or configure a server start their own."""

    engine: Any
    tiny: TinyModel
    last_version: int = 0

    def serve_tiny_weights(self) -> Any:
        """Push the tiny model's own weights (by tensor, as the engine starts) under a version of this
        test's own, and check that the server samples with it: no test depends on another's pushes."""
        self.engine.weight_transport = "tensor"
        self.engine.update_weights(self.tiny.model.state_dict().items(), bucket_megabytes=1.0)
        self.last_version += 1
        self.engine.set_weight_version(self.last_version)
        from engine.rollout import SamplingParams

        (sample,), = self.engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=1, temperature=0.0))
        assert sample.policy_versions == [self.last_version], (sample.policy_versions, self.last_version)
        return self.engine
