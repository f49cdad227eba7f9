"""Fixtures shared across test modules, and how `make test` splits the suite over pytest-xdist workers."""
from __future__ import annotations

import os

# One OpenMP thread per process, before anything imports torch: `make test` runs two workers on two
# cores, and every job a test starts inherits this; a second thread spinning on a busy core slows
# a step many times over (jobs set it themselves too, as launch.cli does).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# What the jobs of tests set (tests/distributed.py: megatron's jit fuser would compile for ~16 s on
# CPU), set for every process a test starts, so that the forkservers below import as those jobs would.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

from tests.distributed import REPO_ROOT  # noqa: E402
from tests.unit_seconds import RUN_RECORD, SHOWN, load_table, slowest  # noqa: E402


def start_forkservers(config) -> None:
    """Start two forkservers in this pytest process, which import in the background while the first
    tests run: one that the ranks of every ``launch.torchrun`` job its tests start are forked from,
    and one that every SGLang server is (``engine.rollout.sglang_forkserver``). A job or server
    whose environment differs in what the import read starts as it would without them."""
    from engine.lifecycle import start_reaper
    from launch.torchrun import start_shared_rank_forkserver

    # Servers forked from these live in sessions of their own, as any server does, and a session
    # fixture's last the whole run: if this process is killed (xdist stopping a worker), the reaper
    # ends every one it was told of (engine.lifecycle), as a rank's does.
    start_reaper()
    folder = tempfile.mkdtemp(prefix="trident-test-forkservers-")
    config.trident_forkservers = folder
    start_shared_rank_forkserver(folder)
    if importlib.util.find_spec("sglang") is not None:
        from engine.config import RolloutConfig
        from engine.rollout.sglang_forkserver import FORKSERVER_ENV, start_forkserver
        from engine.rollout.sglang_server import SGLangServer, SGLangServerConfig

        # A CPU server's environment (as tests start them: tests/rollout_support.py); the model is not read.
        server = SGLangServer(SGLangServerConfig(model_path="any", log_path=os.devnull, rollout=RolloutConfig(name="sglang")))
        socket_path = os.path.join(folder, "sglang-forkserver")
        start_forkserver(socket_path, server.command()[1], log_path=os.path.join(folder, "sglang-forkserver.log"))
        os.environ[FORKSERVER_ENV] = socket_path


def pytest_unconfigure(config):
    folder = getattr(config, "trident_forkservers", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_model():
    """The demo's SFT'd tiny Llama in .cache/models/demo-arith, built once (~1 min) and reused, as `make demo` does.
    Built under a file lock, so concurrent xdist workers wait for one build."""
    from launch.prepare_demo_model import prepare_demo_model

    return prepare_demo_model(REPO_ROOT / ".cache" / "models" / "demo-arith")


@pytest.fixture(scope="session")
def demo_tools_model(demo_model):
    """The tools demo's model (the demo model warmed up to call a calculator) in .cache/models/demo-tools,
    built once (~2 min, under a file lock) and reused, as `trident yaml/demo_tools_cpu.yaml` does."""
    from launch.prepare_demo_tools_model import prepare_demo_tools_model

    return prepare_demo_tools_model()


@pytest.fixture(scope="session")
def shared_tiny_sglang(tmp_path_factory):
    """A real SGLang server serving the tiny Llama (tests/rollout_support.py), one per pytest process;
    a test takes it through ``SharedServer.serve_tiny_weights``."""
    from tests.rollout_support import SharedServer, build_tiny_model, start_cpu_sglang

    tiny = build_tiny_model(tmp_path_factory.mktemp("shared_tiny_llama"))
    engine = start_cpu_sglang(tiny.path, tmp_path_factory.mktemp("shared_sglang"),
                              rollout={"weight_update_timeout_s": 60}, max_concurrent_requests=16)
    yield SharedServer(engine, tiny)
    engine.shutdown()


@pytest.fixture(scope="session")
def shared_ray():
    """The environment that joins a local Ray cluster of 2 CPUs, one per pytest process
    (tests/shared_ray.py), for jobs whose reward pool would otherwise start and stop a private one
    each: a test sets it in its jobs' environment; tests of a private cluster's own start keep theirs.
    The cluster takes no token (``RAY_AUTH_MODE=disabled``): a second driver of a token cluster that
    ``ray.init`` started does not find its token, and this one is this process's, on this machine."""
    environment = {"RAY_AUTH_MODE": "disabled"}
    head = subprocess.Popen([sys.executable, "-m", "tests.shared_ray", "2"], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **environment})
    address = head.stdout.readline().strip()
    if not address:
        head.stdin.close()
        raise RuntimeError(f"the shared Ray cluster did not start (exit status {head.wait(timeout=60)})")
    yield {**environment, "RAY_ADDRESS": address}
    head.stdin.close()  # the head stops its cluster (ray.shutdown) and exits
    head.wait(timeout=60)


# Wall seconds of the longest work units in the last fresh-clone `make test` on the 2-core machine,
# written by `python -m tests.unit_seconds` from that run's record; every other unit counts as 1 s.
# Only the order of the suite depends on them: a stale number costs minutes at worst, never a result.
UNIT_SECONDS = load_table()
_RUN_SECONDS: dict[str, float] = {}  # this run's, per unit (in the process that reports: not a worker)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """`make test` runs two xdist workers with ``--dist loadgroup``: a test that uses a module- or
    class-scoped fixture (a started SGLang server, one torchrun run that several tests read) is
    grouped with the rest of its module, so that fixture is built once, on one worker; every other
    test goes to whichever worker is free. Tests may also name their group themselves.

    xdist hands out work units (a group, or a lone test) in the order of the collection, two to each
    worker at first, then one whenever a worker runs short. The units are put longest first, so no
    long one starts last while the other worker idles; a unit's tests keep their own order. The
    second unit does not need the demo model: the first one builds it (~1.5 min), under a lock
    that a second worker could only wait on."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        fixture_info = getattr(item, "_fixtureinfo", None)
        definitions = fixture_info.name2fixturedefs.values() if fixture_info is not None else ()
        if any(defs and defs[-1].scope in ("module", "class", "package") for defs in definitions):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    units: dict[str, list] = {}
    for item in items:
        group = item.get_closest_marker("xdist_group")
        unit = group.args[0] if group else item.nodeid
        units.setdefault(unit, []).append(item)
        item.user_properties.append(("work_unit", unit))  # reaches the reporting process with each report
    order = sorted(units, key=lambda unit: -UNIT_SECONDS.get(unit, 1))  # stable: ties keep the file order
    needs_demo = {unit: any("demo_model" in item.fixturenames for item in units[unit]) for unit in order}
    if len(order) > 2 and needs_demo[order[0]] and needs_demo[order[1]]:
        second = next((unit for unit in order if not needs_demo[unit]), None)
        if second is not None:
            order.remove(second)
            order.insert(1, second)
    items[:] = [item for unit in order for item in units[unit]]
    # In a process that runs tests (an xdist worker, or pytest without workers) about to start jobs or servers.
    runs_tests = getattr(config, "workerinput", None) is not None or not config.getoption("numprocesses", None)
    if runs_tests and any(item.get_closest_marker("dist") or item.get_closest_marker("sglang") for item in items):
        start_forkservers(config)


def pytest_runtest_logreport(report):
    """Every phase of every test (the xdist controller gets its workers' reports)."""
    unit = dict(report.user_properties).get("work_unit", report.nodeid)
    _RUN_SECONDS[unit] = _RUN_SECONDS.get(unit, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    """The slowest units of this run, and all of them in ``RUN_RECORD`` (``python -m tests.unit_seconds``
    makes that the order table)."""
    if getattr(config, "workerinput", None) is not None or not _RUN_SECONDS:
        return
    RUN_RECORD.parent.mkdir(parents=True, exist_ok=True)
    RUN_RECORD.write_text(json.dumps(dict(slowest(_RUN_SECONDS, len(_RUN_SECONDS))), indent=1) + "\n")
    terminalreporter.write_sep("=", f"slowest {SHOWN} work units (all in {os.path.relpath(RUN_RECORD)})")
    for unit, seconds in slowest(_RUN_SECONDS):
        terminalreporter.write_line(f"{seconds:8.1f} s  {unit}")
