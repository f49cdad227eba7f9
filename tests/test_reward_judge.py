"""The LLM judge: its client's failure modes without a server, and a PPO run against a real SGLang
judge on CPU that dies mid-run (a clear error on every rank, no hang, nothing left running)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from engine.config.reward_model import JudgeConfig, JudgeModelConfig
from engine.rewards.judge import JudgeClient, JudgeError, conversation_text
from engine.rollout.sglang_server import SERVER_MODULE
from parallel.state import find_free_port
from tests.distributed import REPO_ROOT, processes_left, processes_with, read_metrics
from tests.rollout_support import requires_sglang


def test_judge_reply_parsing_and_a_dead_endpoint():
    dead = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there
    config = JudgeConfig(enable=True, model=JudgeModelConfig(name="judge"), max_retries=1, timeout_s=5)
    client = JudgeClient(config, dead)
    assert [client.parse(reply) for reply in ("7", "Score: 8.5/10", "12", "-3", "none")] == [0.7, 0.85, 1.0, 0.0, None]
    assert conversation_text([{"role": "user", "content": "Calculate 1 + 2."}]) == "Calculate 1 + 2."
    assert conversation_text([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) == "system: s\nuser: u"
    messages = [[{"role": "user", "content": "Calculate 1 + 2."}]] * 3
    started = time.monotonic()
    with pytest.raises(JudgeError, match=f"judge at {dead} could not score 3 of 3 responses.*2 tries failed"):
        client.score_on_all_ranks(messages, ["3", "4", "5"])
    assert time.monotonic() - started < 10  # one retry after 1 s, not a hang
    fallback = JudgeClient(JudgeConfig(enable=True, model=JudgeModelConfig(name="judge"), max_retries=0,
                                       fallback_score=0.25), dead)
    scores, metrics = fallback.score_on_all_ranks(messages, ["3", "4", "5"])
    assert scores.tolist() == [0.25] * 3 and metrics == {"reward/judge/failed_fraction": 1.0}
    with pytest.raises(JudgeError, match="TRIDENT_NO_SUCH_KEY"):
        JudgeClient(JudgeConfig(enable=True, api_key_env="TRIDENT_NO_SUCH_KEY", model=JudgeModelConfig(name="j")), dead)


@pytest.mark.dist
@pytest.mark.sglang
@pytest.mark.slow
@requires_sglang
def test_a_judge_that_dies_mid_run_stops_the_run_with_a_clear_error(demo_model, tmp_path):
    """2 ranks score with a judge that Trident starts (an SGLang server of the demo model, whose
    replies are numbers); once step 1 has judge scores the server is killed, and the run must stop
    with the judge's error on the terminal within the retry budget, leaving no process behind."""
    judge_dir = tmp_path / "judge-model"  # its own path, so the test can find the judge's server
    shutil.copytree(demo_model.model_dir, judge_dir, ignore=shutil.ignore_patterns("data"))
    marker = f"TRIDENT_TEST_JOB={uuid.uuid4().hex}"
    run_dir = tmp_path / "run"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1], "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "yaml/demo_cpu.yaml", f"trainer.default_local_dir={run_dir}",
         "trainer.total_training_steps=30", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "trainer.save_freq=-1", "reward_model.judge.enable=true", f"reward_model.judge.model.path={judge_dir}",
         "reward_model.judge.model.dtype=float32", "reward_model.judge.prompt_template='Calculate {response} + 1.'",
         # a question of the kind the demo model was trained on: it answers with a number. Measured on
         # 1,280 responses the demo model sampled: 0 replies without a number; '{response} {prompt}'
         # gave 7 (an empty reply stops step 1 at a rate of ~30%, before the kill this test is about)
         "reward_model.judge.max_score=200", "reward_model.judge.max_tokens=4", "reward_model.judge.timeout_s=20",
         "reward_model.judge.max_retries=1"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not any("reward/judge/mean" in row for row in _rows(run_dir)):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[0][-4000:]
            time.sleep(0.5)
        first = next(row for row in _rows(run_dir) if "reward/judge/mean" in row)
        assert first["reward/judge/failed_fraction"] == 0.0 and 0 <= first["reward/judge/mean"] <= 1, first
        servers = [pid for pid in processes_with(marker) if _is_judge_server(pid, judge_dir)]
        assert servers, processes_with(marker)
        killed = time.monotonic()
        for pid in servers:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        output = job.communicate(timeout=300)[0]
        stopped_after = time.monotonic() - killed
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode != 0
    assert "judge at http://127.0.0.1:" in output and "could not score" in output, output[-4000:]
    assert "reward_model.judge.fallback_score" in output
    print(f"the run stopped {stopped_after:.0f} s after the judge was killed")
    left = processes_left(marker)
    assert not left, left


def _is_judge_server(pid: int, judge_dir) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return SERVER_MODULE in command and str(judge_dir) in command


def _rows(run_dir):
    try:
        return read_metrics(run_dir)
    except (FileNotFoundError, ValueError):
        return []
