"""Multi-turn trajectories on the embedded engine: token fidelity (the engine's sampled ids, the
appended messages' template tokens, the loss mask, log-probs equal a float64 forward of the whole
conversation), the one-turn case equal to a plain ``generate``, and no barrier between trajectories."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine.config import RolloutConfig
from engine.models.char_tokenizer import build_char_tokenizer
from engine.rollout.agentic.environment import Environment, EnvironmentFactory, EnvironmentStep
from engine.rollout.agentic.messages import MessageTokens
from engine.rollout.agentic.parsing import ToolCall, parse_tool_calls
from engine.rollout.agentic.trajectory import (Agent, TrajectoryStats, TrajectoryTask, generate_trajectories,
                                               trajectory_metrics)
from engine.rollout.base import SamplingParams
from engine.rollout.torch_engine import TorchRolloutEngine
from tests.rollout_support import build_tiny_model, reference_log_probs
from tests.test_data_tokenizer import build_chat_tokenizer

# Qwen2.5's rendering of tool messages (its chat template, reduced to the roles used here): the
# results of one turn's calls share one user turn, each in <tool_response> tags.
QWEN_LIKE_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_hermes_tool_calls_are_parsed_in_order_and_a_malformed_one_is_reported():
    text = ('<tool_call>{"name": "calc", "arguments": {"expr": "2*3"}}</tool_call> and '
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": "calc", "arguments": {"expr": </tool_call><tool_call>[1]</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calc", {"expr": "2*3"}), ToolCall("python", {"code": "print(1)"})]
    assert [c.error is not None for c in calls] == [False, False, True, True]
    assert "not valid JSON" in calls[2].error
    assert parse_tool_calls("no call here") == []
    with pytest.raises(ValueError, match="not one of"):
        parse_tool_calls(text, format="mistral")


def test_appended_messages_are_the_templates_text_after_the_sampled_end_of_turn():
    tokenizer = build_chat_tokenizer()
    tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    tokens = MessageTokens(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    two_results = [{"role": "tool", "content": "3901"}, {"role": "tool", "content": "7"}]
    # The model sampled <|im_end|>: the template's newline after it is context, then one user turn.
    assert tokens.text(two_results, im_end) == ("\n<|im_start|>user\n<tool_response>\n3901\n</tool_response>"
                                                "\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # A turn that ended otherwise (a stop id, not the end-of-turn token) is closed as the template closes it.
    assert tokens.text(two_results[:1], last_token=5).startswith("<|im_end|>\n<|im_start|>user\n")
    assert tokens.ids(two_results, im_end) == tokenizer(tokens.text(two_results, im_end), add_special_tokens=False)["input_ids"]
    char = MessageTokens(build_char_tokenizer())  # the demo's template: bare content, then <|im_start|>
    assert char.text([{"role": "tool", "content": "3901"}], last_token=2) == "3901<|im_start|>"


class Recorder(TorchRolloutEngine):
    """The real embedded engine, recording what each ``generate`` call was given and returned."""

    calls: list

    def generate(self, prompt_token_ids, sampling_params):
        samples = super().generate(prompt_token_ids, sampling_params)
        self.calls.append(([list(p) for p in prompt_token_ids], [s[0].token_ids for s in samples]))
        return samples


class Conversation(Environment):
    """A user who asks again ``turns - 1`` times (``turns`` from the row). A row that ``waits`` has
    its user answer only once every row that does not wait is done (the gate is made on the tool
    loop, once per rollout)."""

    gates: dict = {}

    async def reset(self, row: dict) -> None:
        self.turns, self.waits, self.replies = row["extra_info"]["turns"], row["extra_info"].get("waits"), 0

    async def step(self, assistant_message: str) -> EnvironmentStep:
        if self.waits is not None:
            gate = self.gates.setdefault(self.waits, asyncio.Event())
            await asyncio.wait_for(gate.wait(), timeout=60)
        self.replies += 1
        done = self.replies >= self.turns
        return EnvironmentStep([{"role": "user", "content": f"again {self.replies}"}], reward=1.0, done=done)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


def recording_engine(tiny) -> Recorder:
    engine = Recorder(str(tiny.path), RolloutConfig(name="torch", dtype="float32"), device="cpu")
    engine.calls = []
    return engine


def conversation_agent(max_user_turns: int = 5) -> Agent:
    return Agent(MessageTokens(build_char_tokenizer()), environments=EnvironmentFactory({"c": Conversation}, "test"),
                 max_user_turns=max_user_turns)


# Turns end at any of these ids (a third of the vocabulary): short turns from a random model.
STOPS = tuple(range(0, 256, 3))


def assert_token_exact(trajectories, prompts, rows, calls, agent, model) -> None:
    """Each response is the engine's outputs (``calls``: (contexts, sampled ids) of each generate)
    interleaved with the appended messages' template tokens, the loss mask is 0 exactly on those,
    and the engine's log-probs of its tokens equal a float64 forward of the whole conversation."""
    for prompt, row, trajectory in zip(prompts, rows, trajectories):
        expected, mask, replies = [], [], 0
        for given, outputs in calls:
            for context, sampled in zip(given, outputs):
                if context == prompt + expected:
                    expected += sampled
                    mask += [1] * len(sampled)
                    if trajectory.stats.turns > replies + 1:
                        replies += 1
                        appended = agent.message_tokens.ids([{"role": "user", "content": f"again {replies}"}], sampled[-1])
                        expected += appended
                        mask += [0] * len(appended)
        assert trajectory.token_ids == expected and trajectory.loss_mask == mask
        assert trajectory.stats.turns == row["extra_info"]["turns"] and trajectory.stats.env_reward == row["extra_info"]["turns"]
        reference = reference_log_probs(model, prompt, trajectory.token_ids, temperature=1.0)
        sampled = torch.tensor(trajectory.loss_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(trajectory.log_probs, dtype=torch.float64)[sampled], reference[sampled], atol=1e-5)
        assert all(lp == 0.0 for lp, m in zip(trajectory.log_probs, trajectory.loss_mask) if not m)


MULTI_TURN_PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
MULTI_TURN_ROWS = [{"extra_info": {"turns": turns}} for turns in (1, 2, 3)]


def test_multi_turn_trajectories_are_the_engines_tokens_and_the_templates_tokens(tiny):
    engine, agent = recording_engine(tiny), conversation_agent()
    params = SamplingParams(max_new_tokens=60, temperature=1.0, stop_token_ids=STOPS)
    torch.manual_seed(0)
    trajectories = generate_trajectories(engine, [TrajectoryTask(p, r) for p, r in zip(MULTI_TURN_PROMPTS, MULTI_TURN_ROWS)],
                                         params, agent)
    assert [t.stats.turns for t in trajectories] == [1, 2, 3]
    assert_token_exact(trajectories, MULTI_TURN_PROMPTS, MULTI_TURN_ROWS, engine.calls, agent, tiny.model)


def test_one_turn_is_exactly_the_plain_generate(tiny):
    engine = recording_engine(tiny)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [40]]
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50)
    torch.manual_seed(3)
    plain = engine.generate(prompts, params)
    torch.manual_seed(3)
    trajectories = generate_trajectories(engine, [TrajectoryTask(p) for p in prompts], params)
    assert [t.token_ids for t in trajectories] == [s[0].token_ids for s in plain]
    assert [t.log_probs for t in trajectories] == [s[0].log_probs for s in plain]  # bit for bit
    assert all(t.loss_mask == [1] * len(t.token_ids) for t in trajectories)


class FastFirst(Conversation):
    """The fast row's user opens the gate the slow row's user waits at, with its last reply."""

    async def step(self, assistant_message: str) -> EnvironmentStep:
        step = await super().step(assistant_message)
        if step.done and self.waits is None:
            self.gates.setdefault("fast done", asyncio.Event()).set()
        return step


def test_a_trajectory_whose_environment_answers_fast_does_not_wait_for_a_slow_one(tiny):
    """No turn-by-turn barrier: all of the fast trajectory's turns are generated while the slow
    trajectory's environment has not answered its first message."""
    FastFirst.gates = {}
    engine = recording_engine(tiny)
    agent = Agent(MessageTokens(build_char_tokenizer()), environments=EnvironmentFactory({"c": FastFirst}, "test"))
    prompts = [[5, 6, 7], [8, 9]]
    rows = [{"extra_info": {"turns": 4}}, {"extra_info": {"turns": 2, "waits": "fast done"}}]
    params = SamplingParams(max_new_tokens=80, temperature=0.0, stop_token_ids=STOPS)
    trajectories = generate_trajectories(engine, [TrajectoryTask(p, r) for p, r in zip(prompts, rows)], params, agent)
    assert [t.stats.turns for t in trajectories] == [4, 2]
    first_turns = [len(given) for given, _ in engine.calls]
    assert first_turns[0] == 2  # both start together
    fast_alone = [given for given, _ in engine.calls[1:] if len(given) == 1 and given[0][:3] == prompts[0]]
    assert len(fast_alone) == 3, f"the fast trajectory waited for the slow one: calls {first_turns}"


def test_the_response_budget_spans_all_turns_and_cuts_a_batch_to_each_trajectory(tiny):
    engine, agent = recording_engine(tiny), conversation_agent()
    rows = [{"extra_info": {"turns": 50}}]
    trajectory, = generate_trajectories(engine, [TrajectoryTask([5, 6, 7], rows[0])],
                                        SamplingParams(max_new_tokens=30, temperature=1.0, stop_token_ids=STOPS), agent)
    assert len(trajectory.token_ids) <= 30 and trajectory.stats.truncated
    assert trajectory.stats.turns <= agent.max_user_turns + 1


def test_metrics_count_turns_calls_errors_and_truncation():
    stats = [TrajectoryStats(turns=3, tool_calls=2, tool_errors=1, tool_latency_s=0.4),
             TrajectoryStats(turns=1, truncated=True), TrajectoryStats(turns=2, tool_calls=2, tool_truncated=1, tool_latency_s=0.2)]
    metrics = trajectory_metrics(stats)
    assert metrics["rollout/turns/mean"] == 2.0 and metrics["rollout/tool_calls/mean"] == 4 / 3
    assert metrics["rollout/tool_errors/fraction"] == 0.25 and metrics["rollout/tool_truncated/fraction"] == 0.25
    assert metrics["rollout/tool_latency_s/mean"] == pytest.approx(0.15)
    assert metrics["rollout/truncated/fraction"] == pytest.approx(1 / 3)
