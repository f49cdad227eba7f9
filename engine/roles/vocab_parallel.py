"""Log-probabilities and entropy from vocabulary-parallel logits, never gathering the vocabulary.

With tensor parallelism the output layer leaves each TP rank the logits of its own slice of the
vocabulary, ``[..., V / TP]``. For the tempered distribution ``p = softmax(z / T)`` (the rollout
engines' definition, see ``engine/rollout/base.py``):

    log p(y) = z_y / T - log sum_v exp(z_v / T)
    H(p)     = -sum_v p_v log p_v

Both sums run over the whole vocabulary, so each rank reduces its slice and the partial results
are all-reduced over the TP group: the max (for a stable log-sum-exp), the sum of exponentials,
the target's log-prob (only the rank owning the target contributes) and ``sum p log p``. Memory per
rank stays O(tokens x V / TP).

Gradients (each rank computes its own slice, no communication), with ``l = z / T``:

    d log p(y) / d l_k = [k == y] - p_k
    d H / d l_k        = -p_k (log p_k + H)
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_start, vocab_size, group, compute_entropy):
        local_width = logits.shape[-1]
        # Columns past the real vocabulary (megatron may pad it to a TP-friendly size) are dropped.
        valid_width = max(0, min(local_width, vocab_size - vocab_start))
        tempered = logits[..., :valid_width].float() / temperature  # a new fp32 tensor

        # Stable log-sum-exp over the full vocabulary.
        if valid_width > 0:
            global_max = tempered.max(dim=-1).values
        else:
            global_max = tempered.new_full(tempered.shape[:-1], float("-inf"))
        _all_reduce(global_max, dist.ReduceOp.MAX, group)
        log_softmax = tempered.sub_(global_max.unsqueeze(-1))  # in place: z/T - max
        sum_exp = _all_reduce(log_softmax.exp().sum(dim=-1), dist.ReduceOp.SUM, group)
        log_softmax.sub_(sum_exp.log().unsqueeze(-1))  # now log p over this rank's slice

        local_targets = targets - vocab_start
        owned = (local_targets >= 0) & (local_targets < valid_width)
        safe_targets = torch.where(owned, local_targets, torch.zeros_like(local_targets))
        target_log_probs = torch.where(
            owned,
            log_softmax.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1) if valid_width else 0.0,
            torch.zeros((), dtype=log_softmax.dtype, device=log_softmax.device),
        )
        _all_reduce(target_log_probs, dist.ReduceOp.SUM, group)

        entropy = None
        if compute_entropy:
            entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1)
            _all_reduce(entropy, dist.ReduceOp.SUM, group)

        ctx.save_for_backward(log_softmax, safe_targets, owned, entropy if compute_entropy else log_softmax.new_zeros((0,)))
        # An output the loss does not use (the entropy kept as a metric) then gets None, not zeros,
        # and its term of the backward pass is skipped.
        ctx.set_materialize_grads(False)
        ctx.temperature = temperature
        ctx.local_width = local_width
        ctx.input_dtype = logits.dtype
        ctx.compute_entropy = compute_entropy
        if compute_entropy:
            return target_log_probs, entropy
        return target_log_probs, torch.zeros_like(target_log_probs)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        log_softmax, safe_targets, owned, entropy = ctx.saved_tensors
        probs = log_softmax.exp()
        grad = torch.zeros_like(log_softmax)
        if grad_log_probs is not None:
            grad.sub_(probs * grad_log_probs.unsqueeze(-1))
            if log_softmax.shape[-1] > 0:
                grad.scatter_add_(-1, safe_targets.unsqueeze(-1), (grad_log_probs * owned).unsqueeze(-1))
        if ctx.compute_entropy and grad_entropy is not None:
            grad.sub_(grad_entropy.unsqueeze(-1) * probs * (log_softmax + entropy.unsqueeze(-1)))
        grad.div_(ctx.temperature)
        if grad.shape[-1] != ctx.local_width:
            grad = torch.nn.functional.pad(grad, (0, ctx.local_width - grad.shape[-1]))
        return grad.to(ctx.input_dtype), None, None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    tensor_parallel_group: dist.ProcessGroup | None = None,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` and (optionally) the entropy under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V / TP]`` this TP rank's contiguous vocabulary slice (rank r holds ids
            ``[r * V/TP, (r + 1) * V/TP)``, megatron's ``VocabParallelEmbedding`` layout); any dtype,
            the math runs in float32.
        targets: ``[...]`` token ids in the full vocabulary.
        temperature: the sampling temperature T > 0 (use 1 for greedy rollouts).
        vocab_size: the real vocabulary size; logits of padded ids beyond it are ignored.
            Defaults to ``V / TP * TP``.
        tensor_parallel_group: the TP group (None: a single rank holds the whole vocabulary).
        compute_entropy: also return the per-position entropy.

    Returns:
        ``(log_probs, entropy)`` float32 of shape ``targets.shape``; entropy is None unless asked.
        Both are differentiable with respect to ``logits``.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probs (greedy uses 1), got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    tp_size = dist.get_world_size(tensor_parallel_group) if tensor_parallel_group is not None else 1
    tp_rank = dist.get_rank(tensor_parallel_group) if tensor_parallel_group is not None else 0
    local_width = logits.shape[-1]
    if vocab_size is None:
        vocab_size = local_width * tp_size
    if vocab_size > local_width * tp_size:
        raise ValueError(f"vocab_size {vocab_size} exceeds the {local_width * tp_size} logit columns")
    log_probs, entropy = _VocabParallelLogProbs.apply(
        logits, targets, float(temperature), tp_rank * local_width, vocab_size,
        tensor_parallel_group, compute_entropy,
    )
    return log_probs, (entropy if compute_entropy else None)
