"""``actor_rollout_ref.*``: the policy being trained, its rollout engine and the frozen reference.

Each class here is the one settings class of its component: ``ActorConfig`` of the actor role and
the policy loss (``engine.roles.actor``, ``engine.algo.losses``), ``RefConfig`` of the reference
role, ``RolloutConfig`` of the rollout engines and the weight sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import II

from engine.config.model import MegatronConfig, OptimConfig, PolicyModelConfig

ROLLOUT_MODES = ("colocated", "disaggregated")
ROLLOUT_DTYPES = ("bfloat16", "float16", "float32")
WEIGHT_SYNC_TARGETS = ("sharded", "full")
LORA_SYNCS = ("merged", "adapters")


# verl's Ulysses sequence parallelism, read as megatron's context parallelism (engine.config.loader).
ULYSSES_KEY = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"

@dataclass
class PolicyLossConfig:
    """``actor_rollout_ref.actor.policy_loss.*``.

    Attributes:
        loss_mode: the policy-gradient objective, one of ``registry.names("policy_loss")``:
            "vanilla" (PPO's clipped surrogate, Schulman et al. 2017) or "gspo" (sequence-level ratio).
    """

    loss_mode: str = "vanilla"


@dataclass
class ActorConfig:
    """``actor_rollout_ref.actor.*``: PPO updates of the policy and its loss.

    Batch sizes count *prompts*, as in verl: one mini-batch holds
    ``ppo_mini_batch_size * rollout.n`` sequences, split evenly over the data-parallel ranks and
    then into micro-batches of ``ppo_micro_batch_size_per_gpu`` sequences.

    Attributes:
        ppo_epochs: passes over each rollout batch.
        ppo_mini_batch_size: prompts per optimizer step (global).
        ppo_micro_batch_size_per_gpu: sequences per forward/backward on one rank; required unless
            ``use_dynamic_bsz``.
        use_dynamic_bsz: form micro-batches by token count (``ppo_max_token_len_per_gpu``) instead;
            also for the reference's log-prob pass.
        ppo_max_token_len_per_gpu: token budget of one dynamic micro-batch on one rank.
        shuffle: reshuffle each rollout batch into mini-batches every epoch (seeded by
            ``trainer.seed``; the same on every rank and layout); false keeps the rollout order.
        clip_ratio: PPO's epsilon; ratio clipped to [1 - clip_ratio_low, 1 + clip_ratio_high].
        clip_ratio_low: lower epsilon; null = ``clip_ratio``.
        clip_ratio_high: upper epsilon; null = ``clip_ratio`` (DAPO's clip-higher raises it).
        clip_ratio_c: dual-clip bound c > 1 for negative advantages (Ye et al. 2020); null disables.
        loss_agg_mode: how per-token losses become one number, one of
            ``registry.names("loss_agg_mode")``.
        entropy_coeff: weight of the entropy bonus.
        use_kl_loss: add ``kl_loss_coef * KL(pi || pi_ref)`` to the loss (GRPO style).
        kl_loss_coef: weight of that KL term.
        kl_loss_type: its estimator, one of ``registry.names("kl_estimator")``.
        use_rollout_log_probs: take pi_old, the denominator of the PPO ratio, from the rollout
            engine's log-probs of the sampled tokens instead of recomputing them with the actor: one
            forward pass less per step (slime's ``--use-rollout-logprobs``). Exact when the engine
            computes the trainer's distribution (same weights and precision: ``rollout/log_prob_abs_diff``
            of a run without it is ~1e-6 for the fp32 CPU demo); with a bf16 engine the ratio then
            also absorbs the engine/trainer mismatch. Off by default.
        ulysses_sequence_parallel_size: verl's (and the seed recipe's) long-context knob, read as
            megatron's own: N > 1 sets ``megatron.context_parallel_size=N`` with ``cp_comm_type=a2a``
            (DeepSpeed-Ulysses' all-to-all over heads) for the actor, and with it the reference,
            critic and reward model that take the actor's layout; printed once at start. Setting
            ``megatron.context_parallel_size`` or ``megatron.cp_comm_type`` to something else too is
            a config error.
    """

    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    shuffle: bool = True
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    use_rollout_log_probs: bool = False
    ulysses_sequence_parallel_size: int = 1
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)

    @property
    def epsilon_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def epsilon_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass
class RefMegatronConfig:
    """``actor_rollout_ref.ref.megatron.*``: the reference's memory (its layout is the actor's).

    Attributes:
        param_offload: keep the reference's weights in host memory outside its log-prob pass
            (``parallel.offload``). With LoRA the reference is the actor itself: use
            ``actor.megatron.param_offload`` instead.
    """

    param_offload: bool = False


@dataclass
class RefConfig:
    """``actor_rollout_ref.ref.*``: log-probs of the frozen reference policy.

    It runs on the actor's Megatron layout and batches the way the actor does
    (``actor.use_dynamic_bsz``), with its own micro-batch sizes.

    Attributes:
        log_prob_micro_batch_size_per_gpu: sequences per forward on one rank; defaults to the
            actor's ``ppo_micro_batch_size_per_gpu``.
        log_prob_max_token_len_per_gpu: token budget per forward with dynamic batching; defaults to
            the actor's ``ppo_max_token_len_per_gpu``.
        megatron: see ``RefMegatronConfig``.
    """

    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_max_token_len_per_gpu: int = 16384
    megatron: RefMegatronConfig = field(default_factory=RefMegatronConfig)


@dataclass
class SamplingConfig:
    """``actor_rollout_ref.rollout.val_kwargs.*``: sampling of the validation responses (greedy by default).

    Attributes:
        n: responses per validation prompt; with n > 1 validation also reports ``val/pass_at_<n>``.
        do_sample: false = greedy decoding whatever the temperature.
        temperature, top_p, top_k: sampling; top_k = -1 disables top-k.
    """

    n: int = 1
    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1

    def sampling_params(self, max_new_tokens: int):
        """The ``engine.rollout.SamplingParams`` of these settings (greedy unless ``do_sample``)."""
        from engine.rollout.base import SamplingParams

        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature if self.do_sample else 0.0,
                              top_p=self.top_p, top_k=self.top_k)


@dataclass
class MultiTurnConfig:
    """``actor_rollout_ref.rollout.multi_turn.*``: agentic rollouts, each response a conversation with
    tools and/or an environment (``engine.rollout.agentic``; verl's keys).

    Attributes:
        enable: generate multi-turn trajectories: after each assistant turn its tool calls are run and
            their results appended as tool messages (or the environment answers), then the model
            goes on, until it answers, a turn limit, or ``data.max_response_length`` tokens across
            all turns. The trainer trains on the sampled tokens only (the loss mask); the appended
            ones are context.
        max_assistant_turns: assistant turns per trajectory at most.
        max_user_turns: environment (user) replies per trajectory at most.
        tool_config_path: YAML of the tools (verl's format: ``tools: [{class_name, config, tool_schema}]``);
            built in: ``engine.rollout.agentic.tools.CalculatorTool`` and ``PythonTool``. Their
            schemas are given to the chat template (``tools=``) when the prompts are rendered.
        interaction_config_path: YAML of the environment (verl's ``interaction: [{name, class_name,
            config}]``): it answers the model's final messages and may add a reward.
        format: how tool calls are written: "hermes" (``<tool_call>{json}</tool_call>``; Qwen, Hermes).
    """

    enable: bool = False
    max_assistant_turns: int = 5
    max_user_turns: int = 5
    tool_config_path: str | None = None
    interaction_config_path: str | None = None
    format: str = "hermes"


@dataclass
class RolloutConfig(SamplingConfig):
    """``actor_rollout_ref.rollout.*``: the generation engine, its sampling and the weight sync.

    Attributes:
        name: the engine: "torch" (HF generate inside the trainer process, for small CPU runs),
            "torch-process" (the same in a process of its own beside each replica leader, releasing and
            resuming its memory there as an SGLang server does: for GPUs without SGLang, and the
            one-GPU smoke) or "sglang" (SGLang servers).
        mode: "colocated": the engine shares the training GPUs and takes the weights from them
            (3D-HybridEngine); "disaggregated": SGLang servers on GPUs of their own, ``num_gpus`` after
            the trainer's on its node (started by rank 0) or on nodes of their own
            (``server_addresses``); each pipeline stage's data-parallel rank 0 broadcasts its
            stage's weights to them (``update_weights_from_distributed``).
        num_gpus: disaggregated mode: GPUs given to the servers, ``num_gpus / tensor_model_parallel_size``
            servers (on a machine without GPUs, server processes of that many TP ranks on the CPU);
            0 in colocated mode and with ``server_addresses``.
        server_addresses: disaggregated mode with servers on nodes of their own: ``host:port`` of each
            SGLang server, started before the trainers by ``python -m launch.rollout_servers`` (the
            Slurm script and the Ray launcher run it on the rollout nodes). The trainers attach to
            them instead of starting servers, authenticate with the job's API key (environment
            variable ``TRIDENT_ROLLOUT_API_KEY``, never logged) and broadcast the weights to them
            from the trainer nodes. Empty: rank 0 starts ``num_gpus`` worth of servers on its node.
        tensor_model_parallel_size: generation TP size of one engine replica.
        dtype: weight precision inside the engine.
        gpu_memory_utilization: fraction of GPU memory the engine may take (SGLang's
            ``mem_fraction_static``).
        n: responses sampled per prompt.
        do_sample, temperature, top_p, top_k: as in ``SamplingConfig`` (sampled by default).
        log_prob_micro_batch_size_per_gpu: sequences per forward when the actor recomputes the
            rollout's log-probs (the PPO ``old_log_prob``); defaults to the actor's micro-batch.
        log_prob_max_token_len_per_gpu: the same with dynamic batching; defaults to the actor's.
        update_weights_bucket_megabytes: size of the buckets the weights travel in to the engine.
        weight_sync_target: what each generation GPU receives from the training GPUs in colocated
            mode with SGLang. "sharded": exactly its own shard in SGLang's layout, handed to its own
            TP worker and copied into place there (no re-sharding; the bytes lower bound). "full":
            every tensor whole on every generation GPU, SGLang's loader slices it (tp times the
            bytes; the way every SGLang user pushes). Where the sharded loader does not cover the
            model (fewer key/value heads than generation TP, Megatron's padded query groups), the
            sync says so once at start and pushes full tensors. The embedded engines take full
            tensors; so do servers of their own (SGLang 0.5's ``/update_weights_from_distributed``
            broadcasts one tensor list to every TP worker of the group and slices it there).
        lora_sync: with ``model.lora_rank > 0``, what each sync pushes. "merged": W + scaling B A
            for every weight, a whole model per step; "adapters": only the LoRA adapters, the
            engine serving the base weights with LoRA enabled (SGLang's dynamic LoRA loading from
            tensors; the embedded engine the same), so a sync moves the adapters' bytes.
        check_weight_sync: after every weight update, check that the engine serves the actor's
            weights and fail loudly if not: the embedded engine's tensors are compared with
            fingerprints of the training shards (exact); for servers that cannot show their
            tensors (SGLang), the next rollout's log-probs are compared with the trainer's
            recomputation of them (no extra forward).
        check_weight_sync_tolerance: the largest mean |rollout - trainer| log-prob per response
            token that passes (fp32 gives ~1e-6, bf16 ~1e-2; wrong weights give ~1).
        startup_timeout_s: how long an SGLang server may take to load and answer (a 70B TP8 load
            with CUDA-graph capture takes minutes).
        request_timeout_s: the longest one generation request may take.
        weight_update_timeout_s: the longest one weight-update request (or broadcast) may take.
        max_server_restarts: SGLang servers the job started that die are restarted on the same GPUs,
            get the current weights, and the prompts they had not answered are sent again, up to
            this many times per engine (each rank's servers, or rank 0's servers of their own) in a
            run; 0 stops the run at the first death. Servers of ``server_addresses`` are not the
            job's to restart: their death stops the run.
        partial_rollout: with ``trainer.max_staleness >= 1`` (servers of their own): a weight push
            does not wait for the generations in flight; they are paused in place (SGLang's
            ``pause_generation``), the weights pushed, and they continue with the new weights, each
            token tagged with the version that sampled it (``rollout/staleness/*``,
            ``rollout/partial/fraction``). The servers run without a prefix cache, so no request
            starts from a prefix computed by older weights than its own.
        val_kwargs: sampling of the validation responses.
        multi_turn: agentic rollouts with tools and environments (``MultiTurnConfig``).
    """

    name: str = "sglang"
    mode: str = "colocated"
    num_gpus: int = 0
    server_addresses: list[str] = field(default_factory=list)
    tensor_model_parallel_size: int = 1
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    n: int = 1
    do_sample: bool = True
    temperature: float = 1.0
    log_prob_micro_batch_size_per_gpu: int | None = None
    log_prob_max_token_len_per_gpu: int = 16384
    update_weights_bucket_megabytes: float = 512.0
    weight_sync_target: str = "sharded"
    lora_sync: str = "merged"
    check_weight_sync: bool = False
    check_weight_sync_tolerance: float = 0.1
    startup_timeout_s: float = 1800.0
    request_timeout_s: float = 3600.0
    weight_update_timeout_s: float = 600.0
    max_server_restarts: int = 3
    partial_rollout: bool = False
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)


# In an experiment the log-prob passes default to the actor's micro-batching (verl's convention).
_ACTOR_MICRO_BATCHES = {"log_prob_micro_batch_size_per_gpu": II("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
                        "log_prob_max_token_len_per_gpu": II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")}


@dataclass
class ActorRolloutRefConfig:
    """``actor_rollout_ref.*``: the three share one model (``actor_rollout_ref.model``)."""

    model: PolicyModelConfig = field(default_factory=PolicyModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=lambda: RefConfig(**_ACTOR_MICRO_BATCHES))
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(**_ACTOR_MICRO_BATCHES))
