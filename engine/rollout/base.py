"""The rollout interface the trainer talks to, whatever generates the tokens.

Log-prob definition (both engines return exactly this, and the trainer recomputes the same):
``log_prob[t] = log_softmax(logits[t] / T)[token[t]]`` with ``T = temperature`` for
``temperature > 0`` and ``T = 1`` for greedy (``temperature == 0``), computed in float32 from the
full-vocabulary logits *before* top-k/top-p filtering (no renormalisation over the kept tokens).

This is what SGLang 0.5.23 returns (``Sampler.forward``: logits are divided by the temperature,
``log(softmax(.))`` is taken, and top-k/top-p only decide which token is drawn); greedy requests
become ``temperature=1, top_k=1`` there, hence ``T = 1``. Checked against a real server in
``tests/test_rollout_contract.py``.

Top-k and top-p are applied jointly on the temperature-scaled distribution, as SGLang does:
the token of rank ``r`` (0 = most probable) is kept iff ``r < top_k`` and the probability mass of
the tokens ranked above it is ``<= top_p``.

A sequence ends at the first token in ``stop_token_ids`` or the engine's EOS ids (the stop token
is part of the response) with finish reason ``"stop"``; at ``max_new_tokens`` with ``"length"``;
or, when generation is paused with ``mode="abort"``, with ``"abort"`` (the tokens produced so far).
"""
from __future__ import annotations

import abc
import dataclasses
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import torch

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")
# What a colocated engine gives back to training, by SGLang's names for them (its memory saver's
# tags, sglang/srt/constants.py): the served weights, the KV cache and the captured CUDA graphs.
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
MEMORY_TAGS: tuple[str, ...] = (WEIGHTS, KV_CACHE, CUDA_GRAPH)


class RolloutError(RuntimeError):
    """A rollout engine could not do what was asked (server down, update rejected, ...)."""


class WeightUpdateError(RolloutError):
    """A weight update was rejected, timed out, or named a tensor the model does not have."""


class RolloutServerDied(RolloutError):
    """A server the engine may restart (``rollout.max_server_restarts``) died during ``generate``:
    ``completed`` holds the samples of the prompts answered before, by prompt index; the others are
    to be sent again once ``restart_dead_servers`` has run and the current weights are pushed."""

    def __init__(self, message: str, completed: dict[int, list[RolloutSample]]) -> None:
        super().__init__(message)
        self.completed = completed


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by every prompt of one ``generate`` call.

    Validated on construction, so a bad value never reaches an engine.
    """

    max_new_tokens: int = 256
    # 0 means greedy (argmax); log-probs are then those of T = 1.
    temperature: float = 1.0
    # Nucleus sampling: keep the smallest prefix of the sorted distribution whose mass reaches top_p.
    top_p: float = 1.0
    # -1 disables top-k.
    top_k: int = -1
    # Samples per prompt (GRPO/RLOO-style groups).
    n: int = 1
    # Extra token ids that end a sequence, on top of the model's EOS ids.
    stop_token_ids: tuple[int, ...] = ()
    # Neither EOS nor stop_token_ids end a sequence (fixed-length generation, benchmarks).
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        def reject(field: str, value: object, rule: str) -> None:
            raise ValueError(f"SamplingParams.{field}={value!r} is invalid: {rule}")

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            reject("max_new_tokens", self.max_new_tokens, "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) or self.temperature < 0:
            reject("temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            reject("top_p", self.top_p, "must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            reject("top_k", self.top_k, "must be -1 (disabled) or an integer >= 1")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            reject("n", self.n, "must be an integer >= 1")
        stop_ids = tuple(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stop_ids):
            reject("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def log_prob_temperature(self) -> float:
        """The T of the log-prob definition: the temperature, or 1 for greedy."""
        return 1.0 if self.is_greedy else float(self.temperature)


@dataclasses.dataclass
class RolloutSample:
    """One generated response."""

    token_ids: list[int]
    # log_softmax(logits / T) of each sampled token (see the module docstring); len == len(token_ids)
    log_probs: list[float]
    finish_reason: FinishReason
    # MoE models, where the engine reports it: the experts each token of prompt + response was routed
    # to, the last token excepted (it was never fed back), [tokens - 1, MoE layers, top-k] int16;
    # SGLang's return_routed_experts layout.
    routed_experts: torch.Tensor | None = None
    # The weight version that sampled each token (``set_weight_version``), where the engine tags
    # them (SGLang): a generation paused for a weight push and continued has two.
    policy_versions: list[int] | None = None


@dataclasses.dataclass
class WeightUpdateStats:
    """What one ``update_weights`` call moved and how long it took."""

    num_tensors: int
    num_buckets: int
    total_bytes: int
    seconds: float


def validate_prompts(prompt_token_ids: Sequence[Sequence[int]], vocab_size: int | None = None) -> list[list[int]]:
    """Check a batch of token-id prompts early; the error names the prompt index."""
    prompts = []
    for index, prompt in enumerate(prompt_token_ids):
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError(f"prompt {index} is empty: every prompt needs at least one token id")
        bad = [t for t in prompt if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise ValueError(f"prompt {index} has token ids outside [0, {vocab_size}): {bad[:5]}")
        prompts.append(prompt)
    return prompts


def iter_weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_megabytes: float
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of ``(hf_name, tensor)`` into buckets of at most ``bucket_megabytes``.

    A tensor larger than the bucket gets a bucket of its own. A bucket never mixes dtypes, so it can
    be sent as one flat byte buffer without alignment padding.
    """
    if not bucket_megabytes > 0:
        raise ValueError(f"bucket_megabytes={bucket_megabytes!r} must be > 0")
    limit = int(bucket_megabytes * 1024 * 1024)
    bucket: list[tuple[str, torch.Tensor]] = []
    bucket_bytes = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, expected a torch.Tensor")
        size = tensor.numel() * tensor.element_size()
        if bucket and (bucket_bytes + size > limit or tensor.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, bucket_bytes = [], 0
        bucket.append((name, tensor))
        bucket_bytes += size
    if bucket:
        yield bucket


class RolloutEngine(abc.ABC):
    """Generates responses for token-id prompts and takes weight updates from the trainer.

    Weight updates stream: ``begin_weight_update()``, then ``push_weights(bucket)`` once per bucket of
    ``(hf_name, tensor)`` pairs (HF parameter names, e.g. ``model.layers.0.self_attn.q_proj.weight``),
    then ``end_weight_update()``; ``update_weights`` does all three for an iterable.
    """

    # Whether ``generate`` may be called from several threads at once, each call served as it comes
    # (servers): multi-turn trajectories then send each turn on its own instead of in batches.
    concurrent_requests: bool = False

    @abc.abstractmethod
    def generate(
        self, prompt_token_ids: Sequence[Sequence[int]], sampling_params: SamplingParams
    ) -> list[list[RolloutSample]]:
        """Return ``sampling_params.n`` samples for each prompt: ``result[prompt_index][sample_index]``."""

    @abc.abstractmethod
    def begin_weight_update(self) -> None:
        """Open a weight-update session (generation must be idle or paused)."""

    @abc.abstractmethod
    def push_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of ``(hf_name, tensor)`` into the served model."""

    @abc.abstractmethod
    def end_weight_update(self) -> None:
        """Close the session; cached prefixes computed with the old weights are dropped."""

    def push_adapters(self, tensors: dict[str, torch.Tensor], peft_config: dict) -> None:
        """Serve the base model with these LoRA adapters from now on (``rollout.lora_sync=adapters``):
        PEFT's tensor names (``base_model.model.<module>.lora_A.weight``) and ``adapter_config.json``
        fields. They replace the adapters pushed before; a weight push (``begin_weight_update``)
        drops them, since the merged weights it brings already hold them. The base weights stay as
        loaded, across ``release_memory`` too."""
        raise WeightUpdateError(f"{type(self).__name__} does not serve LoRA adapters; use "
                                "actor_rollout_ref.rollout.lora_sync=merged")

    def set_weight_version(self, version: int) -> None:
        """Name the weights just pushed (the policy version that trains from them); engines that
        tag each sampled token with it (``RolloutSample.policy_versions``) override this."""

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_megabytes: float = 512.0
    ) -> WeightUpdateStats:
        """Push a whole stream of weights, ``bucket_megabytes`` at a time, inside one session."""
        start = time.perf_counter()
        num_tensors = num_buckets = total_bytes = 0
        self.begin_weight_update()
        try:
            for bucket in iter_weight_buckets(named_tensors, bucket_megabytes):
                self.push_weights(bucket)
                num_buckets += 1
                num_tensors += len(bucket)
                total_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
        finally:
            self.end_weight_update()
        return WeightUpdateStats(num_tensors, num_buckets, total_bytes, time.perf_counter() - start)

    @abc.abstractmethod
    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Free the memory of ``tags`` (``MEMORY_TAGS``) for training; colocated mode.

        Released weights lose their values: resume them, then push weights before generating.
        """

    @abc.abstractmethod
    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        """Take the memory of ``tags`` back after ``release_memory``. The order SGLang needs for a
        weight sync is: resume weights, push the weights, resume the KV cache and CUDA graphs (the
        cache is only allocated once the weights are in place, so the two never peak together)."""

    @abc.abstractmethod
    def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop generating. ``abort``: in-flight requests return now with finish reason "abort";
        ``retract`` / ``in_place``: they wait and continue after ``continue_generation``.
        Requests arriving while paused wait."""

    @abc.abstractmethod
    def continue_generation(self) -> None:
        """Undo ``pause_generation``."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve; raises ``RolloutError`` if it has crashed."""

    def dead_servers(self) -> int:
        """How many of its servers died and wait for ``restart_dead_servers``."""
        return 0

    def restart_dead_servers(self) -> int:
        """Start again, on the same devices, the servers that died (``RolloutServerDied``; a death
        during a weight update or a memory call is only recorded, so that the collective sync around
        it goes on); returns how many. They serve their start-up weights: push the current ones
        before generating. Engines with no servers of their own have none to restart."""
        return 0

    def servers_restarted(self) -> None:
        """A server of the job was restarted, by this engine or another rank's (collective, before the
        weight push that follows): forget whatever connection held the dead one."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release everything the engine holds (processes, memory). Safe to call twice."""

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


def sglang_static_pool_bytes(free_at_start_bytes: float, mem_fraction_static: float) -> float:
    """SGLang's weights + KV-cache pool (sglang 0.5.23, ``srt/mem_cache/kv_cache_configurator.py``,
    ``_profile_available_bytes``): the KV cache gets what is free after loading the weights less
    (1 - fraction) of what was free before loading, so weights + KV cache = fraction x the memory free
    before loading, which SGLang measures when it starts (``srt/distributed/bootstrap.py``,
    ``measure_pre_model_load_memory``)."""
    return mem_fraction_static * free_at_start_bytes


def check_memory_tags(tags: Sequence[str]) -> tuple[str, ...]:
    unknown = [tag for tag in tags if tag not in MEMORY_TAGS]
    if unknown or not tags:
        raise ValueError(f"memory tags {list(tags)!r}: expected a non-empty subset of {MEMORY_TAGS}")
    return tuple(tags)


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode {mode!r} is not one of {PAUSE_MODES}")
