"""SGLang-only behaviour on a real CPU server: distributed (gloo) weight updates, a rejected update
that must not hang, and supervision (start-up failure, a crash mid-request and the restart, no
leftover processes).

The tests share this pytest process's server (``shared_tiny_sglang``, each pushing the weights it
needs); the crash test kills a server (twice), so it starts its own.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import signal
import socket
import threading
import time

import pytest
import torch

from engine.rollout import SamplingParams, WeightUpdateError, sglang_server
from engine.rollout.sglang_forkserver import ForkedServerProcess
from engine.rollout.base import RolloutServerDied
from engine.config import RolloutConfig
from engine.rollout.sglang_server import (SGLangServer, SGLangServerConfig, SGLangServerCrashed, WaitReport,
                                          live_processes_in_group)
from tests.rollout_support import PROMPTS, SGLANG_MARKS, start_cpu_sglang, random_llama, reference_log_probs, teacher_forced_logits

pytestmark = SGLANG_MARKS


@pytest.fixture
def tiny(shared_tiny_sglang):
    return shared_tiny_sglang.tiny


@pytest.fixture
def engine(shared_tiny_sglang):
    return shared_tiny_sglang.serve_tiny_weights()


def assert_serves(engine, model):
    """Greedy tokens and log-probs of the engine equal a float64 HF forward of ``model``."""
    for prompt, (sample,) in zip(PROMPTS, engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))):
        assert sample.token_ids == teacher_forced_logits(model, prompt, sample.token_ids).argmax(dim=-1).tolist()
        expected = reference_log_probs(model, prompt, sample.token_ids, 0.0)
        assert torch.allclose(torch.tensor(sample.log_probs, dtype=torch.float64), expected, atol=1e-5, rtol=0)


def test_gloo_distributed_update_serves_the_new_weights(engine, tiny):
    new_model = random_llama(seed=2, eos_token_id=tiny.model.config.eos_token_id)
    engine.weight_transport = "distributed"
    stats = engine.update_weights(new_model.state_dict().items(), bucket_megabytes=0.05)
    assert stats.num_buckets > 3
    assert_serves(engine, new_model)
    # The transport may change between sessions: go back to the original weights by tensor push.
    engine.weight_transport = "tensor"
    engine.update_weights(tiny.model.state_dict().items(), bucket_megabytes=1.0)
    assert_serves(engine, tiny.model)


def test_a_generation_paused_for_a_push_continues_with_the_new_weights_token_by_token(engine, tiny):
    """Partial rollouts (``rollout.partial_rollout``): generations paused in place, the weights pushed
    and named version 2, then continued. Each response's tokens carry the version that sampled them:
    version 1 up to the push, 2 after; its log-probs are the old model's (float64) before the push
    and, after it, the new model's continuing from the KV cache the old one computed, which is what
    the engine sampled from. TIS (``algorithm.rollout_correction``) on such a batch weighs each token
    by exactly its own behaviour log-prob: the corrected loss equals a float64 reference."""
    from dataclasses import replace

    from engine.algo.losses import LossScale, compute_policy_loss
    from engine.config import ActorConfig, AlgorithmConfig
    from engine.config.algorithm import RolloutCorrectionConfig
    from engine.roles import RolloutBatch
    from engine.trainer.ppo_trainer import _corrected_for_the_rollout_policy

    new_model = random_llama(seed=2, eos_token_id=tiny.model.config.eos_token_id)
    prompts, length = [[5, 6, 7], [8, 9, 10, 11]] * 8, 400
    out = {}
    engine.set_weight_version(1)
    thread = threading.Thread(target=lambda: out.setdefault("samples", engine.generate(
        prompts, SamplingParams(max_new_tokens=length, ignore_eos=True, temperature=1.0))))
    thread.start()
    time.sleep(0.6)  # measured: ~170 tokens by then
    try:
        engine.pause_generation("in_place")
        engine.weight_transport = "distributed"
        engine.update_weights(new_model.state_dict().items(), bucket_megabytes=1.0)
        engine.set_weight_version(2)
        engine.continue_generation()
        thread.join(timeout=300)
    finally:
        engine.weight_transport = "tensor"
        engine.update_weights(tiny.model.state_dict().items(), bucket_megabytes=1.0)
    old, new = copy.deepcopy(tiny.model).double().eval(), new_model.double().eval()
    rows = out["samples"][:4]
    behaviour, trainer = torch.zeros(4, length, dtype=torch.float64), torch.zeros(4, length, dtype=torch.float64)
    for row, (prompt, (sample,)) in enumerate(zip(prompts, rows)):
        versions, p = sample.policy_versions, len(prompt)
        boundary = versions.index(2)
        assert 0 < boundary < length and versions == [1] * boundary + [2] * (length - boundary)
        tokens = torch.tensor([prompt + sample.token_ids])
        with torch.no_grad():
            before = torch.log_softmax(old(tokens).logits[0], -1)
            cache = old(tokens[:, :p + boundary - 1], use_cache=True).past_key_values
            after = torch.log_softmax(new(tokens[:, p + boundary - 1:], past_key_values=cache).logits[0], -1)
            fresh = torch.log_softmax(new(tokens).logits[0], -1)  # the trainer's recomputation, new weights
        reference = [before[p - 1 + i, t] for i, t in enumerate(sample.token_ids[:boundary])]
        reference += [after[i, t] for i, t in enumerate(sample.token_ids[boundary:])]
        behaviour[row] = torch.tensor(sample.log_probs, dtype=torch.float64)
        assert torch.allclose(behaviour[row], torch.stack(reference), atol=1e-5, rtol=0)
        trainer[row] = torch.stack([fresh[p - 1 + i, t] for i, t in enumerate(sample.token_ids)])
    mask = torch.ones(4, length)
    advantages = torch.randn(4, length, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batch = RolloutBatch(torch.zeros(4, length + 1, dtype=torch.long), torch.ones(4, length + 1, dtype=torch.long), mask,
                         old_log_probs=trainer.float(), advantages=advantages.float(), rollout_log_probs=behaviour.float())
    algorithm = AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0))
    corrected = _corrected_for_the_rollout_policy(batch, algorithm, {})
    loss = compute_policy_loss(corrected.old_log_probs, trainer.float(), corrected.advantages, corrected.response_mask,
                               ActorConfig(), LossScale.from_response_masks([mask])).loss
    weights = torch.exp(trainer - behaviour).clamp(max=2.0)  # float64: TIS of each token, ratio 1 at the first step
    assert (weights != 1).float().mean() > 0.5
    assert abs(loss.item() - float(-(weights * advantages).mean())) < 1e-5


def test_rejected_distributed_update_raises_instead_of_hanging(engine, tiny):
    new_model = random_llama(seed=3, eos_token_id=tiny.model.config.eos_token_id)
    engine.weight_transport = "distributed"
    engine.begin_weight_update()  # makes sure the group exists
    engine.end_weight_update()
    # Bypass the client-side session check (test-only: pokes private state) so the server itself
    # rejects /update_weights_from_distributed and never joins the broadcast.
    engine._in_weight_update, engine._session_transport = True, "distributed"
    started = time.monotonic()
    with pytest.raises(WeightUpdateError, match="begin_weight_update"):
        engine.push_weights(list(new_model.state_dict().items())[:2])
    assert time.monotonic() - started < 30
    engine._in_weight_update, engine._session_transport = False, None
    # The half-done group was dropped; the next distributed session builds a fresh one.
    engine.update_weights(new_model.state_dict().items(), bucket_megabytes=1.0)
    assert_serves(engine, new_model)
    engine.weight_transport = "tensor"
    engine.update_weights(tiny.model.state_dict().items(), bucket_megabytes=1.0)


def test_multi_turn_trajectories_are_token_exact_on_sglang(engine, tiny, monkeypatch):
    """Each turn a request of its own (``concurrent_requests``): the responses are the server's
    sampled ids interleaved with the template's tokens, the log-probs a float64 forward's."""
    from engine.rollout.agentic.trajectory import TrajectoryTask, generate_trajectories
    from tests.test_agentic_rollout import (MULTI_TURN_PROMPTS, MULTI_TURN_ROWS, STOPS, assert_token_exact,
                                            conversation_agent)

    calls, generate = [], engine.generate

    def recorded(prompts, params):
        samples = generate(prompts, params)
        calls.append(([list(p) for p in prompts], [s[0].token_ids for s in samples]))
        return samples

    monkeypatch.setattr(engine, "generate", recorded)
    agent = conversation_agent()
    tasks = [TrajectoryTask(p, r) for p, r in zip(MULTI_TURN_PROMPTS, MULTI_TURN_ROWS)]
    trajectories = generate_trajectories(engine, tasks, SamplingParams(max_new_tokens=60, temperature=1.0,
                                                                       stop_token_ids=STOPS), agent)
    assert all(len(given) == 1 for given, _ in calls) and len(calls) == 1 + 2 + 3
    assert_token_exact(trajectories, MULTI_TURN_PROMPTS, MULTI_TURN_ROWS, calls, agent, tiny.model)


def test_a_long_wait_on_servers_says_what_it_waits_for_and_for_how_long(capsys):
    now = [0.0]
    report = WaitReport(clock=lambda: now[0])
    for now[0] in (5, 9.9, 10, 12, 29, 31, 59, 61, 119, 125, 185, 400, 410):
        report.tick(lambda: "SGLang server X to start")
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[trident] waiting {s} s for SGLang server X to start" for s in (10, 31, 61, 125, 185, 400)]


def test_server_that_fails_to_start_is_reported_with_its_log(tiny, tmp_path):
    server = SGLangServer(
        SGLangServerConfig(model_path=str(tiny.path), log_path=tmp_path / "bad.log", extra_args=("--no-such-flag",),
                           rollout=RolloutConfig(startup_timeout_s=120))
    )
    server.start()
    with pytest.raises(SGLangServerCrashed, match="bad.log") as error:
        server.wait_until_ready()
    assert "no-such-flag" in str(error.value)


def _poll_until_ended(process) -> int:
    while process.poll() is None:
        time.sleep(0.001)
    return process.returncode


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def test_a_server_forked_from_the_forkserver_is_the_program_it_would_have_been(tiny, tmp_path, monkeypatch):
    """tests/conftest.py starts an SGLang forkserver per pytest process. A server forked from it has
    its own session, command line and environment (where ``ps`` and tools that find a job's processes
    by a variable look), serves, and its exit status comes back; a server whose environment differs
    in what SGLang's import read starts as a process of its own, and its log says why."""
    config = dict(model_path=str(tiny.path), rollout=RolloutConfig(name="sglang", gpu_memory_utilization=0.05,
                                                                     dtype="float32", startup_timeout_s=300))
    marker = f"TRIDENT_TEST_SERVER={os.getpid()}-{time.time()}"
    monkeypatch.setenv(*marker.split("="))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    forked = SGLangServer(SGLangServerConfig(log_path=tmp_path / "forked.log", **config))
    forked.start()
    try:
        forked.wait_until_ready()
        pid = forked.process.pid
        assert isinstance(forked.process, ForkedServerProcess), forked.log_path.read_text()[-2000:]
        assert _parent(pid) not in (os.getpid(), 1) and os.getsid(pid) == pid
        command = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        assert command.startswith(f"{forked.config.python_executable} -m {sglang_server.SERVER_MODULE} --model-path {tiny.path}")
        assert marker.encode() + b"\0" in open(f"/proc/{pid}/environ", "rb").read()
        assert "forked from the SGLang forkserver" in forked.log_path.read_text()
        assert forked.is_healthy()
        # An engine polls from several threads: every one of them sees the status of the kill.
        seen = []
        pollers = [threading.Thread(target=lambda: seen.append(_poll_until_ended(forked.process))) for _ in range(4)]
        for poller in pollers:
            poller.start()
        os.killpg(pid, signal.SIGKILL)
        for poller in pollers:
            poller.join(timeout=30)
        assert seen == [-9] * 4 and forked.process.returncode == -9
    finally:
        forked.stop()
    assert live_processes_in_group(pid) == []

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # read while SGLang imports transformers
    plain = SGLangServer(SGLangServerConfig(log_path=tmp_path / "plain.log", **config))
    plain.start()
    try:
        assert not isinstance(plain.process, ForkedServerProcess) and _parent(plain.process.pid) == os.getpid()
        log = plain.log_path.read_text()
        assert "[trident forkserver] started as a plain process" in log and "HF_HOME" in log, log[-2000:]
    finally:
        plain.stop()


def test_a_server_whose_ports_were_taken_starts_on_others(engine, tiny, tmp_path, monkeypatch):
    """The race of a port drawn free and taken before the server binds it, for both of its ports. Its
    ``--nccl-port`` is held by a listening socket (the server exits); its HTTP port by the worst
    taker, another SGLang server, which answers /health 200 there. The new server must take neither
    for a start; it starts again on fresh ports and serves from there."""
    taken = engine.servers[0].port
    holder = socket.create_server(("127.0.0.1", 0))
    held = holder.getsockname()[1]
    server = SGLangServer(SGLangServerConfig(model_path=str(tiny.path), log_path=tmp_path / "second.log",
                                             rollout=RolloutConfig(startup_timeout_s=300)))
    server.port = taken
    draws = iter([held])  # the first start's NCCL port
    real_draw = sglang_server.find_free_port
    monkeypatch.setattr(sglang_server, "find_free_port", lambda host: next(draws, None) or real_draw(host))
    try:
        server.start()
        first = server.process.pid
        server.wait_until_ready()
        assert not live_processes_in_group(first)  # the failed launches are gone
        assert server.port != taken and server.url.endswith(f":{server.port}")
        log = (tmp_path / "second.log").read_text()
        starts = log.split("[trident] ")[1:]
        assert len(starts) == 3
        assert f"--nccl-port {held} " in starts[0] and "address already in use" in starts[0]
        assert f"--port {taken} " in starts[1] and f"{taken}): address already in use" in starts[1]
        assert f"--port {server.port} " in starts[2] and "address already in use" not in starts[2]
        assert server._owns_port() and engine.servers[0]._owns_port()
        assert server.post("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
    finally:
        server.stop()
        holder.close()
    assert not live_processes_in_group(server.process.pid)
    assert engine.servers[0].is_healthy()  # the first server was left alone


def _kill_during_a_long_generation(engine) -> Exception | None:
    server = engine.servers[0]
    outcome = {}

    def long_generation():
        try:
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=480, ignore_eos=True))
        except Exception as error:  # noqa: BLE001 - the test inspects it
            outcome["error"] = error

    worker = threading.Thread(target=long_generation)
    worker.start()
    time.sleep(1.0)
    os.killpg(server.process.pid, signal.SIGKILL)
    worker.join(timeout=60)
    return outcome.get("error")


@pytest.fixture
def own_engine(tiny, tmp_path):
    """A server of the test's own, for a test that kills it."""
    rollout = start_cpu_sglang(tiny.path, tmp_path, rollout={"weight_update_timeout_s": 60})
    yield rollout
    rollout.shutdown()


def test_a_server_killed_mid_request_restarts_and_serves_the_weights_pushed_after(own_engine, tiny):
    """rollout.max_server_restarts (3 by default): the lost prompts are reported, the server starts
    again on its port, and once the current weights are pushed it serves them. With no restart left
    the crash stops the caller, naming the log, and no process is left."""
    engine = own_engine
    server = engine.servers[0]
    first, port = server.process.pid, server.port
    first_pool = server.first_pool_tokens
    assert first_pool == server.pool_tokens() > 0
    error = _kill_during_a_long_generation(engine)
    assert isinstance(error, RolloutServerDied), error
    assert len(error.completed) < len(PROMPTS) and f"prompts were lost with SGLang server(s) {server.url}" in str(error)
    assert str(server.log_path) in str(engine.dead[0]) and "last lines" in str(engine.dead[0])
    # The pool its first start sized, asked for again whatever the config or the free memory would
    # give now (issue 45, defect 3): here the config asks a quarter of it.
    server.config = dataclasses.replace(server.config, max_total_tokens=first_pool // 4)
    assert engine.restart_dead_servers() == 1 and engine.restarts == 1 and engine.dead == {}
    assert server.pool_tokens() == first_pool and server.first_pool_tokens == first_pool
    assert live_processes_in_group(first) == [] and server.process.pid != first and server.port == port
    newer = random_llama(seed=3, eos_token_id=tiny.model.config.eos_token_id)
    engine.update_weights(newer.state_dict().items())
    assert_serves(engine, newer)

    engine.max_restarts = 1  # actor_rollout_ref.rollout.max_server_restarts=1: used up
    error = _kill_during_a_long_generation(engine)
    assert isinstance(error, SGLangServerCrashed) and not isinstance(error, RolloutServerDied), error
    assert str(server.log_path) in str(error) and "max_server_restarts=1" in str(error)
    with pytest.raises(SGLangServerCrashed, match=str(server.log_path)):
        engine.health()
    engine.shutdown()
    assert live_processes_in_group(server.process.pid) == []
