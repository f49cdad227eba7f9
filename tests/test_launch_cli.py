"""How a rank's failure reads: a collective timeout names its setting, a dead rank is named once.

The gloo message below is the one torch 2.14's gloo raised on this machine when one of two ranks
did not join an all_reduce within a 3 s process-group timeout.
"""
from __future__ import annotations

import argparse
import signal
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import engine.lifecycle
import launch.main
from launch.cli import report_failures

GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                "waiting 3000ms for recv operation to complete")


def test_a_collective_timeout_names_its_setting(monkeypatch, capsys):
    def run(yaml_path, overrides):
        raise RuntimeError(GLOO_TIMEOUT)

    monkeypatch.setattr(launch.main, "run", run)
    # not in the test process: a reaper watching pytest, a SIGTERM handler
    monkeypatch.setattr(engine.lifecycle, "start_reaper", lambda: None)
    monkeypatch.setattr(engine.lifecycle, "stop_gracefully_on_sigterm", lambda: None)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv(launch.main.ERROR_DIR_ENV, raising=False)
    assert launch.main.main(["yaml/demo_cpu.yaml"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("[trident] error (rank 1): a collective did not complete within "
                          "trainer.collective_timeout_minutes") and "Timed out waiting 3000ms" in err


def test_other_runtime_errors_are_not_called_timeouts():
    assert launch.main.is_collective_timeout(RuntimeError(GLOO_TIMEOUT))
    assert launch.main.is_collective_timeout(RuntimeError("Watchdog caught collective operation timeout: "
                                                          "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, Timeout(ms)=600000)"))
    assert not launch.main.is_collective_timeout(RuntimeError("CUDA error: an illegal memory access"))
    assert not launch.main.is_collective_timeout(ValueError(GLOO_TIMEOUT))


def test_failed_ranks_are_reported_once_each(tmp_path, capsys):
    errors = tmp_path / "errors"
    errors.mkdir()
    for rank in (0, 1):
        (errors / f"rank_{rank:05d}.txt").write_text("data.train_files: row 3 is bad")
    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
                for rank, code in ((0, 2), (1, 2), (2, -signal.SIGKILL), (3, -signal.SIGABRT))}
    status = report_failures(ChildFailedError("launch.main", failures), errors, tmp_path / "logs")
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[trident] error (ranks 0, 1): data.train_files: row 3 is bad"
    assert lines[1] == f"[trident] rank 2 killed by signal 9; its log: {tmp_path}/logs/rank_00002.log"
    assert lines[2].startswith("[trident] rank 3 killed by signal 6 (SIGABRT: a CUDA error, or a collective")
    assert len(lines) == 3 and status == 2


def test_max_restarts_reaches_torchrun_and_a_negative_one_is_refused(monkeypatch, capsys):
    from launch import cli, torchrun

    assert cli.main(["yaml/demo_cpu.yaml", "--max-restarts", "-1"]) == 2
    assert "--max-restarts must be >= 0, got -1" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(torchrun, "run", seen.append)
    monkeypatch.setenv(launch.main.ERROR_DIR_ENV, "")  # launch() sets it for its ranks: undone after the test
    args = argparse.Namespace(rdzv_endpoint=None, rdzv_id="trident", node_rank=0, max_restarts=2,
                              yaml_path="yaml/demo_cpu.yaml", overrides=[])
    assert cli.launch(args, logs_dir=Path("logs"), nnodes=1, nproc=2) == 0
    assert "--max-restarts=2" in seen[0] and seen[0][-2:] == ["launch.main", "yaml/demo_cpu.yaml"]
