"""Checkpoints: resume equivalence, resharding, atomicity, keep-last-K, resume modes.

The distributed part runs tests/dist_workers/ckpt_worker.py twice on 2 ranks (a reference run
that saves, then a fresh world that resumes); the file-level rules run in-process.
"""

import json

import pytest
import torch

from engine.trainer.checkpoint import (
    LATEST_FILE,
    METADATA_FILE,
    CheckpointError,
    CheckpointManager,
    latest_checkpoint,
    list_checkpoints,
    resolve_resume_checkpoint,
)
from tests.distributed import run_torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ckpt")
    out = workdir / "out"
    out.mkdir()
    phases = {"reference": 2, "dp1": 1, "resume": 2}  # ranks; dp1 reads step_2 before resume prunes it
    for phase, ranks in phases.items():
        run_torchrun("ckpt_worker.py", ranks, ["--phase", phase, "--workdir", str(workdir), "--out", str(out)], timeout=300)
    return {phase: torch.load(out / f"{phase}.pt", weights_only=False) for phase in phases}


def _max_weight_difference(a, b):
    return max((a[model][name] - b[model][name]).abs().max().item() for model in a for name in a[model])


@pytest.mark.dist
def test_resume_continues_exactly_like_uninterrupted_training(runs):
    reference, resumed = runs["reference"], runs["resume"]
    assert resumed["resumed_from"].endswith("step_2")
    # Steps 3 and 4 after a resume in a fresh world (different seed) vs. the same steps uninterrupted:
    # distributed Adam at DP2, fp32, warmup LR schedule -> bit-exact.
    assert resumed["losses"] == reference["losses"][2:]
    assert _max_weight_difference(reference["weights"], resumed["weights"]) == 0.0
    # megatron-core 0.16.1 shares one Adam `step` tensor between params after load (it would read
    # 2 + 2 x number of params here); each param must count its own 4 steps.
    assert resumed["adam_steps_after_load"] == [2.0] * len(resumed["adam_steps_after_load"])
    assert resumed["adam_steps"] == reference["adam_steps"] == [4.0] * len(reference["adam_steps"])


@pytest.mark.dist
def test_an_async_save_writes_the_tensors_as_they_were_when_it_began(runs):
    """trainer.checkpoint.async_save: every weight was overwritten right after save() returned (the
    writer still at work); the shards are byte for byte the synchronous save's of the same state,
    and the checkpoint was not complete (no ``latest``) until the writers were done."""
    reference = runs["reference"]
    assert reference["async_latest_before_close"] is None and reference["async_path"].endswith("step_2")
    sync, written = reference["sync_manifest"], reference["async_manifest"]
    shards = [name for name in sync if name.endswith(".distcp")]
    assert len(shards) >= 4 and {name: written.get(name) for name in shards} == {name: sync[name] for name in shards}


@pytest.mark.dist
def test_resume_restores_extra_state_and_rng(runs):
    resumed = runs["resume"]
    assert resumed["extra"] == {"global_step": 2, "kl_controller": {"type": "fixed", "value": 0.1},
                                "sampler": {"epoch": 0, "index": 2}}
    assert torch.equal(resumed["rand_after_load"], runs["reference"]["rand_after_save"])


@pytest.mark.dist
def test_checkpoint_saved_at_tp2_loads_into_tp1(runs):
    reference = runs["reference"]
    assert _max_weight_difference(reference["tp2_weights"], reference["tp1_weights"]) == 0.0
    # The TP1 model started from different random weights; after loading it computes the same losses.
    assert reference["tp1_eval_before_load"]["actor"] != pytest.approx(reference["tp2_eval"]["actor"], rel=1e-3)
    for model in ("actor", "critic"):
        assert reference["tp1_eval"][model] == pytest.approx(reference["tp2_eval"][model], rel=1e-6)
        # The optimizer state was resharded too: one more step gives the same training and eval loss.
        assert reference["tp1_step3"][model] == pytest.approx(reference["tp2_step3"][model], rel=1e-6)
        assert reference["tp1_eval_after_step3"][model] == pytest.approx(reference["tp2_eval_after_step3"][model], rel=1e-5)
    assert reference["tp1_adam_steps"] == [3.0] * len(reference["tp1_adam_steps"])


@pytest.mark.dist
def test_the_optimizer_is_saved_by_shard_and_resumes_at_another_data_parallel_size(runs):
    """Issue 45, defect 6 (``engine/trainer/checkpoint.py:70`` saved ``fully_reshardable``, which
    all-gathers the Adam state to every DP rank, distrib_optimizer.py:1404-1470): the default is
    ``dp_reshardable``, each rank's shard of the buckets as it is. Saved at DP2 with three gradient
    buckets per buffer, it resumes at DP1 and trains on as the uninterrupted DP2 run did."""
    reference, dp1 = runs["reference"], runs["dp1"]
    assert dp1["format"] == "dp_reshardable" and dp1["resumed_from"].endswith("step_2")
    assert all(len(buckets) >= 3 for model in dp1["grad_buckets"].values() for buckets in model)
    assert dp1["adam_steps_after_load"] == [2.0] * len(dp1["adam_steps_after_load"])
    assert dp1["adam_steps"] == [4.0] * len(dp1["adam_steps"])
    for resumed, uninterrupted in zip(dp1["losses"], reference["losses"][2:]):
        assert resumed == pytest.approx(uninterrupted, rel=1e-5)


@pytest.mark.dist
def test_formats_that_cannot_hold_the_state_are_refused_by_name(runs):
    """dp_reshardable is tied to its tensor-parallel layout: loaded at TP1 from TP2 it stops with the
    way out, before reading a byte (the fully_reshardable copy of the same state loads, above).
    fully_reshardable with several buckets would be saved wrong by megatron-core 0.16.1
    (distrib_optimizer.py:1112-1118 vs 1479-1501): refused before anything is written."""
    reference = runs["reference"]
    message = reference["tp1_refused_dp_reshardable"]
    assert "saved as dp_reshardable" in message and "tensor_model_parallel_size (2 saved, 1 here)" in message
    assert "trainer.checkpoint.optimizer_format=fully_reshardable" in message
    message = reference["refused_fully_reshardable"]
    assert "several gradient buckets" in message and "NVIDIA/Megatron-LM#5077" in message
    assert "actor" in message and "critic" in message and not reference["dp2_full_written"]


@pytest.mark.dist
def test_keep_last_k_and_crash_mid_save(runs):
    resumed = runs["resume"]
    assert resumed["after_keep2"] == [3, 4]  # step_2 deleted after step_4 was saved (max_ckpt_to_keep=2)
    assert resumed["crash_raised"]
    # The crash left step_5.tmp behind; the pointer and auto-resume still name step_4 and it loads.
    assert resumed["tmp_left"] == ["latest", "step_3", "step_4", "step_5.tmp"]
    assert resumed["latest_after_crash"].endswith("step_4")
    assert resumed["resume_after_crash"].endswith("step_4")
    assert resumed["extra_after_crash"] == {"global_step": 4}
    assert resumed["reload_same_weights"]
    # The next successful save replaces the leftover and prunes to the newest two.
    assert resumed["after_resave"] == ["latest", "step_4", "step_5"]


# ---- file-level rules (no torch.distributed) ------------------------------------------------

def _fake_checkpoint(checkpoints_dir, step, complete=True):
    path = checkpoints_dir / f"step_{step}"
    path.mkdir(parents=True)
    if complete:
        (path / METADATA_FILE).write_text(json.dumps({"format_version": 1, "step": step}))
    return path


def test_latest_follows_pointer_and_falls_back_to_newest_complete(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    _fake_checkpoint(tmp_path, 5)
    _fake_checkpoint(tmp_path, 10)
    _fake_checkpoint(tmp_path, 20, complete=False)  # no metadata: a save that died before the rename
    (tmp_path / "step_30.tmp").mkdir()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [5, 10]
    (tmp_path / LATEST_FILE).write_text("step_5\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_5"
    (tmp_path / LATEST_FILE).write_text("step_99\n")  # stale pointer
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10"


def test_resume_modes(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    assert resolve_resume_checkpoint(checkpoints, "auto") is None  # fresh run: nothing to resume
    step = _fake_checkpoint(checkpoints, 3)
    assert resolve_resume_checkpoint(checkpoints, "auto") == step
    assert resolve_resume_checkpoint(checkpoints, "disable") is None
    assert resolve_resume_checkpoint(tmp_path / "elsewhere", "resume_path", step) == step
    assert resolve_resume_checkpoint(tmp_path / "elsewhere", "resume_path", checkpoints) == step
    with pytest.raises(CheckpointError, match="resume_from_path=.*nope"):
        resolve_resume_checkpoint(checkpoints, "resume_path", tmp_path / "nope")
    with pytest.raises(CheckpointError, match="needs trainer.resume_from_path"):
        resolve_resume_checkpoint(checkpoints, "resume_path")
    with pytest.raises(CheckpointError, match="resume_mode must be one of"):
        resolve_resume_checkpoint(checkpoints, "latest")


def test_manager_rejects_bad_settings(tmp_path):
    with pytest.raises(ValueError, match="max_ckpt_to_keep"):
        CheckpointManager(tmp_path, max_ckpt_to_keep=0)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match="trident_checkpoint.json is missing"):
        manager.load(tmp_path / "step_1", {})


@pytest.mark.dist
def test_non_distributed_optimizer_round_trip(runs):
    reference = runs["reference"]
    # Saved after step 1, loaded into freshly seeded models: step 2 is the same as without the round trip.
    assert reference["plain_step2_after_load"] == reference["plain_step2"]


@pytest.mark.dist
def test_hf_export_of_the_actor(runs):
    resumed = runs["resume"]
    assert resumed["export"]["files"] == ["config.json", "model.safetensors"]
    exported, weights = resumed["export"]["tensors"], resumed["weights"]["actor"]
    assert sorted(exported) == sorted(weights)
    assert all(torch.equal(exported[name], weights[name]) for name in weights)
