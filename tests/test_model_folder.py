"""The staged, locked model-folder write that the SmolLM2 conversion and the demo model build share."""

import multiprocessing
import time

import pytest

from engine.models.model_folder import exclusive_lock, staged_folder


def test_a_failed_build_keeps_the_previous_folder_and_leaves_no_staging(tmp_path):
    out = tmp_path / "model"
    with staged_folder(out) as staging:
        (staging / "weights").write_text("v1")
    with pytest.raises(RuntimeError):
        with staged_folder(out) as staging:
            (staging / "weights").write_text("half")
            raise RuntimeError("crash mid-build")
    assert (out / "weights").read_text() == "v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_finished_build_replaces_the_folder(tmp_path):
    out = tmp_path / "model"
    for version in ("v1", "v2"):
        with staged_folder(out) as staging:
            (staging / "weights").write_text(version)
    assert [p.name for p in out.iterdir()] == ["weights"] and (out / "weights").read_text() == "v2"


def _hold_lock(out, seconds, ready):
    with exclusive_lock(out):
        ready.set()
        time.sleep(seconds)


def test_the_lock_makes_a_second_builder_wait(tmp_path):
    out = tmp_path / "model"
    ready = multiprocessing.Event()
    holder = multiprocessing.Process(target=_hold_lock, args=(out, 1.0, ready))
    holder.start()
    assert ready.wait(30)
    started = time.monotonic()
    with exclusive_lock(out):
        waited = time.monotonic() - started
    holder.join(30)
    assert waited > 0.5
