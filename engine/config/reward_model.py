"""``reward_model.*``: how responses are scored. Three sources, combined into one reward per response:

- rule functions by ``data_source`` (``custom_reward_function``, the Ray pool keys);
- a learned reward model (``enable``, ``model``, ``megatron``): an HF ``*ForSequenceClassification``
  checkpoint, frozen, on the Megatron mesh (``engine.roles.reward_model``);
- an LLM judge (``judge``) behind an OpenAI-compatible endpoint (``engine.rewards.judge``).

``combine`` says how their scores make the reward (``engine.rewards.combine``). Plain dataclasses,
no torch: a Ray reward worker imports this module.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import II

from engine.config.model import FrozenMegatronConfig

COMBINE_MODES = ("sum", "gated")

DEFAULT_JUDGE_PROMPT = (
    "Rate how well the response answers the question, from 0 (wrong or useless) to 10 (correct and "
    "complete). Reply with the number only.\n\nQuestion:\n{prompt}\n\nResponse:\n{response}\n\nScore:"
)


@dataclass
class CustomRewardFunctionConfig:
    """`reward_model.custom_reward_function.*`: a user `compute_score` loaded from a Python file.

    Attributes:
        path: the .py file; None uses the built-in scorers (chosen by `data_source`).
        name: the function in that file, called as
            `name(data_source, solution_str, ground_truth, extra_info) -> float | dict`.
    """

    path: str | None = None
    name: str = "compute_score"


@dataclass
class RewardModelCheckpointConfig:
    """``reward_model.model.*``: the learned reward model's checkpoint.

    Attributes:
        path: HF folder of a ``*ForSequenceClassification`` model with one label (Llama / Qwen2, as
            TRL's RewardTrainer or OpenRLHF save it).
        tokenizer_path: its tokenizer; null = ``path``. When its vocabulary or chat template
            differs from the policy's, each conversation is re-rendered with the reward model's
            template and re-tokenized (``reward/model/retokenize_s`` says what it costs).
        trust_remote_code: let transformers run code shipped with the tokenizer.
        use_remove_padding: pack the sequences of a micro-batch (THD), as the other roles do.
    """

    path: str | None = None
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    use_remove_padding: bool = True


@dataclass
class RewardCombineConfig:
    """``reward_model.combine.*``: the reward of a response from its rule, model and judge scores.

    ``sum``:   r = rule_weight * rule + model_weight * model + judge_weight * judge
    ``gated``: as ``sum``, but the model and judge terms count only for responses whose rule score
    is at least ``gate_threshold`` (a wrong answer cannot be talked up by the reward model).

    Sources that are off (no reward model, no judge) contribute nothing. With ``rule_weight: 0``
    the rule score is still computed and logged (``reward/rule/mean``) when the data sources have a
    scorer, so a run trained on the reward model alone still shows its accuracy.

    Attributes:
        mode: ``sum`` or ``gated``.
        rule_weight, model_weight, judge_weight: weights of the three scores.
        gate_threshold: the rule score at or above which the gated terms count.
        normalize_model_score: whiten the model score over each global batch (mean 0, std 1) before
            clipping and weighting, as OpenRLHF's ``normalize_reward`` does.
        model_score_clip: clip the (normalised) model score to [-clip, clip]; null = no clip.
        reward_clip: clip the combined reward to [-clip, clip]; null = no clip.
    """

    mode: str = "sum"
    rule_weight: float = 1.0
    model_weight: float = 1.0
    judge_weight: float = 1.0
    gate_threshold: float = 1.0
    normalize_model_score: bool = False
    model_score_clip: float | None = None
    reward_clip: float | None = None

    @property
    def needs_rule_scores(self) -> bool:
        """The rule score weighs in the reward or gates it (otherwise it is only logged)."""
        return self.rule_weight != 0 or self.mode == "gated"


@dataclass
class JudgeModelConfig:
    """``reward_model.judge.model.*``: the judge model, served by an SGLang server Trident starts on
    global rank 0 (when ``judge.url`` is null).

    Attributes:
        path: HF model folder of the judge.
        name: the model name sent in requests; null = what the endpoint lists first at ``/v1/models``.
        tensor_model_parallel_size: SGLang ``--tp-size`` of the judge server.
        dtype: its weight precision.
        gpu_memory_utilization: SGLang ``--mem-fraction-static`` (the judge shares rank 0's GPUs
            with training, so keep it small).
        startup_timeout_s: how long the server may take to load.
    """

    path: str | None = None
    name: str | None = None
    tensor_model_parallel_size: int = 1
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.2
    startup_timeout_s: float = 1800.0


@dataclass
class JudgeConfig:
    """``reward_model.judge.*``: an LLM judge (generative reward) over an OpenAI-compatible chat API.

    Each response is sent as one chat request (``prompt_template`` filled with the conversation and
    the response); the first number matching ``score_pattern`` in the reply, clipped to
    [0, max_score] and divided by ``max_score``, is its judge score in [0, 1]. Requests of a rank run
    concurrently (the server batches them).

    Attributes:
        enable: score with the judge.
        url: base URL of the endpoint (``http://host:port``, requests go to ``/v1/chat/completions``);
            null = start an SGLang server from ``judge.model.path``.
        api_key_env: environment variable holding the endpoint's API key (sent as a Bearer token;
            the key itself never appears in the config or the logs).
        model: the judge model (see ``JudgeModelConfig``).
        prompt_template: with ``{prompt}`` (the conversation's text) and ``{response}``.
        score_pattern: regular expression whose first group (or whole match) is the score.
        max_score: the top of the judge's scale.
        max_tokens: longest reply.
        temperature: judge sampling temperature (0 = greedy, reproducible).
        max_concurrency: requests in flight per rank.
        timeout_s: the longest one request may take.
        max_retries: further tries of a failed request (connection error, timeout, HTTP error,
            malformed answer), with exponential back-off from 1 s; a reply without a score is not
            tried again (a greedy judge would repeat it).
        fallback_score: the judge score of a response whose requests all failed; null = stop the
            run with an error naming the endpoint instead (every rank, no hang).
    """

    enable: bool = False
    url: str | None = None
    api_key_env: str | None = None
    model: JudgeModelConfig = field(default_factory=JudgeModelConfig)
    prompt_template: str = DEFAULT_JUDGE_PROMPT
    score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    max_score: float = 10.0
    max_tokens: int = 16
    temperature: float = 0.0
    max_concurrency: int = 16
    timeout_s: float = 120.0
    max_retries: int = 2
    fallback_score: float | None = None


@dataclass
class OverlongBufferConfig:
    """``reward_model.overlong_buffer.*``: DAPO's overlong reward shaping (Yu et al. 2025, eq. 13;
    verl's keys). A response longer than ``data.max_response_length - len`` tokens gets a penalty
    that grows linearly over the last ``len`` tokens, from 0 to ``-penalty_factor`` at the limit:
    ``min(0, (max_response_length - len - length) / len) * penalty_factor``, added to the reward
    (``engine.algo.dapo.overlong_penalty``); logged as ``reward/overlong_penalty/mean``.

    Attributes:
        enable: apply the penalty.
        len: the buffer, in tokens (0 < len <= data.max_response_length).
        penalty_factor: the penalty at the length limit (>= 0).
    """

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass
class RewardConfig:
    """`reward_model.*` settings.

    Attributes:
        enable: score responses with the learned reward model of ``model.path`` (verl's key).
        model: the reward model's checkpoint and tokenizer.
        micro_batch_size_per_gpu: sequences per forward of the scoring pass; defaults to the
            rollout's log-prob micro-batch.
        use_dynamic_bsz: cut micro-batches by ``forward_max_token_len_per_gpu`` instead.
        forward_max_token_len_per_gpu: token budget of one dynamic micro-batch.
        megatron: the reward model's layout (defaults to, and must equal, the actor's: one mesh)
            and precision.
        combine: how rule, model and judge scores make the reward.
        judge: the LLM judge.
        custom_reward_function: optional user function (see `CustomRewardFunctionConfig`).
        overlong_buffer: DAPO's penalty on responses near the length limit.
        reward_kwargs: extra keyword arguments passed to every compute_score call (the built-in
            one takes `gsm8k_format_score`: the score of a well-formed but wrong GSM8K answer).
        num_workers: 0 scores in the trainer process; > 0 scores in that many Ray CPU workers.
        num_cpus_per_worker: CPUs Ray reserves for each worker.
        max_failed_fraction: a training step in which at least this fraction of the reward calls
            failed (raised, or returned a non-numeric or non-finite score; such responses score 0)
            counts as a failing step.
        max_failed_steps: stop the run, with the function's first error, after this many failing
            steps in a row (training on zeros wastes the run); 0 never stops.
    """

    enable: bool = False
    model: RewardModelCheckpointConfig = field(default_factory=RewardModelCheckpointConfig)
    micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    forward_max_token_len_per_gpu: int = 32768
    megatron: FrozenMegatronConfig = field(default_factory=FrozenMegatronConfig)
    combine: RewardCombineConfig = field(default_factory=RewardCombineConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    num_workers: int = 0
    num_cpus_per_worker: float = 1.0
    max_failed_fraction: float = 0.5
    max_failed_steps: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.custom_reward_function, dict):
            self.custom_reward_function = CustomRewardFunctionConfig(**self.custom_reward_function)
        if self.num_workers < 0:
            raise ValueError(f"reward_model.num_workers={self.num_workers}: must be >= 0")
        if not 0 < self.max_failed_fraction <= 1:
            raise ValueError(f"reward_model.max_failed_fraction={self.max_failed_fraction}: must be in (0, 1]")
        if self.max_failed_steps < 0:
            raise ValueError(f"reward_model.max_failed_steps={self.max_failed_steps}: must be >= 0 (0 never stops)")


def experiment_reward_model() -> RewardConfig:
    """The ``reward_model`` section of an experiment: the reward model sits on the actor's mesh in the
    actor's precision and batches like the rollout's log-prob pass, unless the YAML says otherwise."""
    actor = "actor_rollout_ref.actor"
    megatron = FrozenMegatronConfig(**{name: II(f"{actor}.megatron.{name}") for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
        "context_parallel_size", "cp_comm_type", "expert_model_parallel_size", "expert_tensor_parallel_size",
        "sequence_parallel", "param_dtype")})
    return RewardConfig(
        megatron=megatron,
        micro_batch_size_per_gpu=II("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
        use_dynamic_bsz=II(f"{actor}.use_dynamic_bsz"),
        forward_max_token_len_per_gpu=II("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"),
    )
