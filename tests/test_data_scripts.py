"""The dataset scripts in launch/data: GSM8K conversion and reasoning-gym generation, read back and scored."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engine.data import PromptDataset, read_prompt_file
from engine.rewards import RewardConfig, RewardManager, default_compute_score
from launch.data import gsm8k, reasoning_gym
from tests.test_data_tokenizer import build_chat_tokenizer

GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "A house costs $1,200 and a shed $300. What do both cost?",
     "answer": "1200 + 300 = <<1200+300=1500>>1500\n#### 1,500"},
    {"question": "It was 5 degrees and fell by 8. What is it now?", "answer": "5 - 8 = -3\n#### -3"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_gsm8k_converter_from_jsonl_with_separate_test_file(tmp_path, capsys):
    train = _write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    test = _write_jsonl(tmp_path / "test.jsonl", GSM8K_ROWS[:1])
    gsm8k.main(["--input", train, "--test-input", test, "--out", str(tmp_path / "out")])
    assert json.loads(capsys.readouterr().out)["train"] == 3
    records = read_prompt_file(tmp_path / "out" / "train.parquet")
    assert [r.ground_truth for r in records] == ["72", "1500", "-3"]
    assert all(r.data_source == "openai/gsm8k" and r.ability == "math" for r in records)
    content = records[0].messages[0]["content"]
    assert records[0].messages[0]["role"] == "user" and content.startswith("Natalia sold clips")
    assert content.endswith(' Let\'s think step by step and output the final answer after "####".')
    assert records[1].extra_info["answer"] == GSM8K_ROWS[1]["answer"] and records[1].extra_info["index"] == 1
    assert len(read_prompt_file(tmp_path / "out" / "test.parquet")) == 1
    # The reference solution scores 1 under the GSM8K rule; so do the converted prompts' own answers.
    for record in records:
        assert default_compute_score(record.data_source, record.extra_info["answer"], record.ground_truth) == 1.0
    # ...and the files load as a training dataset.
    dataset = PromptDataset(str(tmp_path / "out" / "train.parquet"), build_chat_tokenizer(), max_prompt_length=4096)
    assert len(dataset) == 3


def test_gsm8k_converter_from_parquet_holds_out_a_test_split(tmp_path):
    source = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS * 4), source)
    counts = gsm8k.convert(str(source), str(tmp_path / "out"), test_fraction=0.25, seed=1)
    assert counts == {"train": 9, "test": 3}
    train_idx = {r.extra_info["index"] for r in read_prompt_file(tmp_path / "out" / "train.parquet")}
    test_idx = {r.extra_info["index"] for r in read_prompt_file(tmp_path / "out" / "test.parquet")}
    assert train_idx.isdisjoint(test_idx) and train_idx | test_idx == set(range(12))


def test_gsm8k_converter_names_a_row_without_final_answer(tmp_path):
    rows = GSM8K_ROWS + [{"question": "q?", "answer": "no final line"}]
    path = _write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(ValueError, match=r"train.jsonl, row 3: the answer has no '#### <number>'"):
        gsm8k.convert(path, str(tmp_path / "out"), test_input=path)


WRONG_ANSWERS = {"chain_sum": "<answer>123456789</answer>", "countdown": "<answer>1 + 1</answer>",
                 "basic_arithmetic": "<answer>123456789</answer>", "gsm_symbolic": "<answer>123456789</answer>"}


@pytest.mark.parametrize("task", sorted(WRONG_ANSWERS))
def test_reasoning_gym_generation_round_trip(tmp_path, task):
    counts = reasoning_gym.generate(task, train_size=6, val_size=3, seed=5, out_dir=str(tmp_path))
    assert counts == {"train": 6, "val": 3}
    train = read_prompt_file(tmp_path / "train.parquet")
    val = read_prompt_file(tmp_path / "val.parquet")
    assert {r.messages[-1]["content"] for r in train}.isdisjoint(r.messages[-1]["content"] for r in val)
    manager = RewardManager(RewardConfig())
    manager.check_data_sources({r.data_source for r in train})
    for record in train + val:
        assert record.data_source == f"reasoning_gym/{task}" and record.messages[0]["role"] == "system"
        assert json.loads(record.extra_info["reasoning_gym_config"])["seed"] == 5
    records = train + val
    right = manager.score([f"<think>easy</think><answer>{r.ground_truth}</answer>" for r in records],
                          [r.data_source for r in records], [r.ground_truth for r in records],
                          [r.extra_info for r in records])
    wrong = manager.score([WRONG_ANSWERS[task]] * len(records), [r.data_source for r in records],
                          [r.ground_truth for r in records], [r.extra_info for r in records])
    untagged = manager.score([r.ground_truth for r in records], [r.data_source for r in records],
                             [r.ground_truth for r in records], [r.extra_info for r in records])
    assert right.scores.tolist() == [1.0] * len(records) and right.metrics["reward/errors"] == 0
    assert max(wrong.scores.tolist()) < 1.0 and wrong.metrics["reward/errors"] == 0
    assert max(untagged.scores.tolist()) < 1.0  # the answer must be inside <answer> tags


def test_reasoning_gym_generation_is_seeded_and_takes_task_config(tmp_path):
    args = dict(task="chain_sum", train_size=4, val_size=2, seed=3,
                task_config={"min_terms": 2, "max_terms": 2, "max_digits": 2}, system_prompt="none")
    reasoning_gym.generate(out_dir=str(tmp_path / "a"), **args)
    reasoning_gym.generate(out_dir=str(tmp_path / "b"), **args)
    a, b = (read_prompt_file(tmp_path / d / "train.parquet") for d in "ab")
    assert [r.messages for r in a] == [r.messages for r in b]
    assert all(len(r.messages) == 1 and r.messages[0]["content"].count("+") + r.messages[0]["content"].count("-") == 1
               for r in a)


def test_reasoning_gym_bad_task_and_config_are_clear_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        reasoning_gym.main(["--task", "chain_summ", "--train-size", "2", "--val-size", "1", "--out", str(tmp_path)])
    assert "'chain_summ' is not a reasoning-gym task" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not valid for chain_sum"):
        reasoning_gym.generate("chain_sum", 2, 1, 0, str(tmp_path), task_config={"min_terms": 0})


def test_reasoning_gym_entry_that_json_cannot_hold_is_regenerated_for_scoring():
    import reasoning_gym as rg_package

    from engine.rewards.reasoning_gym_tasks import entry_extra_info, task_config_dict

    dataset = rg_package.create_dataset("gsm_symbolic", seed=0, size=400)
    index = next(i for i in range(400) if not _json_safe(dataset[i]))  # metadata with a Fraction
    entry = dataset[index]
    extra_info = entry_extra_info("gsm_symbolic", task_config_dict(dataset), index, entry)
    assert extra_info["reasoning_gym_entry"] == ""
    right = default_compute_score("reasoning_gym/gsm_symbolic", f"<answer>{entry['answer']}</answer>",
                                  entry["answer"], extra_info)
    wrong = default_compute_score("reasoning_gym/gsm_symbolic", "<answer>123456789</answer>", entry["answer"],
                                  extra_info)
    assert (right, wrong) == (1.0, 0.01)


def _json_safe(entry) -> bool:
    try:
        json.dumps(entry)
        return True
    except TypeError:
        return False


def test_reasoning_gym_last_number_extraction(tmp_path):
    reasoning_gym.main(["--task", "chain_sum", "--train-size", "5", "--val-size", "1", "--seed", "1",
                        "--system-prompt", "none", "--answer-extraction", "last_number", "--out", str(tmp_path)])
    records = read_prompt_file(tmp_path / "train.parquet")
    assert all(r.extra_info["reasoning_gym_answer_extraction"] == "last_number" for r in records)
    manager = RewardManager(RewardConfig())
    args = ([r.data_source for r in records], [r.ground_truth for r in records], [r.extra_info for r in records])
    right = manager.score([f"12 + 3 = 15, so the answer is {r.ground_truth}." for r in records], *args)
    wrong = manager.score([f"the answer is {int(r.ground_truth) + 1}, not {r.ground_truth} + 0" for r in records],
                          *args)
    assert right.scores.tolist() == [1.0] * 5 and wrong.scores.tolist() == [0.0] * 5
