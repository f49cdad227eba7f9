"""`make test` runs two pytest-xdist workers; tests/conftest.py keeps a module's tests that share a
module-scoped fixture on one worker (the fixture is built once), spreads the rest, longest first. Checked on a
throw-away suite run the way `make test` runs this one."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.distributed import REPO_ROOT

SHARED = '''
import json, os, pytest

@pytest.fixture(scope="module")
def built_once(tmp_path_factory):
    return os.environ["PYTEST_XDIST_WORKER"]

@pytest.mark.parametrize("index", range(6))
def test_shares(built_once, index):
    worker = os.environ["PYTEST_XDIST_WORKER"]
    with open(os.environ["GROUPING_LOG"], "a") as log:
        log.write(json.dumps({"test": "shared", "index": index, "worker": worker, "fixture_worker": built_once}) + "\\n")
'''
FREE = '''
import json, os, time, pytest

@pytest.mark.parametrize("index", range(6))
def test_free(index):
    time.sleep(0.3)
    with open(os.environ["GROUPING_LOG"], "a") as log:
        log.write(json.dumps({"test": "free", "index": index, "worker": os.environ["PYTEST_XDIST_WORKER"]}) + "\\n")
'''


def test_tests_sharing_a_module_fixture_stay_on_one_worker(tmp_path):
    suite = tmp_path / "suite" / "tests"
    suite.mkdir(parents=True)
    (suite / "__init__.py").write_text("")
    # One free test made the longest unit: it must be handed out first, before the shared group.
    conftest = (REPO_ROOT / "tests" / "conftest.py").read_text()
    (suite / "conftest.py").write_text(f"{conftest}\nUNIT_SECONDS['tests/test_free.py::test_free[5]'] = 100\n")
    (suite / "distributed.py").write_text(f"REPO_ROOT = {str(REPO_ROOT)!r}\n")  # what conftest imports
    (suite / "unit_seconds.py").write_text((REPO_ROOT / "tests" / "unit_seconds.py").read_text())
    (suite / "test_shared.py").write_text(SHARED)
    # A second group: xdist's own order (most tests first) would hand out the two groups first.
    (suite / "test_shared_too.py").write_text(SHARED.replace('"shared"', '"shared too"'))
    (suite / "test_free.py").write_text(FREE)
    log = tmp_path / "log.jsonl"
    # The Makefile's options, on the Makefile's own command line, with its default worker count.
    makefile = (REPO_ROOT / "Makefile").read_text().splitlines()
    workers = next(line.split("?=")[1].strip() for line in makefile if line.startswith("WORKERS ?="))
    options = next(line for line in makefile if "-m pytest tests" in line).split("-m pytest tests", 1)[1]
    options = options.replace("$(WORKERS)", workers).split()
    result = subprocess.run([sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", *options],
                            cwd=suite.parent, env={**_env(), "GROUPING_LOG": str(log)}, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    shared = [row for row in rows if row["test"] == "shared"]
    assert len(shared) == 6 and len({row["worker"] for row in shared}) == 1
    assert all(row["fixture_worker"] == row["worker"] for row in shared)
    free = {row["worker"] for row in rows if row["test"] == "free"}
    assert len(free) == 2, rows  # the rest is spread over both workers
    longest = next(row for row in rows if (row["test"], row["index"]) == ("free", 5))
    assert next(row for row in rows if row["worker"] == longest["worker"]) == longest, rows  # handed out first
    # The run's units, with their seconds, end its output and are kept for the order table.
    summary = result.stdout.split("slowest 15 work units", 1)[1]
    assert "tests.test_shared" in summary and "tests/test_free.py::test_free[5]" in summary
    record = json.loads((suite.parent / ".cache" / "unit-seconds.json").read_text())
    assert set(record) == {"tests.test_shared", "tests.test_shared_too", *(f"tests/test_free.py::test_free[{i}]" for i in range(6))}
    assert 0.3 <= record["tests/test_free.py::test_free[0]"] < 5


def _env() -> dict[str, str]:
    """This process's environment without the variables of the xdist worker it may run in."""
    return {key: value for key, value in os.environ.items() if not key.startswith(("PYTEST_", "GROUPING_"))}
