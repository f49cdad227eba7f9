"""launch.ray_launcher really runs an SPMD program: 2 CPU workers in a placement group, gloo all-reduce."""
import json
import os

import pytest

from launch.ray_launcher import RayLaunchConfig, launch

PROBE = "tests.dist_workers.launch_spmd_probe"


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("uses a private local Ray instance")
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_two_cpu_workers_run_the_same_program_and_a_failure_stops_the_job(tmp_path, local_ray):
    out = tmp_path / "probe.json"
    config = RayLaunchConfig(program_args=("yaml/demo_cpu.yaml", f"out={out}", "a.b=1"), num_workers=2,
                             workers_per_node=2, device="cpu", entry_module=PROBE, log_dir=str(tmp_path / "logs"),
                             timeout_s=240, extra_env={"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"})
    assert launch(config) == 0
    result = json.loads(out.read_text())
    assert result["all_reduce"] == 1 + 2
    assert result["experiment"] == "yaml/demo_cpu.yaml" and result["overrides"] == [f"out={out}", "a.b=1"]
    ranks = result["ranks"]
    assert [r["dist_rank"] for r in ranks] == [0, 1] and [r["RANK"] for r in ranks] == ["0", "1"]
    assert {r["WORLD_SIZE"] for r in ranks} == {"2"} and [r["LOCAL_RANK"] for r in ranks] == ["0", "1"]
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}) == 1
    assert (tmp_path / "logs" / "rank-0.log").exists()

    # rank 1 exits 3 before joining; rank 0 would wait in the rendezvous: the launcher stops it
    failing = RayLaunchConfig(**{**config.__dict__, "program_args": ("yaml/demo_cpu.yaml", f"out={out}", "fail_rank=1")})
    assert launch(failing) == 3
