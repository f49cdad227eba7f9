"""Fixtures shared across test modules, and how `make test` splits the suite over pytest-xdist workers."""
from __future__ import annotations

import os

# One OpenMP thread per process, before anything imports torch: `make test` runs two workers on two
# cores, and every job a test starts inherits this; a second thread spinning on a busy core slows
# a step many times over (jobs set it themselves too, as launch.cli does).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from tests.distributed import REPO_ROOT  # noqa: E402


@pytest.fixture(scope="session")
def demo_model():
    """The demo's SFT'd tiny Llama in .cache/models/demo-arith, built once (~1 min) and reused, as `make demo` does.
    Built under a file lock, so concurrent xdist workers wait for one build."""
    from launch.prepare_demo_model import prepare_demo_model

    return prepare_demo_model(REPO_ROOT / ".cache" / "models" / "demo-arith")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """`make test` runs two xdist workers with ``--dist loadgroup``: a test that uses a module- or
    class-scoped fixture (a started SGLang server, one torchrun run that several tests read) is
    grouped with the rest of its module, so that fixture is built once, on one worker; every other
    test goes to whichever worker is free. Tests may also name their group themselves."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        fixture_info = getattr(item, "_fixtureinfo", None)
        definitions = fixture_info.name2fixturedefs.values() if fixture_info is not None else ()
        if any(defs and defs[-1].scope in ("module", "class", "package") for defs in definitions):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
