"""The device is decided once, at start (``parallel.device``): a machine whose driver shows GPUs that
CUDA cannot use stops with one line, it never falls back to the CPU unasked (issue 45, defect 1:
``parallel/state.py`` ``device``/``backend`` and ``engine/rollout/sglang_cpu.py``
``needs_cpu_adaptation`` all read ``torch.cuda.is_available()``, so a failed CUDA start used to mean a
silent gloo + CPU-engine run)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from parallel import device
from tests.distributed import REPO_ROOT

FAKE_NVIDIA_SMI = """#!/bin/sh
# nvidia-smi of an 8-GPU node with driver {driver}
case "$1" in
  -L) for i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 80GB HBM3 (UUID: GPU-0000000$i)"; done ;;
  --query-gpu=driver_version) for i in 0 1 2 3 4 5 6 7; do echo "{driver}"; done ;;
  *) exit 1 ;;
esac
"""


@pytest.fixture
def gpu_node_with_driver(tmp_path, monkeypatch):
    """This machine as a GPU node whose driver is ``driver`` (an ``nvidia-smi`` first on PATH); CUDA
    still cannot initialise here, as on a node whose driver is too old for torch's CUDA."""
    def make(driver: str) -> dict[str, str]:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "nvidia-smi").write_text(FAKE_NVIDIA_SMI.format(driver=driver))
        (bin_dir / "nvidia-smi").chmod(0o755)
        path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
        monkeypatch.setenv("PATH", path)
        monkeypatch.setattr(device, "_CHOICE", [])
        return {**os.environ, "PATH": path}
    return make


@pytest.fixture
def undecided(monkeypatch):
    monkeypatch.setattr(device, "_CHOICE", [])


def test_gpus_that_cuda_cannot_use_stop_the_job_in_one_line(gpu_node_with_driver, tmp_path):
    """``python -m launch.main`` on a node whose driver (535) is older than torch's CUDA 13.0 needs
    (580): exit status 2, one line naming the driver, torch's CUDA, the driver to install and the key
    for the CPU; no traceback, nothing started."""
    env = gpu_node_with_driver("535.104.05")
    result = subprocess.run([sys.executable, "-m", "launch.main", "yaml/demo_cpu.yaml", "trainer.n_gpus_per_node=1",
                             f"trainer.default_local_dir={tmp_path / 'run'}"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("[trident] error")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "8 NVIDIA GPU(s)" in errors[0] and "535.104.05" in errors[0]
    assert f"CUDA {torch.version.cuda}" in errors[0] and "R580" in errors[0] and "trainer.device=cpu" in errors[0]
    assert not (tmp_path / "run").exists()  # stopped before the run directory, logs or any rank's work


def test_asking_for_the_cpu_runs_there_on_a_gpu_node(gpu_node_with_driver, monkeypatch):
    """``trainer.device=cpu``: the CPU on purpose, and every later CUDA question in this process and
    its children answers no (CUDA_VISIBLE_DEVICES emptied before CUDA starts)."""
    gpu_node_with_driver("535.104.05")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # restored after the test
    choice = device.decide("cpu")
    assert (choice.kind, choice.driver, choice.why) == ("cpu", "535.104.05", "trainer.device=cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert device.decide("auto") is choice  # decided once: a later call cannot change it
    assert "device: cpu, gloo (trainer.device=cpu)" == choice.banner()


def test_a_new_enough_driver_whose_cuda_fails_still_stops(gpu_node_with_driver):
    gpu_node_with_driver("580.65.06")
    with pytest.raises(device.DeviceError, match=r"driver 580\.65\.06\) but CUDA cannot initialise"):
        device.decide("auto")


def test_a_cpu_only_torch_on_a_gpu_node_says_so(gpu_node_with_driver, monkeypatch):
    gpu_node_with_driver("580.65.06")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(device.DeviceError, match="CPU-only build: install torch built for CUDA"):
        device.decide("auto")


def test_no_gpu_machine_is_the_cpu_and_cuda_asked_of_it_stops(undecided, monkeypatch):
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # no nvidia-smi
    monkeypatch.setattr(device, "DRIVER_VERSION_FILE", device.Path("/nonexistent/nvidia/version"))
    monkeypatch.setenv(device.NVML_CHECK, "1")  # a preload's setting, which NVML would answer
    with pytest.raises(device.DeviceError, match="trainer.device=cuda, but this machine has no NVIDIA GPU"):
        device.decide("cuda")
    assert device.NVML_CHECK not in os.environ  # unset before CUDA is asked, whatever the answer
    choice = device.decide("auto")
    assert (choice.kind, choice.why) == ("cpu", "no NVIDIA GPU on this machine")
    monkeypatch.setattr(device, "_CHOICE", [])
    with pytest.raises(device.DeviceError, match="trainer.device='gpu'"):
        device.decide("gpu")


@pytest.mark.parametrize("torch_cuda, minimum, driver, older", [
    ("13.0", "580", "575.57.08", True), ("13.0", "580", "580.65.06", False), ("12.8", "525.60", "525.60.13", False),
    ("12.4", "525.60", "470.82.01", True), (None, None, None, None),
])
def test_minimum_driver_per_cuda_major(torch_cuda, minimum, driver, older):
    assert device.minimum_driver(torch_cuda) == minimum
    if driver is not None:
        assert device._older(driver, minimum) == older


def test_the_driver_version_is_read_from_the_kernel_module(tmp_path, monkeypatch):
    version_file = tmp_path / "version"
    version_file.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
                            "(dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 09:42:39 UTC 2025\nGCC version:  gcc 12\n")
    monkeypatch.setattr(device, "DRIVER_VERSION_FILE", version_file)
    assert device.driver_version() == "580.95.05"
    version_file.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    assert device.driver_version() == "535.104.05"


# launch.main with its process-group start replaced by a record of the environment at that moment.
RECORD_AT_PROCESS_GROUP_START = """
import json, os, sys
import parallel.state

def record(*args, **kwargs):
    names = ("NCCL_CUMEM_ENABLE", "PYTORCH_NVML_BASED_CUDA_CHECK")
    with open(sys.argv[1], "w") as out:
        json.dump({name: os.environ.get(name) for name in names}, out)
    raise SystemExit(0)

parallel.state.initialize_model_parallel = record
import launch.main
sys.exit(launch.main.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("users_cumem, expected_cumem", [(None, "0"), ("1", "1")])
def test_a_rank_starts_its_process_groups_with_nccl_cumem_off_and_without_nvml(demo_model, tmp_path, users_cumem,
                                                                                expected_cumem):
    """Issue 45, defects 1 and 7: when a rank's process groups start (``launch.main.run``), the NVML
    check a preload set is gone (``PYTORCH_NVML_BASED_CUDA_CHECK``, ``engine/preload.py``) and
    ``NCCL_CUMEM_ENABLE`` is 0 as SGLang's is (slime/ray/actor_group.py:65-67), unless the user set it."""
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    env.pop("NCCL_CUMEM_ENABLE", None)
    if users_cumem is not None:
        env["NCCL_CUMEM_ENABLE"] = users_cumem
    record = tmp_path / "environment.json"
    result = subprocess.run([sys.executable, "-c", RECORD_AT_PROCESS_GROUP_START, str(record), "yaml/demo_cpu.yaml",
                             "trainer.n_gpus_per_node=1", f"trainer.default_local_dir={tmp_path / 'run'}"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(record.read_text()) == {"NCCL_CUMEM_ENABLE": expected_cumem,
                                              "PYTORCH_NVML_BASED_CUDA_CHECK": None}
