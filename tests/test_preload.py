"""engine.preload: what an import depends on, so that a process forked after it can be trusted
(launch.torchrun's ranks, engine.rollout.sglang_forkserver's servers)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.preload import (NVML_CHECK, ImportRecord, environment_difference, fork_safety_problem,
                            search_path_after_fork, watched_import)


def test_the_variables_an_import_reads_and_sets_are_recorded_with_their_values_before(monkeypatch):
    monkeypatch.setenv("TRIDENT_TEST_READ", "before")
    monkeypatch.delenv("TRIDENT_TEST_SET", raising=False)

    def load():
        assert os.environ[NVML_CHECK] == "1"  # is_available() asks NVML during the import
        os.environ.get("TRIDENT_TEST_READ")
        "TRIDENT_TEST_ABSENT" in os.environ
        os.environ.setdefault("TRIDENT_TEST_SET", "by the import")

    record = watched_import(load)
    assert record.environment["TRIDENT_TEST_READ"] == "before"
    assert record.environment["TRIDENT_TEST_ABSENT"] is None and record.environment["TRIDENT_TEST_SET"] is None
    assert record.set_by_import == {"TRIDENT_TEST_SET": "by the import"}
    assert NVML_CHECK not in os.environ  # a forked process finds its GPUs as a fresh one would
    assert record.cuda_entries == [] and record.threads == [] and fork_safety_problem(record) is None
    os.environ.pop("TRIDENT_TEST_SET")


def test_an_import_that_enters_the_cuda_runtime_or_leaves_a_thread_is_not_forked_from():
    def enters_cuda():
        try:
            torch.cuda._lazy_init()  # on this machine it fails after the entry: no driver
        except (RuntimeError, AssertionError):
            pass

    record = watched_import(enters_cuda)
    assert record.cuda_entries == ["torch.cuda._lazy_init"]
    assert "initialised CUDA (torch.cuda._lazy_init)" in fork_safety_problem(record)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-behind")
    record = watched_import(thread.start)
    stop.set()
    thread.join()
    assert record.threads == ["left-behind"] and "left-behind" in fork_safety_problem(record)


@pytest.mark.parametrize("environment, differing", [
    ({"HF_HOME": "/a", "PATH": "/bin"}, []),
    ({"HF_HOME": "/b", "PATH": "/bin"}, ["HF_HOME"]),  # read by the import, with another value
    ({"PATH": "/bin"}, ["HF_HOME"]),  # read, and now unset
    ({"HF_HOME": "/a", "PATH": "/bin", "OMP_NUM_THREADS": "4"}, ["OMP_NUM_THREADS"]),  # read by a native library
    ({"HF_HOME": "/a", "PATH": "/bin", "UNREAD": "x", "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}, []),
])
def test_an_environment_differs_where_the_import_read_it(environment, differing):
    assert environment_difference({"HF_HOME": "/a", "PATH": "/bin"}, environment) == differing


def test_a_variable_at_the_value_the_import_sets_it_to_is_no_change():
    """A process that has imported SGLang itself (a test process) has SGLang's cache variables set."""
    imported, set_by_import = {"CUDA_CACHE_PATH": None}, {"CUDA_CACHE_PATH": "/cache/nv"}
    assert environment_difference(imported, {"CUDA_CACHE_PATH": "/cache/nv"}, set_by_import) == []
    assert environment_difference(imported, {"CUDA_CACHE_PATH": "/other"}, set_by_import) == ["CUDA_CACHE_PATH"]


@pytest.mark.parametrize("search_path, differing", [
    ("/extra:/src", []),  # keeps the import's entry: a forked process puts /extra first itself
    ("/extra", ["PYTHONPATH"]),  # drops it: a module found there might not be found
    (None, ["PYTHONPATH"]),
])
def test_a_search_path_may_add_entries_but_not_drop_the_imports(search_path, differing):
    environment = {"PATH": "/bin", **({"PYTHONPATH": search_path} if search_path else {})}
    assert environment_difference({"PATH": "/bin", "PYTHONPATH": "/src"}, environment) == differing


def test_a_forked_process_has_the_search_path_a_fresh_one_would():
    current = ["/forkserver/cwd", "/src", "/venv/site-packages"]
    assert search_path_after_fork(current, "/job", "/src", "/mine") == ["/job", "/mine", "/venv/site-packages"]
