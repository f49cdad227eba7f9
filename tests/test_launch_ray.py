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

    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in ranks} == {"0"}

    # rank 1 exits 3 before joining; rank 0 would wait in the rendezvous: the launcher stops it, and
    # with --max-restarts 1 starts both again, which fail the same way: the second failure ends the job
    out.unlink()
    failing = RayLaunchConfig(**{**config.__dict__, "program_args": ("yaml/demo_cpu.yaml", f"out={out}", "fail_rank=1"),
                                 "max_restarts": 1})
    assert launch(failing) == 3 and not out.exists()
    # rank 1 fails in the first attempt only: the restarted job (every rank, a fresh port) completes
    once = ("yaml/demo_cpu.yaml", f"out={out}", "fail_rank=1", "fail_attempts=1")
    assert launch(RayLaunchConfig(**{**config.__dict__, "program_args": once, "max_restarts": 1})) == 0
    ranks = json.loads(out.read_text())["ranks"]
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in ranks} == {"1"} and ranks[0]["MASTER_PORT"] == ranks[1]["MASTER_PORT"]
    log = (tmp_path / "logs" / "rank-1.log").read_text()
    assert log.count("rank 1 failing on purpose") == 2 + 1  # both attempts of the failing job, the first of this one


@pytest.mark.slow
def test_rollout_servers_on_a_node_of_their_own(tmp_path, local_ray):
    """--rollout-nodes 1: a rollout-node actor starts launch.rollout_servers, the trainers attach to
    its server by address with the key the launcher generated (in no command line or log)."""
    pytest.importorskip("sglang")
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    config = RayLaunchConfig(
        program_args=("yaml/demo_cpu.yaml", "actor_rollout_ref.rollout.name=sglang",
                      "actor_rollout_ref.rollout.gpu_memory_utilization=0.05", "actor_rollout_ref.rollout.check_weight_sync=true",
                      "trainer.total_training_steps=2", f"trainer.default_local_dir={run_dir}", "trainer.test_freq=-1",
                      "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.export_hf_at_end=false"),
        num_workers=2, workers_per_node=2, device="cpu", log_dir=str(logs), timeout_s=600, rollout_nodes=1,
        extra_env={"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"})
    assert launch(config) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["rollout/log_prob_abs_diff"] < 1e-4 for row in rows)  # the broadcast weights arrived
    rank0 = (logs / "rank-0.log").read_text()
    assert "rollout server(s) on nodes of their own" in rank0
    assert "rollout server(s) ready" in (logs / "rollout-node-0.log").read_text()
    server_log = (logs / "rollout-node-0" / "sglang_server0.log").read_text()
    assert "'api_key': '<redacted>'" in server_log and "POST /update_weights_from_distributed" in server_log
