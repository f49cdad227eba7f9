"""The CPU demo's model: the character tokenizer, its chat template, and the cached SFT'd Llama folder."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from engine.models.char_tokenizer import (BOS_TOKEN_ID, CHARACTERS, EOS_TOKEN_ID, IM_END_TOKEN, IM_START_TOKEN,
                                          PAD_TOKEN_ID, UNK_TOKEN_ID, VOCAB_SIZE, build_char_tokenizer)
from launch import prepare_demo_model as demo

# A recipe small enough for a unit test: a few SFT steps on a few rows (the real one trains ~640 steps).
SMALL_RECIPE = dataclasses.replace(
    demo.DemoRecipe(),
    data=dataclasses.replace(demo.DemoDataConfig(), train_size=40, val_size=16, sft_pool_size=400),
    sft=dataclasses.replace(demo.DemoSFTConfig(), steps=3, batch_size=8, eval_interval=2),
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def task_entries():
    import reasoning_gym

    data = demo.DemoDataConfig()
    return list(reasoning_gym.create_dataset(data.task, **{**data.task_config, "seed": 5, "size": 50}))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo-arith"
    return demo.prepare_demo_model(out, SMALL_RECIPE)


def test_tokenizer_round_trips_task_strings_one_token_per_character(tokenizer, task_entries):
    samples = [entry["question"] for entry in task_entries] + [entry["answer"] for entry in task_entries]
    samples.append("Line one\nline two: (3 * 4) / 2 = 6, not -7.5 ~ {ok}!")
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(text) and UNK_TOKEN_ID not in ids
        assert tokenizer.decode(ids) == text
    assert tokenizer("\t", add_special_tokens=False)["input_ids"] == [UNK_TOKEN_ID]  # outside the vocabulary
    assert len(tokenizer) == VOCAB_SIZE == 4 + len(CHARACTERS) == 100


def test_special_token_ids(tokenizer):
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (
        PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, UNK_TOKEN_ID) == (0, 1, 2, 3)
    assert tokenizer.convert_ids_to_tokens([1, 2]) == [IM_START_TOKEN, IM_END_TOKEN]
    # A special token written in text is one token, and decoding can drop it.
    ids = tokenizer("12<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[-1] == EOS_TOKEN_ID and len(ids) == 3
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12"
    # No BOS/EOS is added implicitly: the chat template writes every special token itself.
    assert tokenizer("7")["input_ids"] == tokenizer("7", add_special_tokens=False)["input_ids"]


def test_chat_template_renders_the_bare_question_then_the_generation_token(tokenizer):
    user = [{"role": "user", "content": "Calculate 5 + 3."}]
    assert tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False) == \
        "Calculate 5 + 3.<|im_start|>"
    assert tokenizer.apply_chat_template(user + [{"role": "assistant", "content": "8"}], tokenize=False) == \
        "Calculate 5 + 3.<|im_start|>8<|im_end|>"
    conversation = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1 + 2"},
                    {"role": "assistant", "content": "3"}, {"role": "user", "content": "2 + 2"}]
    assert tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False) == \
        "Add.\n1 + 2<|im_start|>3<|im_end|>2 + 2<|im_start|>"


def test_sft_labels_cover_exactly_the_answer_and_end_of_turn(tokenizer):
    (ids, labels), = demo.encode_sft_pairs(tokenizer, [("Calculate 85 + 60.", "145")])
    prompt_length = len("Calculate 85 + 60.") + 1  # + <|im_start|>
    assert labels[:prompt_length] == [-100] * prompt_length
    assert labels[prompt_length:] == ids[prompt_length:]
    assert tokenizer.decode(ids[prompt_length:]) == "145<|im_end|>"


def test_prepared_folder_loads_as_a_llama_with_the_tokenizer(prepared):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.models.hf_config import architecture_from_hf

    assert prepared.trained and prepared.sft_steps == SMALL_RECIPE.sft.steps
    config = json.loads((prepared.model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert (config["vocab_size"], config["pad_token_id"], config["eos_token_id"], config["bos_token_id"]) == (
        VOCAB_SIZE, PAD_TOKEN_ID, EOS_TOKEN_ID, BOS_TOKEN_ID)
    model = AutoModelForCausalLM.from_pretrained(prepared.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(prepared.model_dir)
    assert type(model).__name__ == "LlamaForCausalLM" and len(tokenizer) == model.config.vocab_size
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id == EOS_TOKEN_ID
    assert tokenizer.pad_token_id == model.generation_config.pad_token_id == PAD_TOKEN_ID
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1.5e6
    # The megatron side reads the same folder (engine.models' validated reading of HF configs).
    architecture = architecture_from_hf(prepared.model_dir)
    assert (architecture.hidden_size, architecture.num_layers, architecture.num_attention_heads) == (128, 4, 4)
    recorded = demo.read_recipe_file(prepared.model_dir)
    assert recorded["recipe_hash"] == SMALL_RECIPE.hash() and recorded["sft_steps"] == prepared.sft_steps


def test_prepared_parquet_is_the_standard_schema_with_short_prompts(prepared):
    from transformers import AutoTokenizer

    from engine.data import PromptDataset
    from engine.rewards import default_compute_score

    tokenizer = AutoTokenizer.from_pretrained(prepared.model_dir)
    train = PromptDataset(str(prepared.train_file), tokenizer, max_prompt_length=48)
    val = PromptDataset(str(prepared.val_file), tokenizer, max_prompt_length=48, files_key="data.val_files")
    assert (len(train), len(val)) == (SMALL_RECIPE.data.train_size, SMALL_RECIPE.data.val_size)
    assert train.stats.max_prompt_tokens <= 20  # "Calculate 85 + 60." + <|im_start|>
    record = val[0].record
    assert record.data_source == "reasoning_gym/basic_arithmetic"
    assert tokenizer.decode(val[0].prompt_ids) == record.messages[0]["content"] + IM_START_TOKEN
    # The reward is reasoning-gym's scorer on the last number of the response.
    assert default_compute_score(record.data_source, f"{record.ground_truth}", record.ground_truth,
                                 record.extra_info) == 1.0
    assert default_compute_score(record.data_source, f"1{record.ground_truth}7", record.ground_truth,
                                 record.extra_info) < 1.0
    train_questions = {sample.record.messages[0]["content"] for sample in train.samples}
    assert train_questions.isdisjoint(sample.record.messages[0]["content"] for sample in val.samples)


def test_greedy_evaluation_matches_an_unbatched_argmax_loop(prepared):
    """Batched left-padded generate against one-prompt-at-a-time argmax decoding, scored by string equality."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.data.schema import read_prompt_file

    model = AutoModelForCausalLM.from_pretrained(prepared.model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(prepared.model_dir)
    records = read_prompt_file(prepared.val_file)
    evaluation = demo.greedy_evaluate(model, tokenizer, records, max_new_tokens=4, batch_size=5)
    reference = []
    with torch.no_grad():
        for record in records:
            ids = tokenizer(record.messages[0]["content"] + IM_START_TOKEN, add_special_tokens=False)["input_ids"]
            generated = []
            for _ in range(4):
                next_id = int(model(torch.tensor([ids + generated])).logits[0, -1].argmax())
                if next_id == EOS_TOKEN_ID:
                    break
                generated.append(next_id)
            reference.append(tokenizer.decode(generated, skip_special_tokens=True))
    assert evaluation.responses == reference
    # last_number extraction + exact match: a response is right iff its last number is the answer.
    def right(response, answer):
        numbers = re.findall(r"-?\d+", response)
        return bool(numbers) and numbers[-1] == answer

    expected = sum(right(r, record.ground_truth) for r, record in zip(reference, records)) / len(records)
    assert evaluation.accuracy == pytest.approx(expected)


def test_cache_is_reused_for_the_same_recipe_and_rebuilt_for_another(prepared):
    weights = prepared.model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = demo.prepare_demo_model(prepared.model_dir, SMALL_RECIPE)
    assert not again.trained and weights.stat().st_mtime_ns == mtime
    assert (again.sft_steps, again.val_accuracy) == (prepared.sft_steps, prepared.val_accuracy)
    other = dataclasses.replace(SMALL_RECIPE, sft=dataclasses.replace(SMALL_RECIPE.sft, steps=1))
    rebuilt = demo.prepare_demo_model(prepared.model_dir, other)
    assert rebuilt.trained and rebuilt.sft_steps == 1 and demo.read_recipe_file(prepared.model_dir)["sft_steps"] == 1


def test_cli_rejects_negative_steps(capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--out", "/nonexistent/never-written", "--steps", "-1"])
    assert exit_info.value.code == 2 and "sft.steps=-1" in capsys.readouterr().err
