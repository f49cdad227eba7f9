"""Disaggregated rollout on CPU: 2 trainer ranks and a real SGLang server outside their world.

The server is started by rank 0 and gets the weights of each pipeline stage from that stage's
sender over a gloo broadcast group (``update_weights_from_distributed``); the log-prob check
compares what the server samples with the trainer's recomputation every step, so a weight that
did not arrive (or arrived in the wrong place) fails the run.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from engine.rollout.sglang_server import SERVER_MODULE
from engine.sync import expected_log_prob_gap
from parallel.state import find_free_port
from tests.distributed import REPO_ROOT, processes_left, read_metrics, run_main_job
from tests.rollout_support import SGLANG_MARKS

pytestmark = [pytest.mark.dist, *SGLANG_MARKS]

SGLANG = ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.gpu_memory_utilization=0.05",
          "actor_rollout_ref.rollout.check_weight_sync=true", "trainer.test_freq=-1", "trainer.val_before_train=false",
          "trainer.save_freq=-1", "trainer.export_hf_at_end=false"]
DISAGGREGATED = [*SGLANG, "actor_rollout_ref.rollout.mode=disaggregated", "actor_rollout_ref.rollout.num_gpus=1"]


def test_pipeline_stages_push_their_own_weights_to_a_server_of_its_own(demo_model, tmp_path):
    # Greedy, so the colocated run of the same seeds generates the same responses.
    common = ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
              "critic.megatron.pipeline_model_parallel_size=2", "actor_rollout_ref.rollout.do_sample=false",
              "trainer.total_training_steps=3"]
    run_dir, colocated_dir = tmp_path / "run", tmp_path / "colocated"
    run_main_job("yaml/demo_cpu.yaml", [*DISAGGREGATED, *common, f"trainer.default_local_dir={run_dir}"])
    # One colocated rank: the same batches and updates (PP2 and PP1 differ only by fp32 round-off),
    # and a single server on the two CPU cores.
    run_main_job("yaml/demo_cpu.yaml", [*SGLANG, *common[2:], "trainer.n_gpus_per_node=1",
                                        f"trainer.default_local_dir={colocated_dir}"], nproc=1)
    rows, colocated = read_metrics(run_dir), read_metrics(colocated_dir)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row, same in zip(rows, colocated):
        # the check passed (it raises otherwise); the gap is fp32 round-off
        assert row["rollout/log_prob_abs_diff"] < expected_log_prob_gap("float32"), row
        # on-policy (max_staleness=0), servers of their own train exactly like colocated engines
        assert row["rollout/policy_version"] == row["step"] and row["rollout/staleness/max"] == 0
        assert row["response_length/mean"] == same["response_length/mean"]
        assert row["critic/score/mean"] == same["critic/score/mean"]
        # the same samples give the same losses up to PP2-vs-PP1 round-off, which the updates compound
        # (measured: 2e-7 relative at step 1, 6e-4 at step 3)
        rel, tolerance = (1e-5, 1e-8) if row["step"] == 1 else (2e-2, 1e-5)
        for key in ("actor/pg_loss", "actor/ppo_kl", "critic/vf_loss", "actor/grad_norm"):
            assert row[key] == pytest.approx(same[key], rel=rel, abs=tolerance), (row["step"], key)
    logs = list((run_dir / "rollout").glob("sglang_replica*.log"))
    assert len(logs) == 1, logs  # one server, started by rank 0; the stage-1 sender only attached
    log = logs[0].read_text()
    # Each stage's sender has its own broadcast group and pushes one bucket (the demo model is
    # far below the bucket size) at the start and after every step.
    groups = set(re.findall(r"group_name=(trident_weight_update_\w+)", log))
    assert len(groups) == 2, groups
    assert log.count('"POST /update_weights_from_distributed HTTP/1.1" 200') == 2 * (1 + len(rows))


def server_pids(log_text: str) -> list[int]:
    """Pids of the SGLang launcher whose command line the log's first line records."""
    port = log_text.split("--port ", 1)[1].split()[0]
    pids = []
    for folder in os.scandir("/proc"):
        if folder.name.isdigit():
            try:
                command = open(f"/proc/{folder.name}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if SERVER_MODULE in command and f"--port {port} " in command:
                pids.append(int(folder.name))
    return pids


def test_a_server_of_its_own_killed_mid_run_restarts_then_stops_the_job_past_the_limit(demo_model, tmp_path):
    """rollout.max_server_restarts=1: rank 0's server is killed once, restarts with the current
    weights (steps go on, each passing the weight-sync check over the new broadcast group); killed
    again, it stops the job with the server, its log and the limit named."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    job = subprocess.Popen(
        [sys.executable, "-m", "launch.torchrun", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={find_free_port()}", "-m", "launch.main", "yaml/demo_cpu.yaml", *DISAGGREGATED,
         f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=50",
         "actor_rollout_ref.rollout.max_server_restarts=1",
         "actor_rollout_ref.rollout.request_timeout_s=60", "actor_rollout_ref.rollout.weight_update_timeout_s=60"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_for(condition):
        deadline = time.monotonic() + 600
        while not condition():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-4000:]
            time.sleep(0.2)

    def kill_the_server():
        pids = server_pids(log.read_text().rsplit("\n[trident] ", 1)[-1])  # its latest start
        assert pids, log.read_text()[-2000:]
        for pid in pids:
            os.killpg(os.getpgid(pid), signal.SIGKILL)

    try:
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() and read_metrics(run_dir))
        log = next((run_dir / "rollout").glob("sglang_replica*.log"))
        kill_the_server()
        wait_for(lambda: any(row["rollout/server_restarts"] == 1 for row in read_metrics(run_dir)[-1:]))
        wait_for(lambda: len([row for row in read_metrics(run_dir) if row["rollout/server_restarts"] == 1]) >= 2)
        killed = time.monotonic()
        kill_the_server()
        output = job.communicate(timeout=300)[0]
        elapsed = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    # The owner sees its server's process exit; the error names the server, its log and the limit.
    assert "[trident] error (rank 0): SGLang server" in output and f"exited with code -9; log {log}" in output, \
        output[-6000:]
    assert "max_server_restarts=1" in output
    assert elapsed < 60, elapsed  # within the request timeout (measured: ~3 s)


def test_one_step_off_policy_trains_on_the_previous_weights_samples(demo_model, tmp_path):
    run_dir = tmp_path / "run"
    # No weight check: the samples come from the weights before the last push (refused with it).
    run_main_job("yaml/demo_cpu.yaml", [
        *(o for o in DISAGGREGATED if "check_weight_sync" not in o), "trainer.max_staleness=1",
        f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=4",
        "algorithm.rollout_correction.rollout_is=token"])
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    # Step 1 has nothing generated ahead; from then on, step k trains on step k - 1's weights' samples.
    assert [row["rollout/policy_version"] for row in rows] == [1, 1, 2, 3]
    assert [row["rollout/staleness/max"] for row in rows] == [row["rollout/staleness/mean"] for row in rows] == [0, 1, 1, 1]
    assert all(row["rollout/partial/fraction"] == 0 for row in rows)  # each batch waited for before the push
    assert all(row["perf/rollout_generation_s"] > 0 for row in rows)
    # The correction sees it: the same weights (step 1, fp32) differ by round-off only, one update
    # apart they differ by about the update's own KL.
    assert rows[0]["rollout_corr/kl_k3"] < 1e-9
    assert all(row["rollout_corr/kl_k3"] > 1e-5 for row in rows[1:]), [row["rollout_corr/kl_k3"] for row in rows]


def test_two_steps_off_policy_with_partial_rollouts_learns(demo_model, tmp_path):
    """``trainer.max_staleness=2`` with partial rollouts: two batches generate ahead, so from step 3
    each step trains on samples of the weights two steps back (no token older, some newer where a
    generation went on after a push), corrected by TIS; and the policy learns. Measured (40 steps,
    seed 1, validation every 10): 0.405 -> 0.465, 0.475, 0.495, 0.515; the sampled score 0.25 at
    step 1, 0.43 over steps 31-40. The demo's responses end within 5 tokens, so pushes seldom catch
    one generating (``rollout/partial/fraction`` is 0 here; ``tests/test_rollout_sglang.py`` pauses
    one mid-generation, and ``benchmarks.async_rollout --workload long_tail`` measures it)."""
    run_dir = tmp_path / "run"
    run_main_job("yaml/demo_cpu.yaml", [
        *(o for o in DISAGGREGATED if o not in ("actor_rollout_ref.rollout.check_weight_sync=true", "trainer.test_freq=-1",
                                                "trainer.val_before_train=false")),
        "trainer.max_staleness=2", "actor_rollout_ref.rollout.partial_rollout=true", "trainer.test_freq=10",
        "algorithm.rollout_correction.rollout_is=token", f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=20"])
    rows = read_metrics(run_dir)
    steps = [row for row in rows if "timing_s/step" in row]
    assert [row["rollout/policy_version"] for row in steps] == [1, 1, 1] + list(range(2, 19))
    assert [row["rollout/staleness/max"] for row in steps] == [0, 1] + [2] * 18
    assert all(row["rollout/staleness/mean"] <= row["rollout/staleness/max"] for row in steps)
    assert all(0 <= row["rollout/partial/fraction"] <= 1 for row in steps)
    accuracy = [row["val/accuracy"] for row in rows if "val/accuracy" in row]
    assert len(accuracy) == 3 and max(accuracy[1:]) - accuracy[0] >= 0.03, accuracy
    _check_no_push_reached_servers_generating_ahead(run_dir)


def _check_no_push_reached_servers_generating_ahead(run_dir) -> None:
    """The memory record of every rank holds the invariants (``tests/memory_events.py``); on rank 0,
    which owns the servers, every push after batches were sent ahead waited for them to be idle
    (finished, waited for, or paused in place and continued after the push)."""
    from engine.rollout.memory import read_events
    from tests.memory_events import check_invariants

    for rank in (0, 1):
        events = read_events(run_dir / "logs" / f"rank_{rank:05d}.log")
        check_invariants(events)
        names = [event["event"] for event in events]
        if rank == 0:
            assert names.count("generate_ahead") >= 18 and names.count("servers_idle_for_push") >= 18, names
            idle = [event["how"] for event in events if event["event"] == "servers_idle_for_push"]
            assert names.count("continue_generation") == idle.count("paused"), idle


def test_servers_on_a_node_of_their_own_serve_only_the_jobs_key(demo_model, tmp_path):
    """launch.rollout_servers as a rollout node runs it: a server on this machine's network address
    (not loopback), requiring a key that appears in no log, file or command line; trainers attach to
    it by address and push their weights over the network."""
    import secrets

    import requests

    key = secrets.token_hex(16)
    addresses_file, run_dir = tmp_path / "servers" / "addresses", tmp_path / "run"
    addresses_file.parent.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    servers = subprocess.Popen(
        [sys.executable, "-m", "launch.rollout_servers", "yaml/demo_cpu.yaml", *SGLANG, "--servers", "1",
         "--address-file", str(addresses_file)],
        cwd=REPO_ROOT, env={**env, "TRIDENT_ROLLOUT_API_KEY": key}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)

    def trainers(api_key: str, steps: int, run_dir=run_dir) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "launch.torchrun", "--nproc_per_node=2", "--master_addr=127.0.0.1",
             f"--master_port={find_free_port()}", "-m", "launch.main", "yaml/demo_cpu.yaml", *SGLANG,
             "actor_rollout_ref.rollout.mode=disaggregated", f"actor_rollout_ref.rollout.server_addresses=[{address}]",
             f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={run_dir}",
             "actor_rollout_ref.rollout.request_timeout_s=60", "actor_rollout_ref.rollout.weight_update_timeout_s=60"],
            cwd=REPO_ROOT, env={**env, "TRIDENT_ROLLOUT_API_KEY": api_key}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)

    try:
        deadline = time.monotonic() + 300
        while not addresses_file.exists():
            assert servers.poll() is None and time.monotonic() < deadline, servers.communicate()[0][-4000:]
            time.sleep(1)
        address = addresses_file.read_text().split()[0]
        assert not address.startswith("127."), address  # reachable from other nodes
        generate = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
        assert requests.post(f"http://{address}/generate", json=generate, timeout=30).status_code == 401
        headers = {"Authorization": f"Bearer {key}"}
        assert requests.post(f"http://{address}/generate", json=generate, headers=headers, timeout=30).status_code == 200

        wrong = trainers("not-the-key", steps=2)
        output = wrong.communicate(timeout=300)[0]
        assert wrong.returncode != 0 and "refuses this job's API key (HTTP 401)" in output, output[-4000:]

        good = trainers(key, steps=2)
        output = good.communicate(timeout=600)[0]
        assert good.returncode == 0, output[-6000:]
        rows = read_metrics(run_dir)
        assert [row["step"] for row in rows] == [1, 2]
        for row in rows:  # the server samples with the weights the trainers broadcast to it
            assert row["rollout/log_prob_abs_diff"] < expected_log_prob_gap("float32"), row
        log = (addresses_file.parent / "sglang_server0.log").read_text()
        assert log.count('"POST /update_weights_from_distributed HTTP/1.1" 200') == 1 + len(rows)
        assert "'api_key': '<redacted>'" in log
        # The key is in no log, run file, output or command line of this machine.
        files = [path for folder in (run_dir, addresses_file.parent) for path in folder.rglob("*") if path.is_file()]
        assert not [path for path in files if key.encode() in path.read_bytes()]
        assert key not in output
        for folder in os.scandir("/proc"):
            if folder.name.isdigit():
                try:
                    assert key.encode() not in open(f"/proc/{folder.name}/cmdline", "rb").read()
                except OSError:
                    continue

        # The servers go away mid-run (their node is lost: the launcher and, through its reaper,
        # its servers): the trainers stop with a clear error.
        lost_dir = tmp_path / "lost"
        job = trainers(key, steps=50, run_dir=lost_dir)
        while not (lost_dir / "metrics.jsonl").exists() or len(read_metrics(lost_dir)) < 2:
            assert job.poll() is None, job.communicate()[0][-4000:]
            time.sleep(0.5)
        lost = time.monotonic()
        os.killpg(servers.pid, signal.SIGKILL)
        output = job.communicate(timeout=300)[0]
        assert job.returncode != 0 and f"SGLang server http://{address}" in output, output[-6000:]
        assert time.monotonic() - lost < 60  # within the request timeout
    finally:
        if servers.poll() is None:
            os.killpg(servers.pid, signal.SIGTERM)
            servers.wait(timeout=60)


def test_a_colocated_server_killed_mid_run_is_restarted_and_the_run_finishes(demo_model, tmp_path):
    """Rank 1's colocated SGLang server is SIGKILLed after step 2: it starts again, gets the current
    weights (the weight-sync check of every later step compares its log-probs with the trainer's:
    a server serving its start-up weights fails it), the prompts it lost are sent again, and the run
    logs all its steps with rollout/server_restarts = 1. Nothing of the job is left running."""
    import uuid

    run_dir = tmp_path / "run"
    marker = f"TRIDENT_TEST_JOB={uuid.uuid4().hex}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", marker.split("=")[0]: marker.split("=")[1]}
    job = subprocess.Popen(
        [sys.executable, "-m", "launch.torchrun", "--nproc_per_node=2", "--master_addr=127.0.0.1",
         f"--master_port={find_free_port()}", "-m", "launch.main", "yaml/demo_cpu.yaml", *SGLANG,
         f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=8"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "metrics.jsonl").exists() or len(read_metrics(run_dir)) < 2:
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-4000:]
            time.sleep(0.2)
        log = run_dir / "rollout" / "sglang_replica1.log"
        pids = server_pids(log.read_text())
        assert pids, log.read_text()[:2000]
        for pid in pids:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        output = job.communicate(timeout=600)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-6000:]
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert rows[-1]["rollout/server_restarts"] == 1 and rows[0]["rollout/server_restarts"] == 0
    assert "[trident] 1 rollout server(s) died and were restarted with the current weights" in output
    # the restarted server's second start is in its log, on the same port
    starts = [line for line in log.read_text().splitlines() if line.startswith("[trident] ")]
    assert len(starts) == 2 and starts[0].split("--port ")[1].split()[0] == starts[1].split("--port ")[1].split()[0]
    assert "SGLang server" in (run_dir / "logs" / "rank_00001.log").read_text()
    assert processes_left(marker) == {}
    _check_restart_found_the_first_starts_memory(run_dir, log)


def _check_restart_found_the_first_starts_memory(run_dir, server_log) -> None:
    """Issue 45, defect 3 (``engine/rollout/sglang_engine.py`` ``restart_dead_servers``, then at
    :652-668, restarting beside the resident training state with only the leader's cache handed
    back): every rank took its whole training state off the device and handed its cache back before
    the server restarted, and brought it back only after; the restarted server asked for the pool its
    first start had (``--max-total-tokens`` = the first start's ``max_total_num_tokens``) and got it."""
    from engine.rollout.memory import read_events
    from tests.memory_events import check_invariants

    events = {rank: read_events(run_dir / "logs" / f"rank_{rank:05d}.log") for rank in (0, 1)}
    for rank, ranks_events in events.items():
        check_invariants(ranks_events)
        names = [event["event"] for event in ranks_events]
        assert names.count("training_state_off_device") == names.count("training_state_back") == 1, names
        off = names.index("training_state_off_device")
        assert names[off - 1] == "hand_back_cache" and ranks_events[off - 1]["reason"] == "training state off the device"
        assert all(parts == [] for parts in ranks_events[off]["resident"].values()), ranks_events[off]
        assert set(ranks_events[off]["resident"]) == {"actor", "reference", "critic"}  # all of them off
        restarting = names[off + 1:names.index("training_state_back")]
        assert restarting == (["restart_engine"] if rank == 1 else []), (rank, names)
    text = server_log.read_text()
    pools = [int(part.split()[0].rstrip(",")) for part in text.split("max_total_num_tokens=")[1:]]
    starts = [line for line in text.splitlines() if line.startswith("[trident] ")]
    assert len(pools) == 2 and pools[0] == pools[1], pools
    assert f"--max-total-tokens {pools[0]}" in starts[1]
