"""Prompt datasets on real Parquet files: validation errors, length handling, sampling, resume, DP split."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from engine.config import DataConfig
from engine.data import (PromptDataLoader, PromptDataset, PromptSampler, PromptSchemaError, make_prompt_row,
                         read_prompt_file, write_prompt_parquet)
from tests.test_data_tokenizer import build_chat_tokenizer


def _rows(questions: list[str], data_source: str = "openai/gsm8k") -> list[dict]:
    return [make_prompt_row(data_source, [{"role": "user", "content": q}], str(i), ability="math",
                            extra_info={"index": i}) for i, q in enumerate(questions)]


def _write(path, rows):
    write_prompt_parquet(rows, path)
    return str(path)


# ---------------------------------------------------------------- schema validation

def test_valid_file_reads_back_every_field(tmp_path):
    path = _write(tmp_path / "ok.parquet", _rows(["a?", "b?"]))
    records = read_prompt_file(path)
    assert [r.messages for r in records] == [[{"role": "user", "content": "a?"}], [{"role": "user", "content": "b?"}]]
    assert [r.ground_truth for r in records] == ["0", "1"]
    assert [r.extra_info for r in records] == [{"index": 0}, {"index": 1}]
    assert [(r.source_file, r.source_row) for r in records] == [(path, 0), (path, 1)]


def test_missing_column_names_file_and_key(tmp_path):
    path = tmp_path / "no_reward.parquet"
    pq.write_table(pa.table({"data_source": ["x"], "prompt": [[{"role": "user", "content": "q"}]]}), path)
    with pytest.raises(PromptSchemaError) as info:
        read_prompt_file(path)
    assert str(path) in str(info.value) and "'reward_model'" in str(info.value) and "missing column" in str(info.value)


def test_prompt_that_is_not_a_chat_list_names_file_row_and_key(tmp_path):
    path = tmp_path / "plain_prompt.parquet"
    pq.write_table(pa.table({"data_source": ["x"] * 3, "prompt": ["fine?", "plain text", "also"],
                             "reward_model": [{"style": "rule", "ground_truth": "1"}] * 3}), path)
    with pytest.raises(PromptSchemaError) as info:
        read_prompt_file(path)
    assert (info.value.path, info.value.row, info.value.key) == (str(path), 0, "prompt")
    assert f"{path}, row 0, key 'prompt'" in str(info.value)


def test_bad_message_in_a_later_row_is_located(tmp_path):
    rows = _rows(["a", "b", "c"])
    rows[2]["prompt"] = [{"role": "narrator", "content": "c"}]
    path = _write(tmp_path / "bad_role.parquet", rows)
    with pytest.raises(PromptSchemaError, match=r"row 2, key 'prompt'.*role 'narrator'"):
        read_prompt_file(path)


def test_missing_ground_truth_is_located(tmp_path):
    rows = _rows(["a", "b"])
    rows[1]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = _write(tmp_path / "no_gt.parquet", rows)
    with pytest.raises(PromptSchemaError, match=r"row 1, key 'reward_model.ground_truth'"):
        read_prompt_file(path)


def test_empty_dataset_names_the_file(tmp_path):
    path = tmp_path / "empty.parquet"
    full = pa.Table.from_pylist(_rows(["a"]))
    pq.write_table(full.slice(0, 0), path)
    with pytest.raises(PromptSchemaError, match=r"empty\.parquet: the dataset is empty"):
        read_prompt_file(path)


def test_missing_file_and_second_file_errors_name_that_file(tmp_path):
    good = _write(tmp_path / "good.parquet", _rows(["a"]))
    with pytest.raises(PromptSchemaError, match="nope.parquet: file not found"):
        PromptDataset([good, str(tmp_path / "nope.parquet")], build_chat_tokenizer(), max_prompt_length=64)


# ---------------------------------------------------------------- chat template and lengths

def _template_lengths(tokenizer, questions):
    """Reference: transformers' own tokenize=True path of apply_chat_template."""
    return [len(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"]) for q in questions]


QUESTIONS = ["short?", "a medium question about clips?", "x" * 3, "How many clips did Natalia sell " * 4, "q" * 40]


def test_prompts_are_templated_and_match_transformers_tokenization(tmp_path):
    tokenizer = build_chat_tokenizer()
    path = _write(tmp_path / "train.parquet", _rows(QUESTIONS))
    dataset = PromptDataset(path, tokenizer, max_prompt_length=10_000)
    for sample, question in zip(dataset.samples, QUESTIONS):
        expected = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 add_generation_prompt=True, tokenize=True)["input_ids"]
        assert sample.prompt_ids == expected
    assert dataset.stats.num_filtered_overlong == 0 and dataset.stats.num_truncated == 0


@pytest.mark.parametrize("mode", ["filter", "left", "right"])
def test_overlong_prompts_are_filtered_or_truncated_with_counts(tmp_path, mode):
    tokenizer = build_chat_tokenizer()
    lengths = _template_lengths(tokenizer, QUESTIONS)
    limit = sorted(lengths)[2]  # the two longest prompts are over the limit
    num_over = sum(length > limit for length in lengths)
    assert num_over == 2
    path = _write(tmp_path / "train.parquet", _rows(QUESTIONS))
    dataset = PromptDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=mode == "filter",
                            truncation="error" if mode == "filter" else mode)
    full = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True)["input_ids"] for q in QUESTIONS]
    if mode == "filter":
        assert (dataset.stats.num_filtered_overlong, dataset.stats.num_truncated, len(dataset)) == (2, 0, 3)
        assert [s.record.source_row for s in dataset.samples] == [i for i, n in enumerate(lengths) if n <= limit]
    else:
        assert (dataset.stats.num_filtered_overlong, dataset.stats.num_truncated, len(dataset)) == (0, 2, 5)
        for sample, ids in zip(dataset.samples, full):
            expected = ids if len(ids) <= limit else (ids[-limit:] if mode == "left" else ids[:limit])
            assert sample.prompt_ids == expected
    assert dataset.stats.max_prompt_tokens <= limit


def test_overlong_prompt_with_truncation_error_names_first_row(tmp_path):
    tokenizer = build_chat_tokenizer()
    lengths = _template_lengths(tokenizer, QUESTIONS)
    path = _write(tmp_path / "train.parquet", _rows(QUESTIONS))
    first_over = next(i for i, n in enumerate(lengths) if n > sorted(lengths)[2])
    with pytest.raises(PromptSchemaError, match=rf"row {first_over}, key 'prompt'.*2 of 5 prompts"):
        PromptDataset(path, tokenizer, max_prompt_length=sorted(lengths)[2])


def test_everything_filtered_is_an_error(tmp_path):
    path = _write(tmp_path / "train.parquet", _rows(QUESTIONS))
    with pytest.raises(PromptSchemaError, match="no prompt is left"):
        PromptDataset(path, build_chat_tokenizer(), max_prompt_length=2, filter_overlong_prompts=True)


def test_prompt_key_names_the_column(tmp_path):
    rows = [{("messages" if key == "prompt" else key): value for key, value in row.items()} for row in _rows(QUESTIONS)]
    path = tmp_path / "renamed.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(PromptSchemaError, match=r"key 'prompt'.*missing column \(data.prompt_key\)"):
        read_prompt_file(path)
    config = DataConfig(train_files=[str(path)], prompt_key="messages", train_batch_size=2, max_prompt_length=512)
    dataset = PromptDataset.from_config(config, build_chat_tokenizer())
    assert len(dataset) == len(QUESTIONS) and dataset[0].record.messages[0]["content"] == QUESTIONS[0]


# ---------------------------------------------------------------- sampler

def _all_batches(sampler, epochs):
    batches = []
    for _ in range(epochs):
        batches.extend(indices.tolist() for indices in sampler)
    return batches


def test_sampler_is_deterministic_and_reshuffles_per_epoch():
    first = _all_batches(PromptSampler(40, 8, seed=3), epochs=2)
    again = _all_batches(PromptSampler(40, 8, seed=3), epochs=2)
    other_seed = _all_batches(PromptSampler(40, 8, seed=4), epochs=2)
    assert first == again
    assert first != other_seed
    assert first[:5] != first[5:]  # epoch 1 is a different permutation than epoch 0
    assert sorted(sum(first[:5], [])) == list(range(40))


@pytest.mark.parametrize("stop_after", [1, 3, 5, 7])  # mid-epoch, last batch of an epoch, next epoch
def test_sampler_resume_yields_exactly_the_uninterrupted_batches(stop_after):
    # 43 samples, batches of 8: 5 batches per epoch, 3 samples dropped per epoch.
    uninterrupted = _all_batches(PromptSampler(43, 8, seed=11), epochs=3)

    interrupted = PromptSampler(43, 8, seed=11)
    consumed = []
    iterator = iter(interrupted)
    while len(consumed) < stop_after:
        try:
            consumed.append(next(iterator).tolist())
        except StopIteration:  # the trainer starts the next epoch
            iterator = iter(interrupted)
    state = json.loads(json.dumps(interrupted.state_dict()))  # as it would be stored in a checkpoint

    resumed = PromptSampler(43, 8, seed=999)  # the seed is restored from the state
    resumed.load_state_dict(state)
    rest = []
    while len(consumed) + len(rest) < len(uninterrupted):
        rest.extend(indices.tolist() for indices in resumed)
    assert consumed + rest == uninterrupted


def test_sampler_refuses_state_from_a_different_dataset():
    state = PromptSampler(40, 8).state_dict()
    with pytest.raises(ValueError, match="num_samples=40"):
        PromptSampler(41, 8).load_state_dict(state)


@pytest.mark.parametrize("data_parallel_size", [1, 2, 4])
def test_dp_split_is_contiguous_and_covers_each_sample_once_per_epoch(data_parallel_size):
    reference = PromptSampler(48, 12, seed=5)
    ranks = [PromptSampler(48, 12, data_parallel_rank=r, data_parallel_size=data_parallel_size, seed=5)
             for r in range(data_parallel_size)]
    for epoch in range(2):
        per_rank = [[indices.tolist() for indices in sampler] for sampler in ranks]
        seen = []
        for batch_index, global_batch in enumerate(reference):
            shares = [per_rank[r][batch_index] for r in range(data_parallel_size)]
            assert all(len(share) == 12 // data_parallel_size for share in shares)
            assert sum(shares, []) == global_batch.tolist()  # rank order concatenation = global batch
            seen.extend(sum(shares, []))
        assert sorted(seen) == list(range(48)), f"epoch {epoch}"


def test_resume_with_a_different_dp_size_continues_the_global_batches():
    uninterrupted = _all_batches(PromptSampler(48, 12, seed=2), epochs=2)
    first = PromptSampler(48, 12, data_parallel_rank=0, data_parallel_size=2, seed=2)
    next(iter(first)), next(iter(first))  # each fresh iter continues: two batches consumed
    state = first.state_dict()
    ranks = [PromptSampler(48, 12, data_parallel_rank=r, data_parallel_size=4, seed=2) for r in range(4)]
    for sampler in ranks:
        sampler.load_state_dict(state)
    rest = [sum(shares, []) for shares in zip(*[[i.tolist() for i in s] for s in ranks])]
    assert rest == uninterrupted[2:4]


def test_train_batch_size_must_split_over_dp():
    with pytest.raises(ValueError, match="not divisible by the data-parallel size 4"):
        PromptSampler(40, 10, data_parallel_size=4)


# ---------------------------------------------------------------- batches

def test_loader_left_pads_and_carries_metadata(tmp_path):
    tokenizer = build_chat_tokenizer()
    rows = _rows(QUESTIONS + ["extra one?"])
    path = _write(tmp_path / "train.parquet", rows)
    config = DataConfig(train_files=[str(path)], train_batch_size=4, max_prompt_length=512, seed=7)
    dataset = PromptDataset.from_config(config, tokenizer)
    loader = PromptDataLoader.for_training(dataset, config, data_parallel_rank=1, data_parallel_size=2)
    batch = next(iter(loader))
    expected_indices = PromptSampler(6, 4, data_parallel_rank=1, data_parallel_size=2, seed=7).rank_indices(0, 0)
    assert batch.dataset_indices.tolist() == expected_indices.tolist()
    width = max(len(dataset[int(i)].prompt_ids) for i in expected_indices)
    assert batch.input_ids.shape == batch.attention_mask.shape == (2, width)
    for row, index in enumerate(expected_indices.tolist()):
        ids = dataset[index].prompt_ids
        pad = width - len(ids)
        assert batch.input_ids[row, pad:].tolist() == ids
        assert batch.input_ids[row, :pad].tolist() == [tokenizer.pad_token_id] * pad
        assert batch.attention_mask[row].tolist() == [0] * pad + [1] * len(ids)
        assert batch.position_ids[row, pad:].tolist() == list(range(len(ids)))
        assert batch.raw_prompt_ids[row] == ids
        assert batch.ground_truths[row] == str(index) and batch.extra_infos[row] == {"index": index}
        assert batch.data_sources[row] == "openai/gsm8k" and batch.abilities[row] == "math"
    assert batch.prompt_uids.tolist() == expected_indices.tolist()  # epoch 0: uid = dataset index

    repeated = batch.repeat_interleave(3)
    assert repeated.prompt_uids.tolist() == [u for u in batch.prompt_uids.tolist() for _ in range(3)]
    assert torch.equal(repeated.input_ids[3], batch.input_ids[1]) and len(repeated) == 6
    assert repeated.ground_truths[5] == batch.ground_truths[1]


def test_prompt_uids_are_unique_across_epochs(tmp_path):
    path = _write(tmp_path / "train.parquet", _rows(QUESTIONS + ["sixth?"]))
    config = DataConfig(train_files=[str(path)], train_batch_size=3, max_prompt_length=512)
    loader = PromptDataLoader.for_training(PromptDataset.from_config(config, build_chat_tokenizer()), config)
    uids = [uid for _ in range(3) for batch in loader for uid in batch.prompt_uids.tolist()]
    assert len(uids) == 18 and len(set(uids)) == 18


def test_validation_loader_covers_every_prompt_once_with_uneven_ranks(tmp_path):
    questions = [f"question {i}?" for i in range(7)]
    path = _write(tmp_path / "val.parquet", _rows(questions))
    config = DataConfig(val_files=[str(path)], val_batch_size=4, max_prompt_length=512)
    dataset = PromptDataset.from_config(config, build_chat_tokenizer(), split="val")
    seen = []
    for rank in range(3):
        loader = PromptDataLoader.for_validation(dataset, config, data_parallel_rank=rank, data_parallel_size=3)
        seen.extend(i for batch in loader for i in batch.dataset_indices.tolist())
    assert sorted(seen) == list(range(7))
    assert len(PromptDataLoader.for_validation(dataset, config)) == 2


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_training_batches_resume_at_the_batch_after_the_saved_step(tmp_path, ahead):
    """Off-policy (``ahead`` steps) draws the next batches early; the state a checkpoint saves is the
    one after the step's own batches, so a resumed run draws (and regenerates) the batches that were
    in flight. Dynamic sampling takes more batches within a step (``more``): the next in order (the
    oldest in flight), each drawing one more to generate; the saved state follows them."""
    from engine.trainer.ppo_trainer import TrainingPrompts

    path = _write(tmp_path / "train.parquet", _rows(QUESTIONS + ["sixth?"]))
    config = DataConfig(train_files=[str(path)], train_batch_size=2, max_prompt_length=512)
    dataset = PromptDataset.from_config(config, build_chat_tokenizer())
    stream = TrainingPrompts(PromptDataLoader.for_training(dataset, config), ahead=ahead)
    steps, started = [], []
    for step in range(7):  # 3 batches per epoch: crosses two epoch ends
        prompts, upcoming = stream.next(steps_left=7 - step)
        extra = []
        if step == 1:  # step 2 takes a second batch
            second, more = stream.more()
            extra, upcoming = [second], upcoming + more
        started.append([batch.prompt_uids.tolist() for batch in upcoming])
        steps.append((prompts, stream.sampler_state, extra))
    taken = [batch.prompt_uids.tolist() for prompts, _, extra in steps for batch in [prompts, *extra]]
    assert len({uid for batch in taken for uid in batch}) == 16  # every batch once, in order
    # The first step starts `ahead` batches, later ones one per batch taken, none past the last step.
    assert [len(batches) for batches in started] == ([0] * 7 if not ahead else [ahead, 2] + [1] * (5 - ahead) + [0] * ahead)
    in_order = [batch for batches in started for batch in batches]
    assert in_order == taken[1:1 + len(in_order)]
    for saved_step in (1, 2, 3, 4):
        resumed = PromptDataLoader.for_training(dataset, config)
        resumed.load_state_dict(steps[saved_step - 1][1])
        again = TrainingPrompts(resumed, ahead=ahead)
        later = [batch.prompt_uids.tolist() for prompts, _, extra in steps[saved_step:] for batch in [prompts, *extra]]
        assert [again.next(len(later) - i)[0].prompt_uids.tolist() for i in range(len(later))] == later


