"""Every estimator, KL estimator, KL controller, policy loss and aggregation mode the registry lists
runs one real PPO step through the loop (ReMax with its greedy baseline among them)."""
from __future__ import annotations

import json

import pytest

from engine.algo import registry
from tests.distributed import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_one_ppo_step_per_registry_entry(demo_model, tmp_path):
    out = tmp_path / "steps.json"
    run_torchrun("registry_steps.py", 1, [str(out), str(tmp_path / "run")], timeout=900)
    results = json.loads(out.read_text())
    expected = {f"{kind}/{name}" for kind in ("adv_estimator", "kl_estimator", "kl_controller", "policy_loss",
                                              "loss_agg_mode") for name in registry.names(kind)}
    assert set(results) == expected, expected ^ set(results)
    # ReMax generated and scored a greedy response per prompt; GAE trained the critic.
    assert "critic/greedy_score/mean" in results["adv_estimator/remax"]
    assert "critic/vf_loss" in results["adv_estimator/gae"] and "critic/vf_loss" not in results["adv_estimator/grpo"]
    # The switched settings reached the loss: the in-reward KL estimators give different penalties.
    penalties = {name: results[f"kl_estimator/{name}"]["actor/reward_kl_penalty"] for name in ("k1", "k2", "abs")}
    assert len(set(penalties.values())) == 3, penalties
