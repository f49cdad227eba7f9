"""Rewards: the GSM8K rule, user functions from files, error containment, token-level placement."""
from __future__ import annotations

import textwrap

import pytest
import torch

from engine.rewards import (CustomRewardFunctionConfig, RewardConfig, RewardFunctionError, RewardManager,
                            decode_responses, default_compute_score, load_custom_reward_function,
                            token_level_scores)
from engine.rewards.gsm8k import compute_score as gsm8k_score
from engine.rewards.gsm8k import extract_final_answer
from tests.test_data_tokenizer import build_chat_tokenizer


@pytest.mark.parametrize("response, ground_truth, expected", [
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("#### 7", "8", 0.0),
    ("first guess #### 5, no wait, #### 7", "7", 1.0),        # the last one counts
    ("first guess #### 7, no wait, #### 5", "7", 0.0),
    ("#### 1,234", "1234", 1.0),                              # commas stripped
    ("She pays #### $18.", "18", 1.0),                        # dollar sign and sentence dot stripped
    ("#### -3", "-3", 1.0),
    ("#### 18.0", "18", 1.0),                                 # same number
    ("#### 18.5", "18", 0.0),
    ("the answer is 7", "7", 0.0),                            # no #### at all
    ("####", "7", 0.0),
    ("#### 72", "1,000", 0.0),
    ("#### 1000", "1,000", 1.0),                              # ground truth normalised too
])
def test_gsm8k_rule(response, ground_truth, expected):
    assert gsm8k_score(response, ground_truth) == expected
    assert default_compute_score("openai/gsm8k", response, ground_truth) == expected


def test_gsm8k_format_score_only_for_a_wrong_but_well_formed_answer():
    assert gsm8k_score("#### 5", "7", format_score=0.1) == 0.1
    assert gsm8k_score("no answer", "7", format_score=0.1) == 0.0
    assert gsm8k_score("#### 7", "7", format_score=0.1) == 1.0
    config = RewardConfig(reward_kwargs={"gsm8k_format_score": 0.25})
    result = RewardManager(config).score(["#### 5", "#### 7", "none"], ["openai/gsm8k"] * 3, ["7"] * 3)
    assert result.scores.tolist() == [0.25, 1.0, 0.0]


def test_extract_final_answer():
    assert extract_final_answer("a #### 1,000.\nb") == "1000"
    assert extract_final_answer("nothing") is None


def _write_reward_file(tmp_path, body: str, name: str = "my_reward.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


USER_REWARD = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if "boom" in solution_str:
            raise RuntimeError("user bug")
        if "nan" in solution_str:
            return float("nan")
        if "nokey" in solution_str:
            return {"value": 1.0}
        correct = solution_str.strip() == ground_truth
        return {"score": 2.0 if correct else -1.0, "correct": correct, "length": len(solution_str),
                "source": data_source}

    def length_reward(data_source, solution_str, ground_truth, extra_info=None):
        return len(solution_str) / 10
"""


def test_user_function_from_file_with_extras_and_errors_counted(tmp_path):
    path = _write_reward_file(tmp_path, USER_REWARD)
    manager = RewardManager(RewardConfig(custom_reward_function=CustomRewardFunctionConfig(path=path)))
    responses = ["42", "41", "boom", "nan", "nokey", "42 "]
    result = manager.score(responses, ["mine"] * 6, ["42"] * 6, [{"i": i} for i in range(6)])
    assert result.scores.tolist() == [2.0, -1.0, 0.0, 0.0, 0.0, 2.0]
    assert result.metrics["reward/errors"] == 3.0
    assert result.errors[0] is None and "RuntimeError: user bug" in result.errors[2]
    assert "not finite" in result.errors[3] and "no 'score' key" in result.errors[4]
    assert result.extras["correct"] == [True, False, None, None, None, True]
    assert result.extras["length"] == [2, 2, None, None, None, 3]
    assert result.extras["source"][0] == "mine"
    assert result.metrics["reward/length/mean"] == pytest.approx(7 / 3)
    assert result.metrics["reward/correct/mean"] == pytest.approx(2 / 3)  # bools are numbers
    assert "reward/source/mean" not in result.metrics


def test_a_reward_function_that_keeps_failing_stops_the_run(tmp_path):
    path = _write_reward_file(tmp_path, USER_REWARD)
    config = RewardConfig(custom_reward_function=CustomRewardFunctionConfig(path=path), max_failed_fraction=0.5,
                          max_failed_steps=3)
    manager = RewardManager(config)
    failing = ["boom", "nan", "42", "41"]  # 2 of 4 fail: at the threshold
    healthy = ["boom", "42", "42", "41"]  # 1 of 4: the odd bad sample resets the count

    def step(responses):
        result = manager.score(responses, ["mine"] * 4, ["42"] * 4)
        manager.check_training_step(result, ["mine"] * 4)

    step(failing)
    step(failing)
    step(healthy)
    step(failing)
    step(failing)
    with pytest.raises(RewardFunctionError) as error:
        step(failing)
    message = str(error.value)
    assert "failed on 2 of 4 responses" in message and "last 3 steps" in message
    assert "reward_model.max_failed_steps=3" in message and "RuntimeError: user bug" in message
    never = RewardManager(RewardConfig(custom_reward_function=CustomRewardFunctionConfig(path=path),
                                       max_failed_steps=0))
    for _ in range(5):
        never.check_training_step(never.score(failing, ["mine"] * 4, ["42"] * 4), ["mine"] * 4)


def test_user_function_by_name(tmp_path):
    path = _write_reward_file(tmp_path, USER_REWARD)
    config = RewardConfig(custom_reward_function={"path": path, "name": "length_reward"})
    assert RewardManager(config).score(["abcd"], ["x"], ["y"]).scores.tolist() == [pytest.approx(0.4)]


def test_missing_reward_file_is_a_startup_error_naming_the_path(tmp_path):
    missing = str(tmp_path / "nowhere.py")
    with pytest.raises(FileNotFoundError, match=f"custom_reward_function.path='{missing}': no such file"):
        RewardManager(RewardConfig(custom_reward_function=CustomRewardFunctionConfig(path=missing)))


def test_missing_function_is_a_startup_error_naming_path_and_name(tmp_path):
    path = _write_reward_file(tmp_path, USER_REWARD)
    with pytest.raises(AttributeError) as info:
        load_custom_reward_function(path, "reward_fn")
    assert path in str(info.value) and "'reward_fn'" in str(info.value) and "compute_score" in str(info.value)


def test_reward_file_that_fails_to_import_names_the_path(tmp_path):
    path = _write_reward_file(tmp_path, "import not_a_module_anywhere\n", name="broken.py")
    with pytest.raises(ImportError, match="broken.py.*importing the file failed: ModuleNotFoundError"):
        load_custom_reward_function(path)


def test_wrong_signature_is_a_startup_error(tmp_path):
    path = _write_reward_file(tmp_path, "def compute_score(solution_str):\n    return 1.0\n", name="sig.py")
    with pytest.raises(TypeError, match="cannot be called as f\\(data_source, solution_str"):
        RewardManager(RewardConfig(custom_reward_function=CustomRewardFunctionConfig(path=path)))


def test_builtin_checks_data_sources_up_front_and_contains_unknown_ones():
    manager = RewardManager(RewardConfig())
    manager.check_data_sources(["openai/gsm8k", "reasoning_gym/chain_sum"])
    with pytest.raises(ValueError, match=r"\['my/source'\]"):
        manager.check_data_sources(["openai/gsm8k", "my/source"])
    result = manager.score(["#### 1", "#### 1"], ["openai/gsm8k", "my/source"], ["1", "1"])
    assert result.scores.tolist() == [1.0, 0.0] and result.metrics["reward/errors"] == 1.0


def test_reasoning_gym_row_without_its_extra_info_is_counted():
    result = RewardManager(RewardConfig()).score(["<answer>3</answer>"], ["reasoning_gym/chain_sum"], ["3"], [{}])
    assert result.scores.tolist() == [0.0] and "regenerate the data" in result.errors[0]


def test_token_level_scores_on_last_response_token():
    torch.manual_seed(0)
    mask = (torch.rand(6, 9) > 0.4).long()
    mask[4] = 0  # no response token at all
    mask[5] = torch.tensor([1, 1, 1, 0, 0, 1, 0, 0, 0])  # a hole: the last 1 is at position 5
    scores = torch.randn(6, dtype=torch.float64)
    placed = token_level_scores(scores, mask)
    reference = torch.zeros(6, 9, dtype=torch.float64)
    for row in range(6):
        ones = [j for j in range(9) if mask[row, j] == 1]
        if ones:
            reference[row, ones[-1]] = scores[row]
    assert torch.equal(placed, reference)
    assert placed[5, 5] == scores[5] and placed[4].abs().sum() == 0


def test_decode_responses_uses_only_masked_tokens_and_drops_special_tokens():
    tokenizer = build_chat_tokenizer()
    ids = tokenizer("#### 72", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    width = len(ids) + 2
    response_ids = torch.full((1, width), tokenizer.pad_token_id)
    response_ids[0, :len(ids)] = torch.tensor(ids)
    mask = torch.zeros(1, width, dtype=torch.long)
    mask[0, :len(ids)] = 1
    assert decode_responses(tokenizer, response_ids, mask) == ["#### 72"]
