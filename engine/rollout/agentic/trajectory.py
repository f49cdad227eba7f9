"""Trajectories: each response advances turn by turn on its own, token-exact.

A trajectory is generated until a stop; the tool calls in that turn are run (concurrently, on an
asyncio loop of their own) and their results appended as tool messages through the chat template;
then it is generated again, until the model answers without a call (or an environment ends the
conversation), a turn limit, or the response budget (``max_new_tokens`` across all turns).

There is no barrier between trajectories' turns. An engine that serves requests concurrently
(``RolloutEngine.concurrent_requests``: SGLang) gets each trajectory's turn as a request of its own
the moment it is ready; the embedded engines generate one batch at a time, of whichever
trajectories are ready, while the others wait on their tools. A single-turn rollout (no agent) is
the same path with one turn: every trajectory is ready at once, so the embedded engine generates
exactly the batch it always did.

Token fidelity: the response is the engine's sampled ids of each turn, followed by the appended
messages' ids (``MessageTokens``); ``loss_mask`` is 1 on sampled tokens and 0 on appended ones,
whose log-probs are 0 and policy versions -1.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.rollout.agentic.environment import Environment, EnvironmentFactory, load_environments
from engine.rollout.agentic.messages import MessageTokens
from engine.rollout.agentic.parsing import ToolCall, parse_tool_calls
from engine.rollout.agentic.tools import Tool, ToolOutcome, call_named, load_tools
from engine.rollout.base import RolloutEngine, RolloutSample, RolloutServerDied, SamplingParams
from engine.rollout.sglang_server import WaitReport


@dataclass
class Agent:
    """What makes a response a multi-turn trajectory (``actor_rollout_ref.rollout.multi_turn``)."""

    message_tokens: MessageTokens
    tools: dict[str, Tool] = field(default_factory=dict)
    environments: EnvironmentFactory | None = None
    max_assistant_turns: int = 5
    max_user_turns: int = 5
    format: str = "hermes"

    @classmethod
    def from_config(cls, multi_turn: Any, tokenizer: Any) -> "Agent | None":
        """The agent of ``actor_rollout_ref.rollout.multi_turn`` (a ``MultiTurnConfig``); None when disabled."""
        if not multi_turn.enable:
            return None
        tools = load_tools(multi_turn.tool_config_path) if multi_turn.tool_config_path else {}
        environments = (load_environments(multi_turn.interaction_config_path)
                        if multi_turn.interaction_config_path else None)
        return cls(MessageTokens(tokenizer), tools, environments, multi_turn.max_assistant_turns,
                   multi_turn.max_user_turns, multi_turn.format)


@dataclass
class TrajectoryTask:
    """A prompt to answer and its row (for an environment's ``reset``)."""

    prompt_ids: list[int]
    row: dict = field(default_factory=dict)


@dataclass
class TrajectoryStats:
    """What a trajectory did, per sample (``rollout/*`` metrics; ``env_reward`` joins the score)."""

    turns: int = 0  # assistant turns
    tool_calls: int = 0
    tool_errors: int = 0  # raised, timed out, unknown tool, unreadable call
    tool_truncated: int = 0  # outputs cut to the tool's limit
    tool_latency_s: float = 0.0  # summed over its calls
    truncated: bool = False  # stopped by the response budget or a turn limit, not by the model or environment
    env_reward: float | None = None


@dataclass
class Trajectory:
    """The response of one prompt: sampled turns and appended messages, as token ids."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)  # the engine's, 0 on appended tokens
    loss_mask: list[int] = field(default_factory=list)  # 1 on sampled tokens
    finish_reason: str = "stop"  # of the last turn
    # the last turn's routed experts: every token before its last, earlier turns' included
    routed_experts: torch.Tensor | None = None
    policy_versions: list[int] | None = field(default_factory=list)  # -1 on appended tokens
    stats: TrajectoryStats = field(default_factory=TrajectoryStats)


@dataclass
class _Running:
    task: TrajectoryTask
    budget: int
    trajectory: Trajectory = field(default_factory=Trajectory)
    tool_state: dict = field(default_factory=dict)
    environment: Environment | None = None
    user_turns: int = 0
    lost: bool = False  # with a server that died

    @property
    def context(self) -> list[int]:
        return self.task.prompt_ids + self.trajectory.token_ids

    @property
    def room(self) -> int:
        return self.budget - len(self.trajectory.token_ids)

    def add_sampled(self, sample: RolloutSample) -> list[int]:
        """The turn's tokens, cut to the budget (a batch may have been given more)."""
        t, keep = self.trajectory, min(len(sample.token_ids), self.room)
        tokens = sample.token_ids[:keep]
        t.token_ids += tokens
        t.log_probs += sample.log_probs[:keep]
        t.loss_mask += [1] * keep
        t.finish_reason = sample.finish_reason if keep == len(sample.token_ids) else "length"
        if sample.routed_experts is not None:
            t.routed_experts = sample.routed_experts[:len(self.context) - 1]
        if t.policy_versions is not None:
            t.policy_versions = None if sample.policy_versions is None else t.policy_versions + sample.policy_versions[:keep]
        t.stats.turns += 1
        return tokens

    def add_context(self, ids: list[int]) -> bool:
        """Append the ids of messages the model did not write; False (nothing appended) when they
        would leave the model no token to answer with."""
        if len(ids) >= self.room:
            return False
        t = self.trajectory
        t.token_ids += ids
        t.log_probs += [0.0] * len(ids)
        t.loss_mask += [0] * len(ids)
        if t.policy_versions is not None:
            t.policy_versions += [-1] * len(ids)
        return True


class _EventLoop:
    """An asyncio loop on a thread of its own: tools and environments run there, concurrently."""

    def __enter__(self) -> "_EventLoop":
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="agentic-tools")
        self._thread.start()
        return self

    def submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def __exit__(self, *exc_info: object) -> None:
        def stop() -> None:  # a step that failed leaves no tool (or its child process) running
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.call_soon(self.loop.stop)

        self.loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


def generate_trajectories(engine: RolloutEngine, tasks: list[TrajectoryTask], params: SamplingParams,
                          agent: Agent | None = None, barrier: bool = False) -> list[Trajectory | None]:
    """One trajectory per task (``params.max_new_tokens`` is the budget across all turns); None
    for a task lost with a server that died (``RolloutServerDied``: send it again after the restart).
    ``barrier``: the turn-by-turn baseline (``benchmarks.agentic``): a turn starts only when every
    trajectory has finished the one before, generation and tools included."""
    if params.n != 1:
        raise ValueError("trajectories are generated one per task: repeat the prompts instead of n > 1")
    runs = [_Running(task, params.max_new_tokens) for task in tasks]
    pool = (concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(runs), 256)),
                                                  thread_name_prefix="trajectory-generate")
            if engine.concurrent_requests else _InCallingThread())
    with _EventLoop() as tools, pool:
        _Scheduler(engine, params, agent, tools, pool, barrier).run(runs)
    return [None if run.lost else run.trajectory for run in runs]


class _InCallingThread(concurrent.futures.Executor):
    """An engine that takes one call at a time (an embedded one) generates in the calling thread,
    where torch's intra-op threads already run. From a fresh worker thread (one per rollout) the same
    call took 1.9x as long (``benchmarks.suite --matrix cpu --cases trident-tiny``, 2 threads:
    ``gen`` 0.061-0.065 s; 0.030-0.031 s here; 0.033 s at bb133c9, before rollouts ran as
    trajectories), most likely OpenMP starting a team for each new thread beside the trainer
    thread's, which still spins from the phase before."""

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as error:  # handed to the scheduler as a pool's future would be (a server died)
            future.set_exception(error)
        return future


class _Scheduler:
    def __init__(self, engine: RolloutEngine, params: SamplingParams, agent: Agent | None, tools: _EventLoop,
                 pool: concurrent.futures.Executor, barrier: bool = False) -> None:
        self.engine, self.params, self.agent, self.tools, self.pool = engine, params, agent, tools, pool
        self.barrier = barrier
        self.ready: collections.deque[_Running] = collections.deque()
        self.waiting: dict[concurrent.futures.Future, tuple[str, Any]] = {}
        self.generating = 0

    def run(self, runs: list[_Running]) -> None:
        if self.agent is not None and self.agent.environments is not None:
            # Every environment is set up before the first turn, so the first batch holds every row.
            for run in runs:
                run.environment = self.agent.environments.for_row(run.task.row)
            resets = [self.tools.submit(run.environment.reset(run.task.row)) for run in runs]
            for reset in resets:
                reset.result()
        self.ready.extend(runs)
        report = WaitReport()
        while self.ready or self.waiting:
            self._start_generating()
            done, _ = concurrent.futures.wait(self.waiting, timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED)
            if not done:
                report.tick(lambda: f"trajectories: {len(runs)} in all, {self.generating} generation call(s) "
                                    f"and {self._with_tools()} trajectories with their tools or environment")
            for future in [f for f in self.waiting if f in done]:  # in submission order
                kind, payload = self.waiting.pop(future)
                getattr(self, f"_after_{kind}")(future, payload)

    def _start_generating(self) -> None:
        if self.barrier and self.waiting:
            return
        if not self.engine.concurrent_requests and len(self.ready) < self._with_tools():
            # A batch engine's call costs about the same for few rows as for many: it waits until at
            # least as many trajectories are ready as are still with their tools.
            return
        # One request per turn where turns follow each other (an agent, a server); one call for all
        # that are ready otherwise: a one-turn rollout is then the engine's own batch call.
        one_by_one = self.engine.concurrent_requests and self.agent is not None
        while self.ready and (one_by_one or not self.generating):
            group = [self.ready.popleft()] if one_by_one else list(self.ready)
            if not one_by_one:
                self.ready.clear()
            self.generating += 1
            self.waiting[self.pool.submit(self._generate, group)] = ("generate", group)

    def _with_tools(self) -> int:
        return sum(1 for kind, _ in self.waiting.values() if kind != "generate")

    def _generate(self, group: list[_Running]) -> list[RolloutSample]:
        params = replace(self.params, max_new_tokens=max(run.room for run in group))
        return [samples[0] for samples in self.engine.generate([run.context for run in group], params)]

    def _after_generate(self, future: concurrent.futures.Future, group: list[_Running]) -> None:
        self.generating -= 1
        try:
            samples = dict(enumerate(future.result()))
        except RolloutServerDied as died:
            samples = {index: answer[0] for index, answer in died.completed.items()}
        for index, run in enumerate(group):
            if index not in samples:
                run.lost = True
                continue
            sample = samples[index]
            tokens = run.add_sampled(sample)
            if self.agent is None or run.trajectory.finish_reason != "stop":
                run.trajectory.stats.truncated = run.trajectory.finish_reason == "length"
                continue
            self._after_turn(run, tokens)

    def _after_turn(self, run: _Running, tokens: list[int]) -> None:
        """Tools for the calls in the turn, the environment for an answer, or the end."""
        agent = self.agent
        text = agent.message_tokens.tokenizer.decode(tokens, skip_special_tokens=True)
        calls = parse_tool_calls(text, agent.format) if agent.tools else []
        if calls:
            if run.trajectory.stats.turns >= agent.max_assistant_turns:
                run.trajectory.stats.truncated = True  # it asked for a tool it may not get
                return
            self.waiting[self.tools.submit(self._call_tools(calls, run.tool_state))] = ("tools", (run, calls))
        elif run.environment is not None:
            self.waiting[self.tools.submit(run.environment.step(text))] = ("step", run)

    async def _call_tools(self, calls: list[ToolCall], state: dict) -> list[ToolOutcome]:
        async def one(call: ToolCall) -> ToolOutcome:
            if call.error is not None:
                return ToolOutcome(f"Error: {call.error}", error=True, truncated=False, latency_s=0.0)
            return await call_named(self.agent.tools, call.name, call.arguments, state)

        return list(await asyncio.gather(*(one(call) for call in calls)))

    def _after_tools(self, future: concurrent.futures.Future, payload: tuple[_Running, list[ToolCall]]) -> None:
        run, calls = payload
        outcomes = future.result()
        stats = run.trajectory.stats
        stats.tool_calls += len(outcomes)
        stats.tool_errors += sum(outcome.error for outcome in outcomes)
        stats.tool_truncated += sum(outcome.truncated for outcome in outcomes)
        stats.tool_latency_s += sum(outcome.latency_s for outcome in outcomes)
        messages = [{"role": "tool", "name": call.name, "content": outcome.text} for call, outcome in zip(calls, outcomes)]
        self._continue(run, messages)

    def _after_step(self, future: concurrent.futures.Future, run: _Running) -> None:
        step = future.result()
        stats = run.trajectory.stats
        if step.reward is not None:
            stats.env_reward = (stats.env_reward or 0.0) + float(step.reward)
        if step.done:
            return
        if run.user_turns >= self.agent.max_user_turns or stats.turns >= self.agent.max_assistant_turns:
            stats.truncated = True
            return
        run.user_turns += 1
        self._continue(run, step.messages)

    def _continue(self, run: _Running, messages: list[dict]) -> None:
        last = run.trajectory.token_ids[-1] if run.trajectory.token_ids else None
        if run.add_context(self.agent.message_tokens.ids(messages, last)):
            self.ready.append(run)
        else:
            run.trajectory.stats.truncated = True


def trajectory_metrics(stats: list[TrajectoryStats]) -> dict[str, float]:
    """``rollout/*`` of a batch: turns and tool calls per trajectory, the fraction of tool calls
    that failed or were cut, their mean latency, and the fraction of trajectories truncated."""
    count, calls = max(len(stats), 1), sum(s.tool_calls for s in stats)
    return {"rollout/turns/mean": sum(s.turns for s in stats) / count,
            "rollout/tool_calls/mean": calls / count,
            "rollout/tool_errors/fraction": sum(s.tool_errors for s in stats) / max(calls, 1),
            "rollout/tool_truncated/fraction": sum(s.tool_truncated for s in stats) / max(calls, 1),
            "rollout/tool_latency_s/mean": sum(s.tool_latency_s for s in stats) / max(calls, 1),
            "rollout/truncated/fraction": sum(s.truncated for s in stats) / count}
