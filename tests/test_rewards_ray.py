"""The Ray CPU reward pool gives the same scores, extras and error counts as in-process scoring."""
from __future__ import annotations

import os

import pytest

from engine.rewards import CustomRewardFunctionConfig, RewardConfig, RewardManager
from tests.test_rewards import USER_REWARD, _write_reward_file


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("uses a private local Ray instance")
    yield ray
    ray.shutdown()


def test_ray_pool_matches_in_process_scores(tmp_path, local_ray):
    path = _write_reward_file(tmp_path, USER_REWARD)
    responses = [f"{i % 7}" for i in range(37)] + ["boom", "nan", "nokey"]
    ground_truths = ["3"] * len(responses)
    data_sources = ["mine"] * len(responses)
    custom = CustomRewardFunctionConfig(path=path)
    in_process = RewardManager(RewardConfig(custom_reward_function=custom)).score(
        responses, data_sources, ground_truths)
    manager = RewardManager(RewardConfig(custom_reward_function=custom, num_workers=2))
    try:
        pooled = manager.score(responses, data_sources, ground_truths)
        builtin = manager.score(["#### 3"], ["mine"], ["3"])  # pool stays usable across calls
    finally:
        manager.close()
    assert pooled.scores.tolist() == in_process.scores.tolist()
    assert pooled.extras == in_process.extras and pooled.metrics == in_process.metrics
    assert pooled.metrics["reward/errors"] == 3.0
    assert pooled.errors == in_process.errors
    assert builtin.scores.tolist() == [-1.0]
