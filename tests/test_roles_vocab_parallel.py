"""Vocab-parallel log-probs and entropy on one process, against a float64 full softmax.

(The TP2/TP4 split of the same computation is checked in tests/test_roles.py's torchrun launch.)
"""

from __future__ import annotations

import pytest
import torch

from engine.roles.vocab_parallel import vocab_parallel_log_probs


def _reference(logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int):
    log_softmax = torch.log_softmax(logits[..., :vocab_size].double() / temperature, dim=-1)
    log_probs = log_softmax.gather(-1, targets[..., None])[..., 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_values_and_gradients_match_float64(temperature):
    generator = torch.Generator().manual_seed(1)
    vocab, padded = 50, 64  # megatron pads the vocabulary; padded columns must not count
    logits64 = torch.randn(2, 7, padded, generator=generator, dtype=torch.float64) * 4
    targets = torch.randint(0, vocab, (2, 7), generator=generator)
    grad_lp = torch.randn(2, 7, generator=generator, dtype=torch.float64)
    grad_h = torch.randn(2, 7, generator=generator, dtype=torch.float64)

    logits = logits64.float().requires_grad_(True)
    log_probs, entropy = vocab_parallel_log_probs(
        logits, targets, temperature=temperature, vocab_size=vocab, compute_entropy=True
    )
    ((log_probs * grad_lp.float()).sum() + (entropy * grad_h.float()).sum()).backward()

    reference = logits64.clone().requires_grad_(True)
    ref_lp, ref_h = _reference(reference, targets, temperature, vocab)
    ((ref_lp * grad_lp).sum() + (ref_h * grad_h).sum()).backward()

    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.double(), ref_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), reference.grad, rtol=0, atol=2e-6)
    assert torch.count_nonzero(logits.grad[..., vocab:]) == 0


def test_bf16_logits_extreme_values_and_no_entropy():
    # Very peaked distributions: p underflows to 0 for most ids; nothing may become NaN.
    logits = torch.full((3, 20), -80.0)
    logits[:, 4] = 80.0
    targets = torch.tensor([4, 5, 19])
    log_probs, entropy = vocab_parallel_log_probs(logits.bfloat16(), targets, compute_entropy=True)
    ref_lp, ref_h = _reference(logits, targets, 1.0, 20)
    assert torch.isfinite(log_probs).all() and torch.isfinite(entropy).all()
    torch.testing.assert_close(log_probs.double(), ref_lp, rtol=1e-6, atol=1e-4)
    assert float(entropy.max()) < 1e-6
    only_log_probs, none = vocab_parallel_log_probs(logits, targets)
    assert none is None and torch.equal(only_log_probs, vocab_parallel_log_probs(logits, targets)[0])


def test_input_logits_are_not_modified_and_bad_arguments():
    logits = torch.randn(4, 10)
    before = logits.clone()
    vocab_parallel_log_probs(logits, torch.zeros(4, dtype=torch.long), temperature=0.5, compute_entropy=True)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(logits, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_log_probs(logits, torch.zeros(3, dtype=torch.long))
