"""The CPU tool-use demo's model: warm-up conversations in the rollout's exact token layout, and a
warm-up that leaves PPO something to learn (a minority of tool calls, which are then right)."""
from __future__ import annotations

import asyncio
import json

import pytest

from engine.models.char_tokenizer import EOS_TOKEN_ID, build_char_tokenizer
from launch import prepare_demo_model as demo
from launch import prepare_demo_tools_model as tools_demo
from tests.distributed import REPO_ROOT


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer(model_max_length=128)


@pytest.fixture(scope="module")
def tools_model():
    """The demo-tools folder in .cache/models/demo-tools, built once (~2 min, after demo-arith) and reused,
    as `python -m launch.prepare_demo_tools_model` does; under a file lock like demo-arith."""
    return tools_demo.prepare_demo_tools_model(REPO_ROOT / ".cache" / "models" / "demo-tools")


def _encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_the_tool_config_gives_the_calculator_as_calc(tokenizer):
    from engine.rollout.agentic.parsing import ToolCall, parse_tool_calls
    from engine.rollout.agentic.tools import call_named, load_tools

    tools = load_tools(str(tools_demo.TOOL_CONFIG))
    assert list(tools) == ["calc"]
    call = tools_demo.tool_call_text(tools_demo.expression_of("Calculate 47 * 83."))
    assert call == '<tool_call>{"name":"calc","arguments":{"expr":"47*83"}}</tool_call>'
    assert parse_tool_calls(call) == [ToolCall("calc", {"expr": "47*83"})]
    outcome = asyncio.run(call_named(tools, "calc", {"expr": "47*83"}, {}))
    assert (outcome.text, outcome.error) == ("3901", False)
    # The longest call (of 100 * 100) and its conversation fit the demo's prompt and response budget.
    longest = tools_demo.tool_conversation("Calculate 100 * 100.", "10000")
    ids, _ = demo.encode_sft_conversations(tokenizer, [longest])[0]
    prompt_length = len(_encode(tokenizer, "Calculate 100 * 100.")) + 1
    assert prompt_length <= tools_demo.MAX_PROMPT_LENGTH
    assert len(ids) - prompt_length <= tools_demo.MAX_RESPONSE_LENGTH
    assert tools_demo.MAX_PROMPT_LENGTH + tools_demo.MAX_RESPONSE_LENGTH <= 128  # the model's context


def test_warmup_tokens_are_the_rollouts_tokens(tokenizer):
    """prompt (PromptDataset's rendering) + the call and <|im_end|> (sampled) + the tool message as the rollout
    appends it (MessageTokens after <|im_end|>) + the answer and <|im_end|> (sampled); loss on sampled only."""
    from engine.data.dataset import render_chat_prompts
    from engine.data.schema import PromptRecord
    from engine.rollout.agentic.messages import MessageTokens

    question, answer = "Calculate 47 * 83.", "3901"
    conversations = [tools_demo.tool_conversation(question, answer), tools_demo.direct_conversation(question, answer)]
    (tool_ids, tool_labels), (direct_ids, direct_labels) = demo.encode_sft_conversations(tokenizer, conversations)

    prompt = _encode(tokenizer, render_chat_prompts(tokenizer, [PromptRecord("", conversations[0][:1], answer)])[0])
    call = _encode(tokenizer, tools_demo.tool_call_text("47*83")) + [EOS_TOKEN_ID]
    appended = MessageTokens(tokenizer).ids([{"role": "tool", "name": "calc", "content": "3901"}], EOS_TOKEN_ID)
    final = _encode(tokenizer, answer) + [EOS_TOKEN_ID]
    assert tool_ids == prompt + call + appended + final
    assert tool_labels == [-100] * len(prompt) + call + [-100] * len(appended) + final
    assert tokenizer.decode(tool_ids) == ('Calculate 47 * 83.<|im_start|><tool_call>{"name":"calc","arguments":'
                                          '{"expr":"47*83"}}</tool_call><|im_end|>3901<|im_start|>3901<|im_end|>')
    assert (direct_ids, direct_labels) == (prompt + final, [-100] * len(prompt) + final)
    tools_demo.assert_rollout_layout(tokenizer, MessageTokens(tokenizer), conversations,
                                     [(tool_ids, tool_labels), (direct_ids, direct_labels)])
    with pytest.raises(AssertionError, match="a rollout holds"):  # the check catches a shifted layout
        tools_demo.assert_rollout_layout(tokenizer, MessageTokens(tokenizer), conversations[:1],
                                         [(tool_ids[:-2] + tool_ids[-1:], tool_labels[:-1])])


def test_warmup_conversations_are_a_tool_fraction_of_fresh_questions():
    data = tools_demo.ToolsRecipe().data
    warmup = tools_demo.WarmupConfig(examples=40, tool_fraction=0.25)
    excluded = {question for question, _ in demo.sft_pairs(data, set())[:30]}
    conversations = tools_demo.warmup_conversations(data, warmup, excluded)
    questions = [conversation[0]["content"] for conversation in conversations]
    assert len(set(questions)) == 40 and excluded.isdisjoint(questions)
    assert sum(map(tools_demo.uses_tool, conversations)) == 10
    for conversation in conversations:
        question, answer = conversation[0]["content"], conversation[-1]["content"]
        assert " * " in question and answer == str(eval(tools_demo.expression_of(question)))
        if tools_demo.uses_tool(conversation):
            assert conversation[2] == {"role": "tool", "name": "calc", "content": answer}


def test_parquet_is_two_term_products_scored_by_the_rewards(tools_model):
    from engine.data import PromptDataset
    from engine.rewards import RewardConfig, RewardManager

    tokenizer = build_char_tokenizer(model_max_length=128)
    val = PromptDataset(str(tools_model.val_file), tokenizer, max_prompt_length=tools_demo.MAX_PROMPT_LENGTH,
                        files_key="data.val_files")
    train = PromptDataset(str(tools_model.train_file), tokenizer, max_prompt_length=tools_demo.MAX_PROMPT_LENGTH)
    recipe = tools_demo.ToolsRecipe()
    assert (len(train), len(val)) == (recipe.data.train_size, recipe.data.val_size)
    records = [sample.record for sample in val.samples]
    assert all(record.data_source == "reasoning_gym/basic_arithmetic" for record in records)
    assert all(str(eval(tools_demo.expression_of(r.messages[0]["content"]))) == r.ground_truth for r in records)
    manager = RewardManager(RewardConfig())
    manager.check_data_sources(val.data_sources | train.data_sources)
    # What the reward sees of a tool-using response: the sampled turns (the call, then the answer), not the
    # tool's text. Answering after the call scores; stopping after it scores only where the second factor
    # is the product ("Calculate 1 * 83.": the last number of the call).
    calls = [tools_demo.tool_call_text(tools_demo.expression_of(r.messages[0]["content"])) for r in records]
    scores = manager.score([call + r.ground_truth for call, r in zip(calls, records)] + calls,
                           [r.data_source for r in records] * 2, [r.ground_truth for r in records] * 2,
                           [r.extra_info for r in records] * 2).scores.tolist()
    assert scores[:len(records)] == [1.0] * len(records)
    assert scores[len(records):] == [float(r.messages[0]["content"].rstrip(".").split(" * ")[1] == r.ground_truth)
                                     for r in records]


def test_a_rollout_of_the_warmed_up_model_holds_the_warmup_tokens(tools_model, tokenizer):
    """Sampled trajectories through the real rollout: each that called the tool and answered right is,
    token for token, the SFT encoding of its conversation, and its loss mask is the SFT's label mask."""
    repeats = 3  # samples a prompt: about 1 in 30 samples calls the tool and copies its result right (measured)
    evaluation = tools_demo.evaluate_with_tools(tools_model.model_dir, tools_model.val_file, temperature=1.0,
                                                repeats=repeats)
    from engine.data.schema import read_prompt_file

    records = [record for record in read_prompt_file(tools_model.val_file) for _ in range(repeats)]
    compared = 0
    for record, trajectory, response in zip(records, evaluation.trajectories, evaluation.responses):
        if trajectory.stats.tool_calls != 1 or not response.endswith(record.ground_truth) \
                or trajectory.stats.truncated:
            continue
        question = record.messages[0]["content"]
        conversation = tools_demo.tool_conversation(question, record.ground_truth)
        if response != conversation[1]["content"] + record.ground_truth:
            continue
        (ids, labels), = demo.encode_sft_conversations(tokenizer, [conversation])
        prompt = _encode(tokenizer, question) + [tokenizer.bos_token_id]
        assert prompt + trajectory.token_ids == ids
        assert [0] * len(prompt) + trajectory.loss_mask == [int(label != -100) for label in labels]
        compared += 1
    assert compared >= 5, f"only {compared} sampled trajectories called the tool and answered right"


def test_warmup_leaves_ppo_headroom(tools_model):
    """After the warm-up the model calls the tool in a minority of its sampled responses and is then
    right more often than without it (measured: sampled 0.16 against 0.0, greedy 0.35 against 0.006);
    its direct answers are wrong, and greedy decoding mostly answers directly: calling the tool, and
    copying its result, is what PPO has to learn."""
    greedy, sampled = tools_model.measured["greedy"], tools_model.measured["sampled"]
    assert 0.15 <= sampled["tool_use"] <= 0.5
    assert sampled["accuracy_without_tool"] <= 0.05 and greedy["accuracy_without_tool"] <= 0.05
    assert sampled["accuracy_with_tool"] >= sampled["accuracy_without_tool"] + 0.1
    assert greedy["accuracy"] <= 0.35
    if greedy["tool_use"] >= 0.1:
        assert greedy["accuracy_with_tool"] >= greedy["accuracy_without_tool"] + 0.2
    assert sampled["truncated"] <= 0.05 and greedy["truncated"] <= 0.05
    # The numbers are what the rollout measures now (greedy decoding: deterministic on one thread).
    with tools_demo.single_thread():
        again = tools_demo.evaluate_with_tools(tools_model.model_dir, tools_model.val_file, temperature=0.0)
    for key, value in again.summary().items():
        assert value == (None if greedy[key] is None else pytest.approx(greedy[key], abs=0.02)), key


def test_the_folder_is_reused_for_its_recipe(tools_model):
    weights = tools_model.model_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    again = tools_demo.prepare_demo_tools_model(tools_model.model_dir)
    assert not again.trained and weights.stat().st_mtime_ns == mtime and again.measured == tools_model.measured
    recorded = json.loads((tools_model.model_dir / tools_demo.RECIPE_FILE).read_text())
    assert recorded["recipe_hash"] == tools_demo.ToolsRecipe().hash()
    assert recorded["recipe"]["base_recipe_hash"] == demo.DemoRecipe().hash()
    assert recorded["warmup_tool_conversations"] == round(recorded["recipe"]["warmup"]["tool_fraction"]
                                                          * recorded["warmup_conversations"])
