"""Multi-node rehearsal on one machine: two `launch/torchrun.sh --nnodes 2` launchers on loopback.

Each "node" runs one rank; with training TP2 every tensor-parallel collective and the weight sync
(generation TP1: each rank's engine needs the shard the other node holds) cross the node
boundary. The same layout on one node (one torchrun with 2 ranks) must give the same numbers.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from parallel.state import find_free_port
from tests.distributed import REPO_ROOT, read_metrics, run_main_job

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3
COMMON = [f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1", "trainer.test_freq=-1",
          "trainer.val_before_train=false", "trainer.export_hf_at_end=false",
          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "critic.megatron.tensor_model_parallel_size=2"]
COMPARED = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm",
            "actor/reward_kl_penalty", "critic/vf_loss", "critic/grad_norm", "rollout/log_prob_abs_diff"]


def test_two_node_rehearsal_matches_one_node(demo_model, tmp_path):
    one_node = tmp_path / "one_node"
    run_main_job("yaml/demo_cpu.yaml", [f"trainer.default_local_dir={one_node}", *COMMON])

    two_nodes = tmp_path / "two_nodes"
    endpoint = f"127.0.0.1:{find_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    nodes = [
        subprocess.Popen(
            ["bash", "launch/torchrun.sh", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
             "--rdzv-endpoint", endpoint, "--rdzv-id", f"rehearsal-{os.getpid()}", "yaml/demo_cpu.yaml",
             f"trainer.default_local_dir={two_nodes}", "trainer.nnodes=2", "trainer.n_gpus_per_node=1", *COMMON],
            cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)
    ]
    outputs = []
    try:
        for process in nodes:
            outputs.append(process.communicate(timeout=600)[0])
    finally:
        for process in nodes:
            process.kill()
    for node, (process, output) in enumerate(zip(nodes, outputs)):
        assert process.returncode == 0, f"node {node} failed:\n{output[-6000:]}"
    assert "[trident] done after 3 steps" in "".join(outputs)

    single = {row["step"]: row for row in read_metrics(one_node)}
    double = {row["step"]: row for row in read_metrics(two_nodes)}
    assert sorted(double) == sorted(single) == list(range(1, STEPS + 1))
    for step in single:
        for key in COMPARED:
            assert double[step][key] == pytest.approx(single[step][key], rel=1e-6, abs=1e-9), (step, key)
