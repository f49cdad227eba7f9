"""``actor_rollout_ref.*``: the policy being trained, its rollout engine and the frozen reference.

The three share one model (``actor_rollout_ref.model``); the reference also uses the actor's
Megatron layout, so only its log-prob batching is configurable.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import II

from engine.config.model import MegatronSection, ModelSection, OptimSection

ROLLOUT_MODES = ("colocated", "disaggregated")
ROLLOUT_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class PolicyLossSection:
    """``actor_rollout_ref.actor.policy_loss.*``.

    Attributes:
        loss_mode: the policy-gradient objective, one of ``registry.names("policy_loss")``:
            "vanilla" (PPO's clipped surrogate, Schulman et al. 2017) or "gspo" (sequence-level ratio).
    """

    loss_mode: str = "vanilla"


@dataclass
class ActorSection:
    """``actor_rollout_ref.actor.*``: PPO updates of the policy.

    Batch sizes count *prompts*, as in verl: one mini-batch holds
    ``ppo_mini_batch_size * rollout.n`` sequences, split evenly over the data-parallel ranks and
    then into micro-batches of ``ppo_micro_batch_size_per_gpu`` sequences.

    Attributes:
        ppo_epochs: passes over each rollout batch.
        ppo_mini_batch_size: prompts per optimizer step (global).
        ppo_micro_batch_size_per_gpu: sequences per forward/backward on one rank; required unless
            ``use_dynamic_bsz``.
        use_dynamic_bsz: form micro-batches by token count (``ppo_max_token_len_per_gpu``) instead.
        ppo_max_token_len_per_gpu: token budget of one dynamic micro-batch on one rank.
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
    """

    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float | None = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    policy_loss: PolicyLossSection = field(default_factory=PolicyLossSection)
    optim: OptimSection = field(default_factory=OptimSection)
    megatron: MegatronSection = field(default_factory=MegatronSection)

    def loss_config(self):
        """The ``engine.algo.losses.ActorLossConfig`` of these settings (imports torch)."""
        from engine.algo.losses import ActorLossConfig, PolicyLossConfig

        policy = PolicyLossConfig(
            loss_mode=self.policy_loss.loss_mode,
            clip_ratio=self.clip_ratio,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c,
            loss_agg_mode=self.loss_agg_mode,
        )
        return ActorLossConfig(
            policy=policy,
            entropy_coeff=self.entropy_coeff,
            use_kl_loss=self.use_kl_loss,
            kl_loss_coef=self.kl_loss_coef,
            kl_loss_type=self.kl_loss_type,
        )


@dataclass
class RefSection:
    """``actor_rollout_ref.ref.*``: log-probs of the frozen reference policy.

    It runs on the actor's Megatron layout and batches like the actor (``actor.use_dynamic_bsz``).

    Attributes:
        log_prob_micro_batch_size_per_gpu: sequences per forward on one rank; defaults to the
            actor's ``ppo_micro_batch_size_per_gpu``.
        log_prob_max_token_len_per_gpu: token budget per forward with dynamic batching; defaults to
            the actor's ``ppo_max_token_len_per_gpu``.
    """

    log_prob_micro_batch_size_per_gpu: int | None = II("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")


@dataclass
class ValidationSamplingSection:
    """``actor_rollout_ref.rollout.val_kwargs.*``: sampling of the validation responses (greedy by default)."""

    n: int = 1
    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class RolloutSection:
    """``actor_rollout_ref.rollout.*``: the generation engine and its sampling.

    Attributes:
        name: the engine: "torch" (HF generate inside the trainer process, for small CPU runs) or
            "sglang" (SGLang servers).
        mode: "colocated" (the engine shares the training GPUs and takes the weights from them,
            3D-HybridEngine style) or "disaggregated" (the engine has GPUs of its own).
        num_gpus: disaggregated mode only: GPUs given to the engine, taken out of the world size;
            the trainer gets the rest.
        tensor_model_parallel_size: generation TP size of one engine replica.
        dtype: weight precision inside the engine.
        gpu_memory_utilization: fraction of GPU memory the engine may take (SGLang's
            ``mem_fraction_static``).
        n: responses sampled per prompt.
        do_sample: false = greedy decoding whatever the temperature.
        temperature, top_p, top_k: sampling; top_k = -1 disables top-k.
        log_prob_micro_batch_size_per_gpu: sequences per forward when the actor recomputes the
            rollout's log-probs (the PPO ``old_log_prob``); defaults to the actor's micro-batch.
        log_prob_max_token_len_per_gpu: the same with dynamic batching; defaults to the actor's.
        update_weights_bucket_megabytes: size of the buckets the weights travel in to the engine.
        check_weight_sync: after every weight update, check that the engine serves the actor's
            weights and fail loudly if not: the embedded engine's tensors are compared with
            fingerprints of the training shards (exact); for servers that cannot show their
            tensors (SGLang), the next rollout's log-probs are compared with the trainer's
            recomputation of them (no extra forward).
        check_weight_sync_tolerance: the largest mean |rollout - trainer| log-prob per response
            token that passes (fp32 gives ~1e-6, bf16 ~1e-2; wrong weights give ~1).
        val_kwargs: sampling of the validation responses.
    """

    name: str = "sglang"
    mode: str = "colocated"
    num_gpus: int = 0
    tensor_model_parallel_size: int = 1
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.5
    n: int = 1
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    log_prob_micro_batch_size_per_gpu: int | None = II("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")
    update_weights_bucket_megabytes: int = 512
    check_weight_sync: bool = False
    check_weight_sync_tolerance: float = 0.1
    val_kwargs: ValidationSamplingSection = field(default_factory=ValidationSamplingSection)


@dataclass
class ActorRolloutRefSection:
    """``actor_rollout_ref.*``."""

    model: ModelSection = field(default_factory=ModelSection)
    actor: ActorSection = field(default_factory=ActorSection)
    ref: RefSection = field(default_factory=RefSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
