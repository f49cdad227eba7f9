"""Dry runs of launch/torchrun.sh, launch/slurm/ppo.sbatch and launch/ray/start_cluster_in_slurm.sh.

Slurm is not installed here; the dry runs print what would run, and the srun payload itself is
executed per node (with torchrun.sh in dry-run) to check what each node would start.
"""
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest

from launch.ray_launcher import RayLaunchConfig, RayLaunchError, WorkerPlacement, dry_run_lines, rank_environments
from launch.slurm.hostlist import HostlistError, expand_hostlist
from tests.distributed import processes_with

REPO = Path(__file__).resolve().parent.parent
YAML = "yaml/llama3-70b_ppo_8node.yaml"
OVERRIDES = ["data.train_batch_size=256", "trainer.experiment_name=with space"]


def run(*command, env=None):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(command, cwd=REPO, env={**clean, **(env or {})}, capture_output=True, text=True, check=True).stdout


def torchrun_args(line):
    words = shlex.split(line)
    start = words.index("launch.torchrun") + 1
    module = words.index("-m", start)
    options = dict(word.split("=", 1) for word in words[start:module])
    return options, words[module + 1], words[module + 2:]


def test_torchrun_dry_run_for_node_one_of_two():
    out = run("launch/torchrun.sh", "--dry-run", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "8",
              "--rdzv-endpoint", "node01:29500", "--rdzv-id", "42", YAML, *OVERRIDES)
    options, module, program = torchrun_args(out.strip())
    assert options == {"--nnodes": "2", "--node-rank": "1", "--nproc-per-node": "8", "--rdzv-backend": "c10d",
                       "--rdzv-endpoint": "node01:29500", "--rdzv-id": "42", "--max-restarts": "0"}
    assert module == "launch.main" and program == [YAML, *OVERRIDES]


def test_torchrun_rejects_bad_arguments():
    result = subprocess.run(["launch/torchrun.sh", "--nnodes", "2", "--node-rank", "2", YAML], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 2 and "--node-rank must be in 0..1" in result.stderr
    result = subprocess.run(["launch/torchrun.sh", "--max-restarts", "-1", YAML], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "--max-restarts must be a non-negative integer, got '-1'" in result.stderr


def test_slurm_dry_run_two_nodes():
    env = {"SLURM_JOB_ID": "777", "SLURM_JOB_NAME": "ppo70b", "SLURM_JOB_NODELIST": "gpu-a[07-08]",
           "SLURM_GPUS_ON_NODE": "8", "TRIDENT_RUN_ROOT": "/shared/runs"}
    lines = run("bash", "launch/slurm/ppo.sbatch", "--dry-run", "--max-restarts", "2", YAML, *OVERRIDES,
                env=env).splitlines()
    run_dir = "/shared/runs/ppo70b-777"
    assert lines[0] == f"# run_dir {run_dir}"
    srun = shlex.split(next(line for line in lines if line.startswith("srun ")))
    assert srun[:5] == ["srun", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        f"--output={run_dir}/logs/node-%n.log"]
    payload = srun[-1]
    expected_program = [YAML, f"trainer.default_local_dir={run_dir}/checkpoints", "trainer.resume_mode=auto",
                        "trainer.nnodes=2", "trainer.n_gpus_per_node=8", *OVERRIDES]
    node_lines = [line for line in lines if line.startswith("# node ")]
    assert [line.split(":")[0] for line in node_lines] == ["# node 0 gpu-a07", "# node 1 gpu-a08"]
    for node_rank, line in enumerate(node_lines):
        # what srun's task on that node runs: the payload, SLURM_NODEID set by srun
        executed = run("bash", "-c", payload, env={"SLURM_NODEID": str(node_rank), "TRIDENT_DRY_RUN": "1"}).strip()
        assert line.split(": ", 1)[1] == executed
        options, module, program = torchrun_args(executed)
        assert options["--rdzv-endpoint"] == "gpu-a07:29500"  # first node of the allocation
        assert options["--node-rank"] == str(node_rank) and options["--nnodes"] == "2"
        assert options["--nproc-per-node"] == "8" and options["--rdzv-id"] == "777"
        assert options["--max-restarts"] == "2"  # every node's agent restarts the same number of times
        assert module == "launch.main" and program == expected_program


def test_slurm_gives_rollout_gpus_to_servers_on_a_one_node_job():
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "gpu01", "SLURM_GPUS_ON_NODE": "8"}
    lines = run("bash", "launch/slurm/ppo.sbatch", "--dry-run", "--rollout-gpus", "2", YAML, env=env).splitlines()
    options, _, program = torchrun_args(next(line for line in lines if line.startswith("# node 0")).split(": ", 1)[1])
    assert options["--nproc-per-node"] == "6"  # the trainer's ranks; GPUs 6 and 7 go to the servers
    assert program[-3:] == ["actor_rollout_ref.rollout.mode=disaggregated", "actor_rollout_ref.rollout.num_gpus=2",
                            "trainer.n_gpus_per_node=6"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    two_nodes = subprocess.run(["bash", "launch/slurm/ppo.sbatch", "--dry-run", "--nodelist", "gpu[01-02]",
                                "--rollout-gpus", "2", YAML], cwd=REPO, env=clean, capture_output=True, text=True)
    assert two_nodes.returncode == 2 and "for servers on nodes of their own use --rollout-nodes" in two_nodes.stderr
    refused = subprocess.run(["launch/torchrun.sh", "--dry-run", "--nnodes", "2", "--rollout-gpus", "1", YAML],
                             cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 2 and "--rollout-gpus places the servers on the trainer's node" in refused.stderr


def test_slurm_puts_rollout_servers_on_nodes_of_their_own():
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    lines = run("bash", "launch/slurm/ppo.sbatch", "--dry-run", "--nodelist", "gpu[01-03]", "--rollout-nodes", "1",
                YAML, "data.train_batch_size=64", env=clean).splitlines()
    servers, trainers = (shlex.split(line) for line in lines if line.startswith("srun "))
    assert "--nodelist=gpu03" in servers and "--nodelist=gpu01,gpu02" in trainers
    # The rollout node starts its servers with the job's experiment and writes their addresses.
    server_command = shlex.split(servers[-1])
    assert server_command[0] == "exec" and server_command[2:6] == ["-m", "launch.rollout_servers", YAML,
                                                                   "data.train_batch_size=64"]
    assert server_command[server_command.index("--address-file") + 1].endswith("/rollout/addresses-$SLURMD_NODENAME")
    # The trainers use the two other nodes and attach to those addresses.
    node_lines = [line for line in lines if line.startswith("# node ")]
    assert [line.split(":")[0] for line in node_lines] == ["# node 0 gpu01", "# node 1 gpu02"]
    options, module, program = torchrun_args(node_lines[0].split(": ", 1)[1])
    assert options["--nnodes"] == "2" and options["--rdzv-endpoint"] == "gpu01:29500"
    assert "trainer.nnodes=2" in program and "actor_rollout_ref.rollout.mode=disaggregated" in program
    assert any(word.startswith("actor_rollout_ref.rollout.server_addresses=[<the lines of ") for word in program)
    refused = subprocess.run(["bash", "launch/slurm/ppo.sbatch", "--dry-run", "--nodelist", "gpu[01-02]",
                              "--rollout-nodes", "2", YAML], cwd=REPO, env=clean, capture_output=True, text=True)
    assert refused.returncode == 2 and "--rollout-nodes 2 needs more nodes than that" in refused.stderr


def test_ray_puts_rollout_servers_on_nodes_of_their_own():
    config = RayLaunchConfig(program_args=(YAML,), num_workers=16, workers_per_node=8, rollout_nodes=1)
    config.validate()
    lines = dry_run_lines(config, python="python")
    assert lines[2] == "placement_group 2: strategy=STRICT_PACK bundles=[{'CPU': 1.0, 'GPU': 8.0}]"
    assert lines[3] == ("rollout node 0 on <node of group 2>: TRIDENT_ROLLOUT_API_KEY=<generated for this job> python -m "
                        f"launch.rollout_servers {YAML} --address-file '<node-local addresses file>' "
                        "--log-dir '<node-local logs>'")
    ranks = [line for line in lines if line.startswith("rank ")]
    assert len(ranks) == 16 and all("TRIDENT_ROLLOUT_API_KEY=<generated for this job>" in line for line in ranks)
    assert shlex.split(ranks[0])[-2:] == ["actor_rollout_ref.rollout.mode=disaggregated",
                                          "actor_rollout_ref.rollout.server_addresses=[<the rollout nodes' servers>]"]
    with pytest.raises(RayLaunchError, match="excludes --rollout-gpus"):
        RayLaunchConfig(program_args=(YAML,), num_workers=6, rollout_gpus=2, rollout_nodes=1).validate()


def test_ray_cluster_script_dry_run():
    lines = run("bash", "launch/ray/start_cluster_in_slurm.sh", "--dry-run", "--nodelist", "n[1-3]", "--",
                "python", "-m", "launch.ray_launcher", YAML, "--num-gpus", "24").splitlines()
    starts = [shlex.split(line) for line in lines if line.startswith("srun ")]
    assert [words[4] for words in starts] == ["n1", "n2", "n3"]
    assert "--head" in starts[0] and all("--address=<ip of n1>:6379" in words for words in starts[1:])
    assert lines[-1].startswith("RAY_ADDRESS=") and shlex.split(lines[-1])[1:4] == ["python", "-m", "launch.ray_launcher"]


def test_hostlist_expansion():
    assert expand_hostlist("node[01-03,10],gpu-a[1-2]-ib[0-1],login") == [
        "node01", "node02", "node03", "node10", "gpu-a1-ib0", "gpu-a1-ib1", "gpu-a2-ib0", "gpu-a2-ib1", "login"]
    with pytest.raises(HostlistError, match="node\\[3-1\\]"):
        expand_hostlist("node[3-1]")


def test_ray_rank_environments_follow_nodes_then_gpus():
    placements = [WorkerPlacement("10.0.0.2", ("1",)), WorkerPlacement("10.0.0.2", ("0",)),
                  WorkerPlacement("10.0.0.3", ("5",)), WorkerPlacement("10.0.0.3", ("4",))]
    envs = rank_environments(placements, 31000)
    assert [e["RANK"] for e in envs] == ["1", "0", "3", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["1", "0", "1", "0"]
    assert [e["NODE_RANK"] for e in envs] == ["0", "0", "1", "1"]
    assert {e["MASTER_ADDR"] for e in envs} == {"10.0.0.2"} and {e["MASTER_PORT"] for e in envs} == {"31000"}
    # LOCAL_RANK indexes CUDA_VISIBLE_DEVICES, as under torchrun
    for env, placement in zip(envs, placements):
        assert env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])] == placement.gpu_ids[0]


def test_ray_dry_run_and_placement_validation():
    config = RayLaunchConfig(program_args=(YAML, *OVERRIDES), num_workers=16, workers_per_node=8)
    lines = dry_run_lines(config, python="python")
    assert lines[0].startswith("placement_group 0: strategy=STRICT_PACK") and lines[1].startswith("placement_group 1")
    assert len([line for line in lines if line.startswith("rank ")]) == 16
    assert "RANK=9 WORLD_SIZE=16 LOCAL_RANK=1 LOCAL_WORLD_SIZE=8 NODE_RANK=1" in lines[2 + 9]
    assert lines[-1].endswith(shlex.join(["python", "-m", "launch.main", YAML, *OVERRIDES]))
    with pytest.raises(RayLaunchError, match="not a multiple"):
        RayLaunchConfig(program_args=(YAML,), num_workers=12, workers_per_node=8).validate()
    assert len(RayLaunchConfig(program_args=(YAML,), num_workers=12, placement_strategy="PACK").placement_groups()) == 1


def test_ray_reserves_rollout_gpus_on_the_trainers_node():
    config = RayLaunchConfig(program_args=(YAML,), num_workers=6, workers_per_node=8, rollout_gpus=2)
    config.validate()
    assert [len(group) for group in config.placement_groups()] == [8]
    lines = dry_run_lines(config, python="python")
    ranks = [line for line in lines if line.startswith("rank ")]
    assert len(ranks) == 6 and "LOCAL_WORLD_SIZE=6" in ranks[0]
    assert ranks[0].endswith("actor_rollout_ref.rollout.mode=disaggregated actor_rollout_ref.rollout.num_gpus=2 "
                             "trainer.n_gpus_per_node=6")
    # The held GPUs follow the trainer's on their node, so the trainer finds them at LOCAL_WORLD_SIZE..
    placements = [WorkerPlacement("10.0.0.2", (str(gpu),)) for gpu in (3, 0, 1, 2)]
    envs = rank_environments(placements, 31000, rollout=WorkerPlacement("10.0.0.2", ("6", "7")))
    assert {env["CUDA_VISIBLE_DEVICES"] for env in envs} == {"0,1,2,3,6,7"}
    with pytest.raises(RayLaunchError, match="for servers on nodes of their own use --rollout-nodes"):
        RayLaunchConfig(program_args=(YAML,), num_workers=8, workers_per_node=8, rollout_gpus=2).validate()


FAKE_SRUN = '''#!/usr/bin/env python3
"""A stand-in for Slurm's srun on one machine: `bash -c PAYLOAD` once per node of --nodelist (or
--nodes copies of localhost), with SLURM_NODEID and SLURMD_NODENAME set as srun sets them and each
task's output in --output (%n: the node index); forwards SIGTERM to the tasks as srun does."""
import os, signal, subprocess, sys
args, options = sys.argv[1:], {}
while args[0].startswith("--"):
    key, _, value = args.pop(0).partition("=")
    options[key] = value
assert args[:2] == ["bash", "-c"], args
nodes = options["--nodelist"].split(",") if "--nodelist" in options else ["localhost"] * int(options["--nodes"])
tasks = []
for index, node in enumerate(nodes):
    output = open(options["--output"].replace("%n", str(index)), "a")
    env = {**os.environ, "SLURM_NODEID": str(index), "SLURMD_NODENAME": node}
    tasks.append(subprocess.Popen(["bash", "-c", args[2]], env=env, stdout=output, stderr=subprocess.STDOUT))
signal.signal(signal.SIGTERM, lambda *_: [task.terminate() for task in tasks])
sys.exit(next((code for code in [task.wait() for task in tasks] if code), 0))
'''


@pytest.mark.slow
def test_slurm_rollout_nodes_run_for_real_with_a_stand_in_srun(tmp_path):
    """ppo.sbatch --rollout-nodes 1, not a dry run: the allocation is this machine twice over
    (srun is a stand-in, Slurm is not installed): the rollout node's servers start, their address
    reaches the trainers, two PPO steps run against them, and the servers stop with the job."""
    pytest.importorskip("sglang")
    from parallel.state import find_free_port

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TRIDENT_ROLLOUT"))},
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "rollout-nodes",
           "SLURM_JOB_NODELIST": "localhost,localhost", "SLURM_GPUS_ON_NODE": "2", "TRIDENT_RUN_ROOT": str(tmp_path),
           "TRIDENT_RDZV_PORT": str(find_free_port()), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    job = subprocess.run(
        ["bash", "launch/slurm/ppo.sbatch", "--rollout-nodes", "1", "yaml/demo_cpu.yaml",
         "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.gpu_memory_utilization=0.05",
         "actor_rollout_ref.rollout.check_weight_sync=true", "trainer.total_training_steps=2", "trainer.test_freq=-1",
         "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.export_hf_at_end=false"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    run_dir = tmp_path / "rollout-nodes-5"
    logs = "\n".join(path.read_text() for path in sorted((run_dir / "logs").glob("*.log")))
    assert job.returncode == 0, f"{job.stdout[-3000:]}\n{job.stderr[-3000:]}\n{logs[-6000:]}"
    addresses = (run_dir / "rollout" / "addresses-localhost").read_text().split()
    assert len(addresses) == 1 and not addresses[0].startswith("127.")
    rows = [json.loads(line) for line in (run_dir / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["rollout/log_prob_abs_diff"] < 1e-4 for row in rows)
    assert f"rollout server(s) on nodes of their own: {addresses[0]}" in logs
    server_log = (run_dir / "rollout" / "localhost" / "sglang_server0.log").read_text()
    assert "'api_key': '<redacted>'" in server_log
    deadline = time.monotonic() + 60  # the servers stop with the job: nothing of this job is left
    while processes_with(f"TRIDENT_RUN_ROOT={tmp_path}\0"):
        assert time.monotonic() < deadline, processes_with(f"TRIDENT_RUN_ROOT={tmp_path}\0")
        time.sleep(1)
