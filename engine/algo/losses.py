"""PPO losses: policy (clipped surrogate, dual-clip, GSPO), value, entropy, and their aggregation.

Tensors are ``[batch, response_len]`` with a float or bool ``response_mask`` (1 = a response token
the loss sees). Masked positions never influence any result: their logprobs, advantages and values
may hold any finite values (padding garbage).

Gradient accumulation: every loss here is a micro-batch's *share* of the loss of the whole global
mini-batch (the sequences of one optimizer step: ``ppo_mini_batch_size`` prompts x ``rollout.n``
samples, over all data-parallel ranks). The caller counts the global mini-batch once, before the
micro-batch loop, and passes that count as a :class:`LossScale`:

1. ``counts = count_tokens_and_sequences(response_masks_of_all_my_micro_batches)`` (float64
   ``[num_tokens, num_sequences]``; a sequence counts when it has at least one response token, so
   all-masked padding rows count for nothing);
2. ``torch.distributed.all_reduce(counts, op=SUM, group=data_parallel_group)`` so the count covers
   the mini-batch on every data-parallel rank. With context parallelism, count the full sequences
   (before the CP split) and reduce over the data-parallel group only; each CP rank's loss over
   its slice of the tokens is then its share, and the shares also sum over CP ranks;
3. ``scale = LossScale.from_counts(counts, max_response_length=data.max_response_length)``.

Then the sum over micro-batches and data-parallel ranks of each returned loss (and metric) equals
the loss computed on the whole mini-batch at once, independently of how it was split, so summing
gradients (no averaging) gives the full-batch gradient. Metrics are token-means in every mode. Megatron-core's schedule and DDP *average*
instead: with a loss function that returns ``(loss, reduced)`` the schedule divides by
``num_microbatches`` and DDP by the dp x cp size after multiplying by the cp size, so hand it
``share * num_microbatches * data_parallel_size`` to get the summed gradient.

``seq-mean-token-mean`` divides each sequence by its own token count; with context parallelism
that count is split across CP ranks, so gather the per-sequence tensors over CP before the loss.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from engine.algo import registry
from engine.algo.kl import kl_divergence
from engine.algo.stats import masked_var
from engine.config.actor_rollout_ref import ActorConfig

# exp() of a log-ratio beyond this overflows float32 or is a numerical accident; clamp first.
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class LossScale:
    """Global normalisers of one mini-batch, summed over its micro-batches and data-parallel ranks.

    Attributes:
        global_num_tokens: response tokens (mask == 1) in the global mini-batch; divides
            ``token-mean``.
        global_num_sequences: sequences with at least one response token in the global
            mini-batch; divides the ``seq-mean-*`` modes.
        max_response_length: the constant length normaliser of ``seq-mean-token-sum-norm``
            (Dr.GRPO): use ``data.max_response_length``, never the padded width of a micro-batch,
            which varies between micro-batches. Only that mode needs it.
    """

    global_num_tokens: float
    global_num_sequences: float
    max_response_length: int | None = None

    def __post_init__(self) -> None:
        if self.global_num_tokens <= 0 or self.global_num_sequences <= 0:
            raise ValueError(
                f"LossScale needs a mini-batch with response tokens, got global_num_tokens="
                f"{self.global_num_tokens}, global_num_sequences={self.global_num_sequences}"
            )
        if self.max_response_length is not None and self.max_response_length <= 0:
            raise ValueError(f"max_response_length must be positive, got {self.max_response_length}")

    @classmethod
    def from_counts(cls, counts: torch.Tensor, max_response_length: int | None = None) -> "LossScale":
        """Build from the ``[num_tokens, num_sequences]`` tensor of :func:`count_tokens_and_sequences`
        (after the caller's data-parallel all-reduce)."""
        num_tokens, num_sequences = (float(c) for c in counts.tolist())
        return cls(num_tokens, num_sequences, max_response_length)

    @classmethod
    def from_response_masks(
        cls, response_masks: Iterable[torch.Tensor], max_response_length: int | None = None
    ) -> "LossScale":
        """Single-process shortcut: the scale of the mini-batch made of these micro-batch masks."""
        return cls.from_counts(count_tokens_and_sequences(response_masks), max_response_length)


def count_tokens_and_sequences(response_masks: Iterable[torch.Tensor]) -> torch.Tensor:
    """``[num_tokens, num_sequences]`` (float64) over micro-batch masks of any widths.

    A sequence is counted when it has at least one response token. Returned on the CPU (move it
    to the collective's device, e.g. CUDA for NCCL, before the all-reduce); float64 keeps the
    count exact far beyond 2**24 tokens.
    """
    num_tokens = num_sequences = 0
    for mask in response_masks:
        tokens_per_sequence = mask.bool().sum(dim=-1)
        num_tokens += int(tokens_per_sequence.sum())
        num_sequences += int((tokens_per_sequence > 0).sum())
    return torch.tensor([num_tokens, num_sequences], dtype=torch.float64)


# --- Loss aggregation (``loss_agg_mode``) ----------------------------------------------------
# Each takes a per-token loss matrix L[i, t], the mask M[i, t] and the global scale; the sums run
# over this micro-batch only, the denominators are global.


@registry.register("loss_agg_mode", "token-mean")
def _token_mean(loss_matrix: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    # sum_{i,t} M L / N_tokens: every token weighs the same (DAPO's token-level loss).
    return (loss_matrix * mask).sum() / scale.global_num_tokens


@registry.register("loss_agg_mode", "seq-mean-token-sum")
def _seq_mean_token_sum(loss_matrix: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    # (1 / N_seq) sum_i sum_t M L.
    return (loss_matrix * mask).sum() / scale.global_num_sequences


@registry.register("loss_agg_mode", "seq-mean-token-mean")
def _seq_mean_token_mean(loss_matrix: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    # (1 / N_seq) sum_i (1 / |o_i|) sum_t M L: the original GRPO / PPO-per-sequence weighting.
    # All-masked rows have 0 / 1 = 0 and are not in N_seq.
    tokens_per_sequence = mask.sum(dim=-1).clamp(min=1)
    per_sequence = (loss_matrix * mask).sum(dim=-1) / tokens_per_sequence
    return per_sequence.sum() / scale.global_num_sequences


@registry.register("loss_agg_mode", "seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(loss_matrix: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    # Dr.GRPO (Liu et al. 2025): replace 1 / |o_i| by the constant 1 / L_max so long and short
    # responses are not weighted differently: (1 / N_seq) sum_i (1 / L_max) sum_t M L.
    if scale.max_response_length is None:
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' needs LossScale.max_response_length "
            "(pass data.max_response_length)"
        )
    return (loss_matrix * mask).sum() / (scale.global_num_sequences * scale.max_response_length)


def aggregate_loss(
    loss_matrix: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, scale: LossScale
) -> torch.Tensor:
    """This micro-batch's share of the global mini-batch loss under ``loss_agg_mode``.

    Args:
        loss_matrix: per-token losses ``[batch, response_len]``; masked entries are ignored.
        response_mask: ``[batch, response_len]``, float or bool.
        loss_agg_mode: one of ``registry.names("loss_agg_mode")``.
        scale: global normalisers of the mini-batch (see the module docstring).
    """
    _check_same_shape(loss_matrix=loss_matrix, response_mask=response_mask)
    aggregate = registry.get("loss_agg_mode", loss_agg_mode)
    mask = response_mask.to(loss_matrix.dtype)
    # where() rather than multiply: garbage such as inf at masked positions must not leak as NaN.
    loss_matrix = torch.where(mask > 0, loss_matrix, torch.zeros_like(loss_matrix))
    return aggregate(loss_matrix, mask, scale)


def _token_mean_metric(values: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """Detached token-mean share used for every metric, whatever the loss aggregation mode, so
    metrics also sum exactly over micro-batches and data-parallel ranks."""
    return aggregate_loss(values.detach().to(mask.dtype), mask, "token-mean", scale)


# --- Policy losses (``policy_loss.loss_mode``) ---------------------------------------------------


@dataclass
class LossOutput:
    """A micro-batch's loss share (differentiable) and its detached metric shares.

    Every metric is a share too: summing ``metrics[k]`` over micro-batches and data-parallel
    ranks gives the mini-batch value.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def compute_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ActorConfig,
    scale: LossScale,
) -> LossOutput:
    """Policy-gradient loss of ``config.policy_loss.loss_mode``.

    Args:
        old_log_probs: log pi_old(a_t) of the rollout policy, ``[batch, response_len]``.
        log_probs: log pi_theta(a_t), differentiable.
        advantages: per-token advantages.
        response_mask: response tokens.
        config: the actor's settings (``actor_rollout_ref.actor.*``): clip ratios and ``loss_agg_mode``.
        scale: global normalisers (module docstring).

    Returns:
        loss, and metrics ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``
        (token-mean of old_log_prob - log_prob, the k1 estimate of KL(pi_old || pi_theta)).
    """
    _check_same_shape(
        old_log_probs=old_log_probs, log_probs=log_probs, advantages=advantages, response_mask=response_mask
    )
    return registry.get("policy_loss", config.policy_loss.loss_mode)(
        old_log_probs, log_probs, advantages, response_mask, config, scale
    )


@registry.register("policy_loss", "vanilla")
def _vanilla_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ActorConfig,
    scale: LossScale,
) -> LossOutput:
    # PPO clipped surrogate (Schulman et al. 2017), as a loss to minimise:
    #   rho_t = pi_theta / pi_old,  L_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
    log_ratio = (log_probs - old_log_probs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return _clipped_surrogate(
        log_ratio, old_log_probs, log_probs, advantages, response_mask, config, scale, config.clip_ratio_c
    )


@registry.register("policy_loss", "gspo")
def _gspo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ActorConfig,
    scale: LossScale,
) -> LossOutput:
    # GSPO (Zheng et al. 2025): one length-normalised ratio per sequence,
    #   s_i = (pi_theta(y_i) / pi_old(y_i)) ** (1 / |y_i|) = exp(mean_t (log pi_theta - log pi_old)),
    # clipped like PPO. In the token form s_{i,t} = sg[s_i] * pi_theta(y_t) / sg[pi_theta(y_t)]
    # every token carries the value s_i; with seq-mean-token-mean the gradient is exactly GSPO's.
    mask = response_mask.to(log_probs.dtype)
    token_log_ratio = torch.where(mask > 0, log_probs - old_log_probs, torch.zeros_like(log_probs))
    sequence_log_ratio = token_log_ratio.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    log_ratio = sequence_log_ratio.detach().unsqueeze(-1) + log_probs - log_probs.detach()
    log_ratio = log_ratio.clamp(max=_MAX_LOG_RATIO)
    # GSPO clips whole sequences with tiny epsilons; dual-clip is not part of it.
    return _clipped_surrogate(
        log_ratio, old_log_probs, log_probs, advantages, response_mask, config, scale, clip_ratio_c=None
    )


def _clipped_surrogate(
    log_ratio: torch.Tensor,
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ActorConfig,
    scale: LossScale,
    clip_ratio_c: float | None,
) -> LossOutput:
    mask = response_mask.to(log_probs.dtype)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.epsilon_low, 1.0 + config.epsilon_high)
    losses = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    lower_clip_active = torch.zeros_like(clip_active)
    if clip_ratio_c is not None:
        # Dual-clip (Ye et al. 2020): for A < 0 a huge ratio makes max() unbounded; cap the loss
        # at -c * A so one stale token cannot dominate the update.
        dual_bound = -advantages * clip_ratio_c
        lower_clip_active = (advantages < 0) & (losses > dual_bound)
        losses = torch.where(advantages < 0, torch.minimum(losses, dual_bound), losses)

    loss = aggregate_loss(losses, mask, config.loss_agg_mode, scale)
    metrics = {
        "pg_loss": loss.detach(),
        "pg_clipfrac": _token_mean_metric(clip_active, mask, scale),
        "pg_clipfrac_lower": _token_mean_metric(lower_clip_active, mask, scale),
        "ppo_kl": _token_mean_metric(old_log_probs - log_probs, mask, scale),
    }
    return LossOutput(loss, metrics)


# --- Value loss ------------------------------------------------------------------------------


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str,
    scale: LossScale,
) -> LossOutput:
    """Clipped value loss of PPO (Schulman et al. 2017, as in the openai/baselines PPO2 critic).

    ``L_t = 0.5 * max((V_t - R_t)^2, (V_old,t + clip(V_t - V_old,t, -c, c) - R_t)^2)``; the clip
    keeps the critic within ``cliprange_value`` of the values used for the advantages.
    ``cliprange_value=None`` gives the plain squared error.

    Returns:
        loss, and metrics ``vf_loss``, ``vf_clipfrac`` (token share where the clipped term wins).
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, response_mask=response_mask)
    mask = response_mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        losses = unclipped
        clip_active = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        if cliprange_value < 0:
            raise ValueError(f"critic.cliprange_value must be >= 0, got {cliprange_value}")
        # V_old + clip(V - V_old, -c, c), written as a clamp of V so that an unclipped value is V itself
        # (bit for bit): a rounding tie must not count as "the clipped term wins" in vf_clipfrac.
        clipped_values = values.clamp(old_values - cliprange_value, old_values + cliprange_value)
        clipped = (clipped_values - returns) ** 2
        losses = torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = 0.5 * aggregate_loss(losses, mask, loss_agg_mode, scale)
    return LossOutput(loss, {"vf_loss": loss.detach(), "vf_clipfrac": _token_mean_metric(clip_active, mask, scale)})


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``1 - Var[R - V] / Var[R]`` over response tokens (``critic/vf_explained_var``).

    1 is a perfect critic, 0 no better than a constant, negative worse. A whole-batch statistic
    (not additive over micro-batches): compute it on the full batch. NaN when Var[R] == 0.
    """
    _check_same_shape(values=values, returns=returns, response_mask=response_mask)
    return 1.0 - masked_var(returns - values, response_mask) / masked_var(returns, response_mask)


# --- KL loss, entropy and the combined actor loss ----------------------------------------------


def compute_kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str,
    loss_agg_mode: str,
    scale: LossScale,
) -> torch.Tensor:
    """Aggregated KL(pi_theta || pi_ref) estimate (share) for ``actor.use_kl_loss``.

    ``kl_loss_type`` is a KL estimator name (``low_var_kl`` = k3 is the GRPO choice; ``k3+``
    keeps k3's value with the unbiased k2 gradient).
    """
    _check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs, response_mask=response_mask)
    per_token_kl = kl_divergence(log_probs, ref_log_probs, kl_loss_type, "actor_rollout_ref.actor.kl_loss_type")
    return aggregate_loss(per_token_kl, response_mask, loss_agg_mode, scale)


def aggregate_entropy(
    entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str, scale: LossScale
) -> torch.Tensor:
    """Aggregated per-token entropy H(pi_theta(. | s_t)) (share); the actor *subtracts*
    ``entropy_coeff`` times it, to reward exploration."""
    return aggregate_loss(entropy, response_mask, loss_agg_mode, scale)


def compute_actor_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: ActorConfig,
    scale: LossScale,
    entropy: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
) -> LossOutput:
    """``pg_loss - entropy_coeff * entropy + kl_loss_coef * kl_loss`` with the actor's metrics.

    Args:
        entropy: per-token entropies, required when ``entropy_coeff != 0``; logged when given.
        ref_log_probs: reference-policy log-probs, required when ``use_kl_loss``.

    Returns:
        loss, and metrics ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``, ``ppo_kl``, plus
        ``entropy`` and ``kl_loss`` when those terms are present (the trainer logs
        them under ``actor/``).
    """
    output = compute_policy_loss(old_log_probs, log_probs, advantages, response_mask, config, scale)
    loss = output.loss
    metrics = dict(output.metrics)
    agg_mode = config.loss_agg_mode
    if config.entropy_coeff != 0 and entropy is None:
        raise ValueError("actor_rollout_ref.actor.entropy_coeff != 0 needs per-token entropy")
    if entropy is not None:
        entropy_share = aggregate_entropy(entropy, response_mask, agg_mode, scale)
        metrics["entropy"] = entropy_share.detach()
        if config.entropy_coeff != 0:
            loss = loss - config.entropy_coeff * entropy_share
    if config.use_kl_loss:
        if ref_log_probs is None:
            raise ValueError("actor_rollout_ref.actor.use_kl_loss=True needs ref_log_probs (a reference policy)")
        kl_share = compute_kl_loss(log_probs, ref_log_probs, response_mask, config.kl_loss_type, agg_mode, scale)
        loss = loss + config.kl_loss_coef * kl_share
        metrics["kl_loss"] = kl_share.detach()
    return LossOutput(loss, metrics)


def _check_same_shape(**tensors: torch.Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"tensors must share one [batch, response_len] shape, got {shapes}")
