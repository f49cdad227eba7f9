"""The CPU adaptation of megatron-core: active only without CUDA (its sequence-parallel norm
allowance: without transformer-engine), and megatron really runs on it."""

import json
import subprocess
import sys

import pytest

from tests.distributed import REPO_ROOT, run_torchrun

_GPU_PATH_PROBE = r"""
import importlib.util, sys
import torch
torch.cuda.is_available = lambda: True          # the availability checks are mocked, nothing else
find_spec = importlib.util.find_spec
with_te = sys.argv[1] == "with-te"
importlib.util.find_spec = lambda name, *a: (find_spec("torch") if with_te else None) if name == "transformer_engine" \
    else find_spec(name, *a)
original_current_device = torch.cuda.current_device
from megatron.core.tensor_parallel import random as megatron_random
original_tracker = megatron_random.CudaRNGStatesTracker
from megatron.core.transformer import torch_norm
original_norm_new = torch_norm.WrappedTorchNorm.__new__
original_matmul = torch.matmul

from parallel import cpu_compat, state
assert cpu_compat.activate() is False
assert not cpu_compat.is_active()
assert torch.cuda.current_device is original_current_device
assert megatron_random.CudaRNGStatesTracker is original_tracker
# megatron's local norm refuses sequence parallelism (TE's does not): allowed where TE is missing
assert (torch_norm.WrappedTorchNorm.__new__ is original_norm_new) == with_te
assert torch.matmul is original_matmul
assert torch._C._len_torch_function_stack() == 0
assert state.backend() == "nccl"
print("GPU-PATH-UNTOUCHED")
"""


@pytest.mark.parametrize("transformer_engine", ["with-te", "without-te"])
def test_adaptation_is_inactive_when_cuda_is_available(transformer_engine):
    result = subprocess.run(
        [sys.executable, "-c", _GPU_PATH_PROBE, transformer_engine], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "GPU-PATH-UNTOUCHED" in result.stdout


_CPU_PATH_PROBE = r"""
import torch
original_matmul, original_tensor_matmul = torch.matmul, torch.Tensor.__matmul__
from parallel import cpu_compat
assert cpu_compat.activate() is True and cpu_compat.activate() is True  # idempotent
assert torch.zeros(2, device="cuda").device.type == "cpu"
assert torch.ones(1).cuda().device.type == "cpu"
assert torch.ones(1).to("cuda:0").device.type == "cpu"
assert torch.ones(2).new_empty(0).shape == (0,)        # a positional size, not a CUDA ordinal
assert torch.ones(2).new_empty((3,), device="cuda").device.type == "cpu"
assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
assert torch.ones(1).type() == "torch.cuda.FloatTensor"
assert torch.ones(1).type("torch.cuda.HalfTensor").dtype == torch.float16
# 16-bit products run as fp32 products rounded back: within one bf16 rounding of the float64
# product (torch's own bf16 kernel sums in another order, so ~5% of such products differ from it
# by one ulp somewhere; equality with it is not the property).
a, b = torch.randn(32, 64).bfloat16(), torch.randn(64, 48).bfloat16()
exact = a.double() @ b.double()
assert (a @ b).dtype == torch.bfloat16 and torch.allclose((a @ b).double(), exact, rtol=2**-8, atol=1e-5)
assert torch.equal(a @ b, (a.float() @ b.float()).bfloat16())
assert torch.nn.functional.linear(a, b.t()).dtype == torch.bfloat16
# The model's forward pass and the backward step run without the mode (no per-call dispatch); the
# unfused softmax, which builds its masks on "cuda", has it back.
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
from megatron.core.models.gpt.gpt_model import GPTModel
stack_depth = lambda: torch._C._len_torch_function_stack()
assert stack_depth() == 1 and cpu_compat.without_device_rewriting(stack_depth)() == 0
assert cpu_compat.without_device_rewriting(cpu_compat._with_device_rewriting(stack_depth))() == 1
patched = lambda: [hasattr(f, "__wrapped__") for f in (GPTModel.forward, FusedScaleMaskSoftmax.forward_torch_softmax)]
assert patched() == [True, True]
cpu_compat.deactivate()
assert patched() == [False, False]
assert torch.matmul is original_matmul and torch.Tensor.__matmul__ is original_tensor_matmul
assert not cpu_compat.is_active()
assert torch._C._len_torch_function_stack() == 0
assert torch.ones(1).type() == "torch.FloatTensor"
print("CPU-PATH-OK")
"""


def test_adaptation_maps_cuda_to_cpu_and_undoes_cleanly():
    result = subprocess.run(
        [sys.executable, "-c", _CPU_PATH_PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "CPU-PATH-OK" in result.stdout


_GLOO_THREADS_PROBE = r"""
from pathlib import Path
from parallel.layout import ParallelLayout
from parallel.state import initialize_model_parallel
initialize_model_parallel(ParallelLayout())
import torch.distributed as dist
from megatron.core import parallel_state
groups = [parallel_state.get_tensor_model_parallel_group(), parallel_state.get_data_parallel_group(),
          parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_model_parallel_group()]
for group in groups:
    dist.barrier(group=group)
names = [p.read_text().strip() for p in Path("/proc/self/task").glob("*/comm")]
print("IO-THREADS", names.count("gloo_tcp_loop"), len(set(map(id, groups))))
"""


def test_gloo_groups_share_one_io_thread():
    """Each gloo device polls every 10 ms; megatron's ~20 groups must not bring ~20 such threads."""
    result = subprocess.run(
        [sys.executable, "-c", _GLOO_THREADS_PROBE], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("IO-THREADS"))
    threads, distinct_groups = map(int, line.split()[1:])
    assert distinct_groups == 4 and threads == 1, line


@pytest.mark.dist
def test_megatron_trains_on_cpu_and_tensor_parallel_matches_single_rank(tmp_path):
    """Real megatron-core layers, schedule and distributed optimizer: TP2 (+SP) == TP1 in fp32.

    TP shards of a CPU-initialised master weight are the TP1 weights, so losses and grad norms of
    three Adam steps must agree; a pipeline layout must at least train with finite numbers.
    """
    runs = {
        "tp1": (1, []),
        "tp2_sp": (2, ["--tp", "2", "--sp"]),
        "tp2_pp2": (4, ["--tp", "2", "--pp", "2"]),
    }
    values = {}
    for name, (nproc, args) in runs.items():
        out = tmp_path / f"{name}.json"
        run_torchrun("smoke_megatron.py", nproc, [*args, "--out", str(out)])
        values[name] = json.loads(out.read_text())["values"]
    assert values["tp2_sp"] == pytest.approx(values["tp1"], rel=1e-5)
    assert all(v == v and abs(v) < 1e3 for v in values["tp2_pp2"])  # finite
    assert values["tp1"][4] < values["tp1"][0]  # the loss went down: the optimizer stepped
