"""``launch.torchrun``: torchrun whose ranks are forked from one preloaded process, and look and end
like torchrun's own ranks (a session of their own, the program's argv/sys.path, atexit hooks, the
exit status), without importing torch and transformers again; from the agent's own forkserver, or
from one its node shares (tests/conftest.py starts one per pytest process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from launch.torchrun import SHARED_FORKSERVER_ENV
from parallel.state import find_free_port
from tests.distributed import REPO_ROOT

pytestmark = pytest.mark.dist

RANK_SCRIPT = r"""
import atexit, json, os, sys
from pathlib import Path
out = Path(sys.argv[1])
rank = int(os.environ["RANK"])
# Before this script imports anything: what the rank was forked with.
preloaded = sorted(m for m in ("launch.rank_imports", "torch", "transformers", "megatron.core") if m in sys.modules)
import torch
atexit.register(lambda: (out / f"atexit_{rank}").write_text("ran"))
print(f"rank {rank} writes to the agent's output", flush=True)
server_stat = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()
(out / f"rank_{rank}.json").write_text(json.dumps({
    "pid": os.getpid(), "ppid": os.getppid(), "leads_session": os.getsid(0) == os.getpid(),
    "server_parent": int(server_stat[1]), "marker": os.environ.get("TRIDENT_TEST_AGENT"),
    "environ_shows_marker": b"TRIDENT_TEST_AGENT=" in Path("/proc/self/environ").read_bytes(),
    "title": Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode(),
    "argv": sys.argv, "path0": sys.path[0], "preloaded": preloaded, "main": __name__,
    "cuda_initialized": torch.cuda.is_initialized(), "world_size": os.environ["WORLD_SIZE"],
}))
if rank == 1 and len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
"""


def launch(tmp_path: Path, *args: str, shared: bool = False, **variables: str) -> subprocess.CompletedProcess:
    """The rank script on two ranks; ``shared``: forked by this pytest process's shared forkserver."""
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **variables}
    if not shared:
        env.pop(SHARED_FORKSERVER_ENV, None)
    return subprocess.run([sys.executable, "-m", "launch.torchrun", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                           f"--master_port={find_free_port()}", str(script), str(tmp_path), *args],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_ranks_are_forked_from_one_preloaded_process_and_look_like_torchruns(tmp_path):
    result = launch(tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in range(2)]
    script = str(tmp_path / "rank_script.py")
    server = {rank["ppid"] for rank in ranks}
    # One forkserver, the agent's own, is the parent of both ranks, and it had imported torch,
    # transformers and megatron-core (no GPU here) before forking them; it never touched CUDA.
    assert len(server) == 1 and server != {os.getpid()}
    assert {rank["server_parent"] for rank in ranks} != {os.getpid()}  # not this process's shared one
    assert all(rank["preloaded"] == ["launch.rank_imports", "megatron.core", "torch", "transformers"] for rank in ranks)
    assert not any(rank["cuda_initialized"] for rank in ranks)
    for number, rank in enumerate(ranks):
        assert rank["leads_session"], rank  # as torchrun's Popen(start_new_session=True): its reaper kills its group
        assert rank["title"].startswith(f"rank {number}/2: {sys.executable} -u {script} {tmp_path}"), rank["title"]
        assert rank["argv"] == [script, str(tmp_path)] and rank["path0"] == str(tmp_path)
        assert rank["main"] == "__main__" and rank["world_size"] == "2"
        assert (tmp_path / f"atexit_{number}").read_text() == "ran"


def test_a_shared_forkserver_forks_ranks_that_are_their_agents(tmp_path):
    """Ranks forked by the forkserver this pytest process started have the agent's environment (in
    ``os.environ`` and in ``/proc/<pid>/environ``, where tools find a job's processes) and write to
    the agent's output, not the forkserver's."""
    assert SHARED_FORKSERVER_ENV in os.environ  # tests/conftest.py
    marker = uuid.uuid4().hex
    result = launch(tmp_path, shared=True, TRIDENT_TEST_AGENT=marker)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "forkserver of its own" not in result.stderr
    ranks = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in range(2)]
    assert {rank["server_parent"] for rank in ranks} == {os.getpid()}
    assert all(rank["marker"] == marker and rank["environ_shows_marker"] for rank in ranks), ranks
    assert all(rank["preloaded"] == ["launch.rank_imports", "megatron.core", "torch", "transformers"] for rank in ranks)
    assert "rank 0 writes to the agent's output" in result.stdout and "rank 1 writes" in result.stdout


def test_an_agent_whose_environment_the_import_read_differently_starts_its_own(tmp_path):
    """``HF_HOME`` is read while transformers is imported: ranks that set it otherwise are not
    forked from a process that imported transformers without it."""
    result = launch(tmp_path, shared=True, HF_HOME=str(tmp_path / "hf"), TRIDENT_TEST_AGENT="x")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "forked from a forkserver of its own" in result.stderr and "HF_HOME" in result.stderr, result.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in range(2)]
    assert {rank["server_parent"] for rank in ranks} != {os.getpid()}
    assert all(rank["marker"] == "x" for rank in ranks)


def test_a_ranks_exit_status_is_the_jobs_and_its_atexit_hooks_run(tmp_path):
    result = launch(tmp_path, "3")
    assert result.returncode != 0
    assert "exitcode  : 3" in result.stderr, result.stderr[-3000:]
    assert (tmp_path / "atexit_1").read_text() == "ran"


def test_a_module_runs_as_main_with_its_arguments(tmp_path, demo_model):
    """``-m launch.main`` as the trident command runs it: the config error of a bad key is the
    rank's own message and exit status 2 (launch.main's), not a traceback of the launcher."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "launch.torchrun", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                             f"--master_port={find_free_port()}", "-m", "launch.main", "yaml/demo_cpu.yaml",
                             "trainer.n_gpus_per_node=1", "trainer.no_such_key=1"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "[trident] error: " in result.stderr and "no_such_key" in result.stderr, result.stderr[-3000:]
    assert "exitcode  : 2" in result.stderr


EXIT_NOW_SCRIPT = r"""
import atexit, sys
from pathlib import Path
from engine.lifecycle import exit_now
out = Path(sys.argv[1])

class TornDown:  # the interpreter's teardown would collect it
    def __del__(self):
        (out / "teardown").write_text("ran")

kept = TornDown()
atexit.register(lambda: (out / "atexit").write_text("ran"))
sys.stdout.write("buffered, not flushed")
exit_now(3)
"""


def test_a_launcher_ends_with_its_hooks_and_output_but_without_the_interpreters_teardown(tmp_path):
    """``exit_now`` (the end of ``launch.torchrun`` and of the ``trident`` command): the status, the
    atexit hooks and the buffered output are kept; the teardown, whose last garbage collection of
    torch's modules took ~2 s, is skipped."""
    result = subprocess.run([sys.executable, "-c", EXIT_NOW_SCRIPT, str(tmp_path)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout == "buffered, not flushed"
    assert (tmp_path / "atexit").read_text() == "ran" and not (tmp_path / "teardown").exists()
