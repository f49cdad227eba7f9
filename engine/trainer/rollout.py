"""The loop's rollout dataflow: prompts in, the generated global batch out on every rank (SPMD).

Colocated engines generate each generation replica's share where the training ranks are; servers
of their own (``rollout.mode=disaggregated``) are driven by rank 0 alone, for the global batch,
and can generate k batches ahead (``trainer.max_staleness=k``, as in NeMo-RL's and AReaL's
asynchronous modes): ``RolloutAhead.start`` sends a later batch's prompts to the servers in the
background and returns at once, the trainer trains on the current batch, and
``RolloutAhead.before_push`` waits for the servers to finish before the new weights are pushed or,
with partial rollouts (``rollout.partial_rollout``), pauses them in place so that the generations
go on with the new weights after the push, each token tagged with the version that sampled it.

Servers that die (``rollout.max_server_restarts``): the prompts they had not answered come back
as None; every rank then takes part in ``restart_dead_servers`` (the dead servers start again on
their GPUs and the current weights are pushed, into every server, as after a step) and the lost
prompts are sent again, until none is missing (slime retries a dead engine's requests on the
others and restarts it at the next weight update; here a replica's prompts belong to its ranks'
server, so it is restarted at once).

Policy versions: the weights step ``s`` trains from are version ``s`` (the initial or resumed
weights, then those pushed after step ``s - 1``; ``Rollout.wake_and_sync`` names them to the engine).
On-policy, step ``s`` trains on version ``s``'s samples; k steps off-policy, on version ``s - k``'s
(and, partial, later ones for the tokens sampled after a push); the first steps of a run or after
a resume have fewer in flight.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from engine.roles import RolloutBatch
from engine.roles.batch import SampleInfo
from engine.config import ExperimentConfig
from engine.rollout.agentic.trajectory import Agent, Trajectory, TrajectoryTask, generate_trajectories
from engine.rollout.base import CUDA_GRAPH, KV_CACHE, MEMORY_TAGS, WEIGHTS, RolloutEngine, SamplingParams
from engine.rollout.memory import hand_back_cache, record
from engine.sync import WeightSynchronizer
from engine.trainer.rollout_placement import start_colocated_engine, start_disaggregated_servers
from engine.trainer.run_dir import RunDirectory
from engine.trainer.console import say
from parallel.hybrid_engine import gather_generation_results, split_for_generation
from parallel.state import control_group


# The prompt rows' fields a rollout carries beside its tokens (the rewards', and an environment's, input).
# Keyed by the batch's names, with the name a row (``TrajectoryTask.row``) gives each.
ROW_KEYS = {"data_sources": "data_source", "ground_truths": "ground_truth", "extra_infos": "extra_info",
            "messages": "messages"}


@dataclasses.dataclass
class _Pending:
    """A generation under way: the global prompts on every rank, the engine's answer on the ranks
    that drive it (a future on rank 0 for servers of their own, the responses for colocated)."""

    merged: dict[str, list]
    local_uids: list[int]  # this data-parallel rank's prompts
    params: SamplingParams
    policy_version: int
    responses: Any = None
    future: concurrent.futures.Future | None = None


def _timed_generate(rollout: "Rollout", tasks: list[TrajectoryTask], params: SamplingParams) -> tuple[list, float]:
    """A trajectory per task (one turn, or many with ``rollout.multi_turn``), None for one lost with a
    server that died; and the seconds it took."""
    start = time.perf_counter()
    trajectories = generate_trajectories(rollout.engine, tasks, params, rollout.agent)
    return trajectories, time.perf_counter() - start


def _tasks(prompts: list, rows: dict[str, list]) -> list[TrajectoryTask]:
    """The prompts with their rows (what an environment's ``reset`` is given)."""
    return [TrajectoryTask(prompt, {name: rows[key][i] for key, name in ROW_KEYS.items()})
            for i, prompt in enumerate(prompts)]


def _restart_dead_servers(rollout: "Rollout", lost: bool = False) -> bool:
    """Collective: every rank's dead rollout servers start again and the current weights are pushed
    into every server. ``lost``: this rank lost prompts with them. Returns whether any rank
    restarted a server or lost prompts.

    A colocated server sizes its KV pool from the memory free when it starts (SGLang's
    ``kv_cache_configurator``): restarted beside the resident training state it would get a fraction
    of its first pool, or none (70B). So it restarts as it first started: every rank's training state
    off the device and its cache handed back first (slime restarts dead engines at the next weight
    update, after ``offload_train``: ``train.py``, ``slime/ray/rollout.py`` ``recover_updatable_engines``),
    asking for its first start's pool (``SGLangServer.restart``)."""
    dead = rollout.engine.dead_servers() if rollout.engine is not None else 0
    counts = torch.tensor([dead, int(lost)])
    dist.all_reduce(counts, group=control_group())
    if counts[0]:
        off_device = rollout.training_state_off_device() if not rollout.disaggregated else contextlib.nullcontext()
        with off_device:
            dist.barrier(group=control_group())  # every rank's memory is free before a server starts
            if rollout.engine is not None and rollout.engine.restart_dead_servers():
                record("restart_engine", servers=dead)
            dist.barrier(group=control_group())  # and stays free until every restart has sized its pool
        rollout.server_restarts += int(counts[0])
        if rollout.engine is not None:
            rollout.engine.servers_restarted()
        with rollout.actor.offloader.resident("params"):
            rollout.weight_sync.sync(rollout.engine)
        if rollout.engine is not None:
            rollout.engine.set_weight_version(rollout.weight_version)
        say(f"[trident] {int(counts[0])} rollout server(s) died and were restarted with the current weights "
            f"({rollout.server_restarts} restart(s) in this run; actor_rollout_ref.rollout.max_server_restarts)")
    return bool(counts.any())


def _generate_colocated(rollout: "Rollout", tasks: list[TrajectoryTask], params: SamplingParams) -> tuple[list, float]:
    """This rank's replica generates its prompts; collective (a server that died is restarted by its
    rank while the others wait, and every rank takes part in the weight push)."""
    responses, seconds = _timed_generate(rollout, tasks, params) if rollout.engine is not None else ([], 0.0)
    while _restart_dead_servers(rollout, lost=None in responses):
        lost = [i for i, response in enumerate(responses) if response is None]
        if lost:
            again, more = _timed_generate(rollout, [tasks[i] for i in lost], params)
            for i, response in zip(lost, again):
                responses[i] = response
            seconds += more
    return responses, seconds


def _in_background(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread: a trainer that fails must not wait at exit for a
    generation still in flight (an executor's threads are joined before the servers are stopped)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # handed to whoever takes the result
            future.set_exception(error)

    threading.Thread(target=run, daemon=True, name="rollout-ahead").start()
    return future


def _start(rollout: "Rollout", prompts, params: SamplingParams, policy_version: int, background: bool = False) -> _Pending:
    sync = rollout.weight_sync
    shard = {
        "prompts": prompts.raw_prompt_ids, "uids": prompts.prompt_uids.tolist(),
        "data_sources": prompts.data_sources, "ground_truths": prompts.ground_truths,
        "extra_infos": prompts.extra_infos, "messages": prompts.messages,
    }
    responses = None
    if not sync.disaggregated:
        mine = split_for_generation(_tasks(shard["prompts"], shard), sync.layout, dist.get_rank())
        record("generate", prompts=len(mine))  # a step's, a dynamic-sampling round's or validation's
        local, seconds = _generate_colocated(rollout, mine, params)
        shard["responses"] = gather_generation_results(local, sync.groups)  # this DP rank's prompts, in order
        responses = (None, seconds)
    shards: list = [None] * dist.get_world_size(rollout.data_parallel_control_group)
    dist.all_gather_object(shards, shard, group=rollout.data_parallel_control_group)
    merged = {key: [item for s in shards for item in s[key]] for key in shard}
    pending = _Pending(merged, shard["uids"], params, policy_version, responses)
    if sync.disaggregated and dist.get_rank() == 0:
        tasks = _tasks(merged["prompts"], merged)
        if background:
            record("generate_ahead", prompts=len(tasks))
            pending.future = _in_background(_timed_generate, rollout, tasks, params)
        else:
            pending.responses = _timed_generate(rollout, tasks, params)
    return pending


def _finish(rollout: "Rollout", pending: _Pending) -> RolloutBatch:
    merged = pending.merged
    answer = pending.future.result() if pending.future is not None else pending.responses
    if rollout.weight_sync.disaggregated:
        box = [answer]
        dist.broadcast_object_list(box, src=0, group=control_group())  # the others waited for rank 0's servers
        merged["responses"], seconds = box[0]
        while None in merged["responses"]:  # lost with a server that died: the same list on every rank
            _restart_dead_servers(rollout)
            lost = [i for i, response in enumerate(merged["responses"]) if response is None]
            box = [_timed_generate(rollout, [_tasks(merged["prompts"], merged)[i] for i in lost], pending.params)
                   if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0, group=control_group())
            for i, response in zip(lost, box[0][0]):
                merged["responses"][i] = response
            seconds += box[0][1]
    else:
        seconds = answer[1]
    batch = to_rollout_batch(merged["prompts"], merged["responses"], pending.params.max_new_tokens,
                             rollout.pad_id)
    samples = [SampleInfo(*(merged[key][i] for key in ROW_KEYS), trajectory.stats)
               for i, trajectory in enumerate(merged["responses"])]
    return dataclasses.replace(batch, uids=torch.as_tensor(merged["uids"], dtype=torch.long), samples=samples,
                               policy_version=pending.policy_version, generation_s=seconds)


class RolloutAhead:
    """Up to ``depth`` batches generating in the background on servers of their own
    (``trainer.max_staleness``), oldest first. Before a weight push the servers must not generate
    with half-pushed weights: ``before_push`` waits for the batches in flight to finish or, with
    ``partial`` (``rollout.partial_rollout``), pauses them in place; ``after_push`` lets them go on
    with the new weights."""

    def __init__(self, depth: int = 0, partial: bool = False) -> None:
        self._pending: collections.deque[_Pending] = collections.deque()
        self.depth, self.partial = depth, partial
        self._paused = False

    def take(self, rollout: Rollout, prompts, params: SamplingParams, policy_version: int) -> RolloutBatch:
        """The rollout of ``prompts``: the oldest one generating in the background, else generated now."""
        if not self._pending:
            return _finish(rollout, _start(rollout, prompts, params, policy_version))
        pending = self._pending.popleft()
        if pending.local_uids != prompts.prompt_uids.tolist():
            raise RuntimeError("the rollout generated ahead is not the batch the loop trains on next")
        return _finish(rollout, pending)

    def start(self, rollout: Rollout, prompts, params: SamplingParams, policy_version: int) -> None:
        """Send ``prompts`` to the servers and return; collective (the prompts are gathered)."""
        if len(self._pending) >= self.depth:
            raise RuntimeError(f"{len(self._pending)} rollouts are already generating ahead "
                               f"(trainer.max_staleness={self.depth})")
        self._pending.append(_start(rollout, prompts, params, policy_version, background=True))

    def before_push(self, rollout: Rollout) -> float:
        """Make the servers idle for a weight push: wait for the batches in flight (the seconds
        waited; 0 off rank 0 or with nothing in flight) or, partial, pause them in place (0). How
        they became idle goes to the memory record (the push must follow it)."""
        futures = [p.future for p in self._pending if p.future is not None]
        if not futures:
            return 0.0
        running = [future for future in futures if not future.done()]
        waited = 0.0
        if running and self.partial:
            rollout.engine.pause_generation("in_place")  # requests keep their KV cache and wait
            self._paused = True
        elif running:
            start = time.perf_counter()
            concurrent.futures.wait(running)
            waited = time.perf_counter() - start
        record("servers_idle_for_push", how="paused" if self._paused else "waited" if running else "finished")
        return waited

    def after_push(self, rollout: Rollout) -> None:
        """The generations paused for the push continue, with the new weights."""
        if self._paused:
            rollout.engine.continue_generation()
            self._paused = False
            record("continue_generation")


class Rollout:
    """The rollout side of the PPO loop, one object: where the engine runs (placement,
    ``engine.trainer.rollout_placement``), what it holds between phases (``sleep`` gives a colocated
    engine's memory to training, ``wake_and_sync`` takes it back in the order SGLang needs and pushes
    the actor's weights), the version of the weights it serves, the batches generating ahead
    (``trainer.max_staleness``), the servers that died and restarted, and the multi-turn agent. The
    loop reads as slime's: ``next_batch``, ``sleep``, train, ``wake_and_sync``."""

    def __init__(self, cfg: ExperimentConfig, run: RunDirectory, agent: Agent | None, pad_id: int,
                 data_parallel_control_group: Any) -> None:
        """Collective. A colocated engine starts now, on each generation replica's leader, before any
        training model exists, and releases its memory (``engine.rollout.memory``)."""
        arr = cfg.actor_rollout_ref
        self.cfg, self.run, self.agent, self.pad_id = cfg, run, agent, pad_id
        self.data_parallel_control_group = data_parallel_control_group  # the data-parallel ranks on gloo
        self.disaggregated = arr.rollout.mode == "disaggregated"
        self.sync_target = "stage" if self.disaggregated else (
            "sharded" if arr.rollout.name == "sglang" and arr.rollout.weight_sync_target == "sharded" else "full")
        self.ahead = RolloutAhead(cfg.trainer.max_staleness, partial=arr.rollout.partial_rollout)
        self.server_restarts = 0  # every rank's, in this run (rollout.max_server_restarts)
        self.weight_version = 0  # of the weights the engine serves: the step that trains from them
        self.actor: Any = None
        self.training_state_off_device: Callable[[], ContextManager] | None = None
        self.weight_sync: WeightSynchronizer | None = None
        # Colocated: on generation-replica leaders. Disaggregated: the servers' owner on rank 0 (it also
        # generates), and a weight-push handle on each pipeline stage's sender.
        self.engine: RolloutEngine | None = None
        if not self.disaggregated:
            self.engine = start_colocated_engine(cfg, run, WeightSynchronizer.hybrid_layout(
                arr.actor.megatron, arr.rollout, self.sync_target))

    def connect(self, actor: Any, training_state_off_device: Callable[[], ContextManager]) -> None:
        """The weight sync from ``actor``'s model into the engine; servers of their own start now
        (each pipeline stage's sender attaches to them). ``training_state_off_device``: a block with
        every model of this rank on the host (a dead server restarts inside it). Collective."""
        arr = self.cfg.actor_rollout_ref
        self.actor = actor
        self.training_state_off_device = training_state_off_device
        self.weight_sync = WeightSynchronizer(actor.model_chunks, arr.actor.megatron, arr.rollout, target=self.sync_target)
        if self.weight_sync.fallback_reason:
            say(f"[trident] weight sync: full tensors on every generation GPU, not each GPU's shard "
                f"(actor_rollout_ref.rollout.weight_sync_target=sharded): {self.weight_sync.fallback_reason}")
        if self.disaggregated:
            self.engine = start_disaggregated_servers(self.cfg, self.run, self.weight_sync.pushes_weights)

    def generate(self, prompts, params: SamplingParams, policy_version: int = 0) -> RolloutBatch:
        """Generate ``prompts`` (this data-parallel rank's ``PromptBatch``) now; collective."""
        return _finish(self, _start(self, prompts, params, policy_version))

    def next_batch(self, prompts, upcoming, params: SamplingParams, n: int, step: int) -> RolloutBatch:
        """The rollout of ``prompts`` (``n`` samples each): the oldest batch generating ahead, else
        generated now; ``upcoming`` batches start generating with the weights of ``step``."""
        generated = self.ahead.take(self, prompts.repeat_interleave(n), params, policy_version=step)
        for later in upcoming:
            self.ahead.start(self, later.repeat_interleave(n), params, policy_version=step)
        return generated

    def sleep(self) -> None:
        """A colocated engine releases its weights, KV cache and CUDA graphs for the training phases
        (servers of their own keep theirs)."""
        self._memory("release", MEMORY_TAGS)

    def wake_and_sync(self, version: int) -> tuple[Any, float]:
        """The actor's weights into the engine, as policy ``version`` (the step that trains from
        them), in the order colocated memory allows: every rank hands its cached memory back, the
        engine takes its weights' memory back, the push (the cache handed back after each bucket),
        then the engine's KV cache and CUDA graphs. Servers generating ahead are first made idle
        (waited for, or paused with partial rollouts) and go on after. Collective. Returns the
        sync's report and the seconds waited for the servers."""
        waited = self.ahead.before_push(self)
        hand_back_cache("before the engine resumes")
        self._memory("resume", (WEIGHTS,))
        with self.actor.offloader.resident("params"):
            report = self.weight_sync.sync(self.engine)
        self.weight_version = version
        if self.engine is not None:
            self.engine.set_weight_version(version)  # the tokens sampled from now on carry it
        self._memory("resume", (KV_CACHE, CUDA_GRAPH))
        _restart_dead_servers(self)  # a server found dead by these calls starts again (resident) and gets the weights
        self.ahead.after_push(self)
        return report, waited

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    def _memory(self, action: str, tags) -> None:
        if self.engine is not None and not self.disaggregated:
            getattr(self.engine, f"{action}_memory")(tags)
            record(action, tags=list(tags))


def token_versions(responses: list[Trajectory], response_length: int) -> torch.Tensor | None:
    """``[B, response_length]`` the weight version of each response token (-1 on padding and on
    appended messages), or None where the engine did not tag every response."""
    if any(t.policy_versions is None for t in responses):
        return None
    out = torch.full((len(responses), response_length), -1, dtype=torch.long)
    for row, trajectory in enumerate(responses):
        out[row, :len(trajectory.policy_versions)] = torch.as_tensor(trajectory.policy_versions, dtype=torch.long)
    return out


def to_rollout_batch(prompts, responses: list[Trajectory], response_length: int, pad_id: int) -> RolloutBatch:
    """Left-padded prompts and right-padded responses as one ``RolloutBatch`` whose response mask is
    the trajectories' loss mask (0 on appended messages), with the engine's log-probs in the
    response layout (0 off the loss mask), its token versions and the experts each token was routed
    to, where the engine reported them."""
    prompt_length = max(len(p) for p in prompts)
    rows = len(prompts)
    input_ids = torch.full((rows, prompt_length + response_length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    response_mask = torch.zeros(rows, response_length)
    rollout_log_probs = torch.zeros(rows, response_length)
    routed_experts = None
    reported = next((t.routed_experts for t in responses if t.routed_experts is not None), None)
    if reported is not None:
        routed_experts = torch.full((*input_ids.shape, *reported.shape[1:]), -1, dtype=torch.int16)
    for i, (prompt, trajectory) in enumerate(zip(prompts, responses)):
        start, tokens = prompt_length - len(prompt), trajectory.token_ids
        input_ids[i, start:prompt_length] = torch.as_tensor(prompt)
        attention_mask[i, start:prompt_length + len(tokens)] = 1
        input_ids[i, prompt_length:prompt_length + len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        response_mask[i, :len(tokens)] = torch.as_tensor(trajectory.loss_mask, dtype=response_mask.dtype)
        rollout_log_probs[i, :len(tokens)] = torch.as_tensor(trajectory.log_probs)
        if trajectory.routed_experts is not None:
            routed_experts[i, start:start + len(trajectory.routed_experts)] = trajectory.routed_experts
    return RolloutBatch(input_ids, attention_mask, response_mask, routed_experts=routed_experts,
                        rollout_log_probs=rollout_log_probs, token_versions=token_versions(responses, response_length))
