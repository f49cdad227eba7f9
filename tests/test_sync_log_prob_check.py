"""rollout.check_weight_sync for engines that cannot show their tensors: the log-prob comparison."""
import pytest
import torch

from engine.sync import check_rollout_log_probs
from parallel.hybrid_engine import WeightSyncError


def batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(4, 6, generator=generator, dtype=torch.float64) * 3
    mask = torch.ones(4, 6, dtype=torch.float64)
    mask[1, 3:] = 0
    mask[3, 1:] = 0
    return trainer, mask


def test_numerical_noise_passes_and_returns_the_mean_over_response_tokens():
    trainer, mask = batch()
    rollout = trainer + 1e-3 * mask  # exactly 1e-3 on every response token
    rollout[1, 4] += 50.0  # padding: must not count
    assert check_rollout_log_probs(rollout, trainer, mask, tolerance=0.1) == pytest.approx(1e-3)


def test_wrong_weights_fail_naming_the_worst_sequence():
    trainer, mask = batch()
    other, _ = batch(seed=1)
    rollout = trainer.clone()
    rollout[2] = other[2] - 2.0  # one sequence from a different distribution
    with pytest.raises(WeightSyncError, match=r"check_weight_sync_tolerance=0.1; worst sequence: 2"):
        check_rollout_log_probs(rollout, trainer, mask, tolerance=0.1)
