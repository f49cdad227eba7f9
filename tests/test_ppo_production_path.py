"""The production path on CPU: schema-default precision (bf16) through the whole PPO loop, and the
colocated memory hand-off between the rollout engine and training, on the real embedded engine."""
from __future__ import annotations

import json
import math

import pytest

from engine.config import ExperimentConfig, load_config
from engine.sync import expected_log_prob_gap
from tests import memory_events
from tests.distributed import read_metrics, run_main_job, run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3


def schema_default(path: str):
    value = ExperimentConfig()
    for part in path.split("."):
        value = getattr(value, part)
    return value


@pytest.fixture(scope="module")
def watched_run(demo_model, tmp_path_factory):
    """2 ranks of the PPO loop at the schema's precision, every engine call, memory event and
    control-plane collective recorded (tests/dist_workers/ppo_memory_handoff.py); a checkpoint at
    the end, so the checkpoint's barriers are among them."""
    # The schema's own defaults, written out because yaml/demo_cpu.yaml pins fp32 and left-aligned
    # rows for speed on CPU. (The critic's precision, optimizer and layout default to the actor's.)
    defaults = {key: schema_default(key) for key in (
        "actor_rollout_ref.actor.megatron.param_dtype", "actor_rollout_ref.rollout.dtype",
        "actor_rollout_ref.actor.megatron.use_distributed_optimizer", "actor_rollout_ref.model.use_remove_padding")}
    assert set(defaults.values()) == {"bfloat16", True}
    defaults.update({"critic.megatron.param_dtype": "bfloat16", "critic.megatron.use_distributed_optimizer": True,
                     # gradients leave the device between updates: the save must not bring them back
                     "actor_rollout_ref.actor.megatron.grad_offload": True, "critic.megatron.grad_offload": True})
    out_dir = tmp_path_factory.mktemp("watched")
    run_torchrun("ppo_memory_handoff.py", 2, [
        str(out_dir / "calls.json"), *(f"{key}={value}" for key, value in defaults.items()),
        f"trainer.default_local_dir={out_dir / 'run'}", f"trainer.total_training_steps={STEPS}", "trainer.save_freq=-1",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.export_hf_at_end=false"], timeout=900)
    return out_dir, defaults


def test_bf16_ppo_with_the_memory_hand_off_in_order(watched_run):
    out_dir, defaults = watched_run
    out, run_dir = out_dir / "calls.json", out_dir / "run"
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm"):
            assert math.isfinite(row[key]), (key, row)
        # bf16 keeps 8 bits of mantissa: the HF engine and megatron's layers round differently.
        assert row["rollout/log_prob_abs_diff"] < expected_log_prob_gap("bfloat16"), row["rollout/log_prob_abs_diff"]
        # Per-phase peak memory is reported for the planner to be checked against.
        assert all(row[f"perf/max_rss_gb/{phase}"] > 0 for phase in ("gen", "update_actor", "update_weights"))

    calls = json.loads(out.read_text())["calls"]
    sync = [["engine.resume_memory", ["weights"]], ["engine.begin_weight_update"], ["engine.push_weights"],
            ["engine.end_weight_update"], ["engine.resume_memory", ["cuda_graph", "kv_cache"]]]
    step = [["engine.generate"], ["engine.release_memory", ["cuda_graph", "kv_cache", "weights"]],
            ["train.compute_old_log_probs", 0], ["train.compute_ref_log_probs", 0], ["train.compute_values", 0],
            ["train.update_critic", 0], ["train.update_policy", 0], *sync]
    # The start-up sync (the engine was started released), then per step: generate, release, train
    # with no engine weights resident, resume weights, push, resume the KV cache and CUDA graphs; the
    # engine shuts down at the end.
    assert calls == sync + step * STEPS + [["engine.shutdown"]], calls
    # Each rank's own record of it (engine.rollout.memory): the engine started and released before any
    # model was built, the cache handed back on every rank before each resume.
    config = load_config("yaml/demo_cpu.yaml", [f"{key}={value}" for key, value in defaults.items()], world_size=2)
    memory_events.check_run(config, {rank: out_dir / f"memory_rank_{rank}.log" for rank in range(2)}, steps=STEPS)


def test_the_checkpoint_is_saved_while_the_engine_sleeps_without_gradients(watched_run):
    """Issue 45, defect 4 (``engine/trainer/ppo_trainer.py``'s save after ``update_weights``, and
    ``engine/trainer/components.py:66-73`` bringing offloaded gradients back for it): the last step's
    save comes after the engine released its KV cache and CUDA graphs and before any rank hands its
    cache back for the engine to resume, with each model's weights and optimizer state resident and
    its offloaded gradients left on the host (slime's ``train.py``: save, then update weights)."""
    from engine.rollout.memory import read_events
    from tests.memory_events import PLACEMENT_EVENTS

    out_dir, _ = watched_run
    recorded = read_events(out_dir / "memory_rank_0.log")
    phases = [event["name"] for event in recorded[:[e["event"] for e in recorded].index("save")] if event["event"] == "phase"]
    assert phases[-1] == "save", phases  # in the planner's save phase (engine.trainer.phases)
    leader = [event for event in recorded if event["event"] not in PLACEMENT_EVENTS]
    saves = [index for index, event in enumerate(leader) if event["event"] == "save"]
    assert len(saves) == 1, leader
    before, after = leader[saves[0] - 1], leader[saves[0] + 1]
    assert before == {"event": "release", "tags": ["weights", "kv_cache", "cuda_graph"]}, before
    assert after["event"] == "hand_back_cache" and leader[saves[0] + 2] == {"event": "resume", "tags": ["weights"]}
    assert leader[saves[0]]["resident"] == {"actor": ["params", "optimizer"], "critic": ["params", "optimizer"]}


def test_every_control_plane_wait_of_the_loop_is_on_a_gloo_control_group(watched_run):
    """The run recorded every barrier and object collective Trident's own code made (start-up,
    rollout gathers, reward scoring, the checkpoint at the end): each ran on a control-plane group
    (gloo, created with trainer.collective_timeout_minutes, which the worker checks), none on the
    default group or an NCCL one, whatever the device. megatron-core's own collectives are not counted."""
    out_dir, _ = watched_run
    for rank in range(2):
        records = json.loads((out_dir / f"collectives_rank_{rank}.json").read_text())
        callers = {record["caller"] for record in records}
        # The places that wait on other ranks are all there: the check is not vacuous.
        assert {"engine.trainer.components", "engine.trainer.rollout", "engine.rewards.spmd",
                "engine.trainer.checkpoint", "parallel.hybrid_engine.dataflow"} <= callers, callers
        off_plane = [record for record in records if not record["control"] or record["backend"] != "gloo"]
        assert not off_plane, off_plane


def test_fp16_trains_with_dynamic_loss_scaling(demo_model, tmp_path):
    """fp16 works as megatron trains it: fp32 main weights and a dynamic loss scale."""
    run_dir = tmp_path / "run"
    run_main_job("yaml/demo_cpu.yaml", [
        *(f"{key}=float16" for key in ("actor_rollout_ref.actor.megatron.param_dtype", "critic.megatron.param_dtype",
                                       "actor_rollout_ref.rollout.dtype")),
        "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=2",
        "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.export_hf_at_end=false"], nproc=1)
    rows = read_metrics(run_dir)
    assert len(rows) == 2
    for row in rows:
        assert row["actor/loss_scale"] >= 1 and row["critic/loss_scale"] >= 1
        assert 0 <= row["actor/skipped_step_fraction"] < 1
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        # fp16 keeps 3 more mantissa bits than bf16: the gap measured ~0.001.
        assert row["rollout/log_prob_abs_diff"] < expected_log_prob_gap("float16")
