"""Fixtures shared across test modules, and how `make test` splits the suite over pytest-xdist workers."""
from __future__ import annotations

import os

# One OpenMP thread per process, before anything imports torch: `make test` runs two workers on two
# cores, and every job a test starts inherits this; a second thread spinning on a busy core slows
# a step many times over (jobs set it themselves too, as launch.cli does).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

from tests.distributed import REPO_ROOT  # noqa: E402


def pytest_configure(config):
    """Each pytest process that runs tests (an xdist worker, or pytest without workers) starts two
    forkservers, which import in the background while the first tests run: one that the ranks of
    every ``launch.torchrun`` job its tests start are forked from, and one that every SGLang server
    is (``engine.rollout.sglang_forkserver``). Each job or server whose environment differs in what
    the import read starts as it would without them; tests of that path clear the variables."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        return  # the xdist controller runs no test
    from launch.torchrun import start_shared_rank_forkserver

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


# Wall seconds of the longest work units (an xdist group, or one test) in a fresh-clone `make test`
# on the 2-core machine (pytest --durations=0, summed per unit); every other unit counts as 1 s.
# Only the order of the suite depends on them: a stale number costs minutes at worst, never a result.
UNIT_SECONDS = {
    # builds the tools demo model (~2 min) for the other tools-demo tests, then 10 PPO steps
    "tests/test_agentic_tools_run.py::test_ppo_teaches_the_tools_demo_to_call_the_calculator": 160,
    "tests/test_reward_model.py::test_ppo_on_the_reward_model_alone_raises_its_score_and_the_accuracy": 180,
    "tests.test_reshard_dist": 215,
    "rehearse:/models/Qwen2.5-72B-Instruct": 128,
    "tests.test_observability": 123,
    "tests.test_benchmark_suite": 117,
    "tests/test_ppo_end_to_end.py::test_lora_learns_and_resumes_exactly": 113,
    "rehearse:/models/Meta-Llama-3-70B-Instruct": 112,
    "tests/test_ppo_end_to_end.py::test_reward_rises": 98,
    "rehearse:models/Qwen3-8B": 130,
    "rehearse:models/Qwen2.5-7B-Instruct": 89,
    "tests.test_roles": 125,
    "tests/test_ppo_end_to_end.py::test_context_parallel_trains_like_cp1_and_resumes": 72,
    "tests.test_context_parallel": 45,
    "tests/test_ppo_end_to_end.py::test_a_cp2_checkpoint_with_lora_and_offload_resumes_at_cp1": 32,
    "tests/test_disaggregated_rollout.py::test_pipeline_stages_push_their_own_weights_to_a_server_of_its_own": 73,
    "tests/test_launch_two_nodes.py::test_two_node_rehearsal_matches_one_node": 73,
    "rehearse:models/Qwen3-30B-A3B": 69,
    "rehearse:models/Qwen2.5-0.5B-Instruct": 66,
    "tests.test_lora": 64,
    "tests/test_disaggregated_rollout.py::test_servers_on_a_node_of_their_own_serve_only_the_jobs_key": 63,
    "tests/test_ppo_end_to_end.py::test_a_rank_lost_mid_run_restarts_the_job_which_resumes_exactly": 75,
    "tests/test_ppo_end_to_end.py::test_moe_with_expert_parallelism_trains_like_ep1_and_resumes": 55,
    "tests/test_failure_cleanup.py::test_a_killed_rank_leaves_no_process_behind": 50,
    "tests/test_disaggregated_rollout.py::test_a_colocated_server_killed_mid_run_is_restarted_and_the_run_finishes": 63,
    "tests.test_models_smollm2": 49,
    "tests/test_checkpoint_integrity.py::test_a_truncated_shard_in_the_latest_checkpoint": 50,
    "tests/test_hang_watchdog.py::test_a_stalled_rank_is_named_with_every_ranks_stacks_and_the_job_ends": 35,
    "tests/test_dynamic_sampling_run.py::test_dynamic_sampling_trains_full_batches_of_groups_with_a_spread_and_learns_sooner": 85,
    "tests/test_disaggregated_rollout.py::test_two_steps_off_policy_with_partial_rollouts_learns": 58,
    "tests/test_launch_ray.py::test_two_cpu_workers_run_the_same_program_and_a_failure_stops_the_job": 52,
    "tests/test_launch_ray.py::test_rollout_servers_on_a_node_of_their_own": 49,
}


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
        units.setdefault(group.args[0] if group else item.nodeid, []).append(item)
    order = sorted(units, key=lambda unit: -UNIT_SECONDS.get(unit, 1))  # stable: ties keep the file order
    needs_demo = {unit: any("demo_model" in item.fixturenames for item in units[unit]) for unit in order}
    if len(order) > 2 and needs_demo[order[0]] and needs_demo[order[1]]:
        second = next((unit for unit in order if not needs_demo[unit]), None)
        if second is not None:
            order.remove(second)
            order.insert(1, second)
    items[:] = [item for unit in order for item in units[unit]]
