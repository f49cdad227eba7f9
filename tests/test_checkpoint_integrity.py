"""Checkpoints that are damaged are found out: a manifest of every file's size and SHA-256, checked on
resume; a damaged latest checkpoint gives way to the previous one (said on the terminal), a damaged
``resume_from_path`` stops the run with one line; a save the disk cannot hold stops before writing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.trainer.checkpoint import (
    LATEST_FILE,
    MANIFEST_KEY,
    METADATA_FILE,
    CheckpointError,
    CheckpointManager,
    CheckpointTarget,
    checkpoint_problems,
)
from engine.trainer.checkpoint import _manifest as manifest_of
from tests.distributed import REPO_ROOT, read_metrics


def fake_checkpoint(checkpoints, step, files):
    path = checkpoints / f"step_{step}"
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(content)
    metadata = {"format_version": 1, "step": step, MANIFEST_KEY: manifest_of(path)}
    (path / METADATA_FILE).write_text(json.dumps(metadata))
    (checkpoints / LATEST_FILE).write_text(f"step_{step}\n")
    return path


def test_the_manifest_finds_a_truncated_a_changed_and_a_missing_file(tmp_path):
    path = fake_checkpoint(tmp_path, 1, {"actor/__0_0.distcp": b"x" * 100, "actor/common.pt": b"y" * 10,
                                         "rng/rank_00000.pt": b"z"})
    manifest = json.loads((path / METADATA_FILE).read_text())[MANIFEST_KEY]
    assert sorted(manifest) == ["actor/__0_0.distcp", "actor/common.pt", "rng/rank_00000.pt"]
    assert manifest["actor/__0_0.distcp"][0] == 100 and len(manifest["actor/__0_0.distcp"][1]) == 64
    assert checkpoint_problems(path) == []
    (path / "actor/__0_0.distcp").write_bytes(b"x" * 60)
    (path / "actor/common.pt").write_bytes(b"Y" * 10)  # same size, other bytes
    (path / "rng/rank_00000.pt").unlink()
    assert checkpoint_problems(path) == ["actor/__0_0.distcp has 60 bytes, the manifest says 100",
                                         "actor/common.pt does not match its SHA-256 in the manifest",
                                         "rng/rank_00000.pt is missing"]
    (path / METADATA_FILE).write_text("{not json")
    assert "is not valid JSON" in checkpoint_problems(path)[0]


def test_auto_resume_skips_damaged_checkpoints_and_resume_path_refuses_them(tmp_path):
    manager = CheckpointManager(tmp_path)
    first = fake_checkpoint(tmp_path, 1, {"a": b"1" * 8})
    second = fake_checkpoint(tmp_path, 2, {"a": b"2" * 8})
    third = fake_checkpoint(tmp_path, 3, {"a": b"3" * 8})
    assert manager.resolve_resume("auto") == third
    (third / "a").write_bytes(b"3")
    (second / "a").unlink()
    assert manager.resolve_resume("auto") == first
    with pytest.raises(CheckpointError, match=r"resume_from_path: .*step_3 is damaged \(a has 1 bytes"):
        manager.resolve_resume("resume_path", third)
    (first / "a").write_bytes(b"x" * 8)
    with pytest.raises(CheckpointError, match="no checkpoint in .* checks out: .*step_3.*step_2.*step_1"):
        manager.resolve_resume("auto")


def test_a_save_the_disk_cannot_hold_stops_before_writing(tmp_path):
    previous = fake_checkpoint(tmp_path, 1, {"a": b"1"})
    metadata = json.loads((previous / METADATA_FILE).read_text())
    metadata[MANIFEST_KEY] = {"a": [2**60, "0" * 64]}  # the last checkpoint took an exabyte
    (previous / METADATA_FILE).write_text(json.dumps(metadata))
    with pytest.raises(CheckpointError, match=r"not enough disk space for checkpoint .*step_2: [\d.]+ GiB free .*"
                                              r"needs about [\d.]+ GiB"):
        CheckpointManager(tmp_path).save(2, {"actor": CheckpointTarget(model_chunks=[])})
    assert not (tmp_path / "step_2.tmp").exists() and not (tmp_path / "step_2").exists()


@pytest.mark.dist
def test_a_truncated_shard_in_the_latest_checkpoint(demo_model, tmp_path):
    """The trident command on the demo: 2 steps saving each; step_2's largest actor shard cut short.
    Resuming from it by path is one error line; auto-resume goes back to step_1, says so, and
    trains steps 2 and 3."""
    run_dir = tmp_path / "run"

    def trident(*overrides):
        return subprocess.run([sys.executable, "-m", "launch.cli", "yaml/demo_cpu.yaml",
                               f"trainer.default_local_dir={run_dir}", "trainer.save_freq=1", "trainer.test_freq=-1",
                               "trainer.val_before_train=false", "trainer.export_hf_at_end=false", *overrides],
                              cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                              text=True, timeout=600)

    first = trident("trainer.total_training_steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = run_dir / "checkpoints"
    shard = max((checkpoints / "step_2" / "actor").glob("*.distcp"), key=lambda path: path.stat().st_size)
    size = shard.stat().st_size
    os.truncate(shard, size // 2)

    refused = trident("trainer.total_training_steps=3", "trainer.resume_mode=resume_path",
                      f"trainer.resume_from_path={checkpoints / 'step_2'}")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.count("[trident] error") == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert (f"step_2 is damaged (actor/{shard.name} has {size // 2} bytes, the manifest says {size})"
            in refused.stderr), refused.stderr[-3000:]

    resumed = trident("trainer.total_training_steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (f"[trident] resuming from {checkpoints / 'step_1'}, the newest checkpoint that checks out: "
            f"{checkpoints / 'step_2'} is damaged (actor/{shard.name} has {size // 2} bytes") in resumed.stdout
    assert f"[trident] resumed from {checkpoints / 'step_1'} (step 1)" in resumed.stdout
    # metrics.jsonl drops the rows after the checkpoint resumed from: step 2 is the retrained one.
    assert [row["step"] for row in read_metrics(run_dir) if "actor/pg_loss" in row] == [1, 2, 3]
    assert checkpoint_problems(checkpoints / "step_2") == []  # saved again, whole
