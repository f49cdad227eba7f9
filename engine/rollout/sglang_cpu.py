"""Everything the SGLang backend does differently when the machine has no GPU. Nothing else.

On a GPU the server command of ``engine.rollout.sglang_server`` is used as it is; this module only adds to it
when ``torch.cuda.is_available()`` is False:

- ``SGLANG_USE_CPU_ENGINE=1`` and ``--device cpu``: SGLang's CPU model runner.
- ``TRIDENT_SGLANG_FORK=1``: the server's scheduler and detokenizer are forked from its launcher
  instead of spawned (``engine.rollout.sglang_launch``; CUDA is why SGLang spawns them), which saves
  re-importing SGLang and torch in each: 9 s instead of 21 s of CPU per TP1 server start.
- ``TRIDENT_SGLANG_UNPINNED_HOST=1``: SGLang's host buffers in plain memory (it pins them with
  ``cudaHostRegister`` or ``pin_memory=True``); the routed-experts capture and the LoRA layers and
  adapter pool need them (``engine.rollout.sglang_launch``).
- ``--attention-backend torch_native`` and ``--lora-backend torch_native``: the other backends need
  CUDA or AMX kernels.
- ``--disable-overlap-schedule``: the overlap scheduler assumes CUDA streams.
- ``launch/install/cpu_standins`` on ``PYTHONPATH``: a stand-in ``sgl_kernel`` (no kernels, no torch
  ops registered) so SGLang's imports succeed and it falls back to plain-torch layers.
- a KV-pool cap (``--max-total-tokens``) when none is given: the memory fraction would otherwise
  be taken of host RAM, shared with the trainer.
- ``--mem-fraction-static`` raised to at least 0.5: on CPU SGLang sizes the KV pool as free host
  RAM after loading minus ``(1 - fraction)`` x free RAM before loading, so a small fraction fails
  start-up (measured) whenever other processes allocate meanwhile; ``--max-total-tokens`` still
  caps the pool.
- ``SGLANG_NCCL_SO_PATH`` pointing at no library: the CUDA build of torch ships ``libnccl``, and
  with it SGLang's CPU engine starts a PyNccl communicator for TP > 1 and fails ("Expected a cuda
  device"); without the library it keeps to its gloo groups, as on a machine without CUDA wheels.
- inside the server, while the sharded weight push loads a bucket (``engine.rollout.sglang_presharded``):
  the CPU branch of SGLang 0.5.23's linear-layer weight loaders offsets a rank-local (pre-sharded)
  weight by the rank's start, so TP rank 1 finds no rows to copy; its fused-MoE loader has the fix
  (``# Pre-sharded CPU weights are rank-local; do not apply the TP offset again``), which
  ``rank_local_presharded_weights`` applies to the linear layers too, for the duration of the load.
- no ``/release_memory_occupation`` / ``/resume_memory_occupation`` requests: SGLang 0.5.23's
  handler calls ``torch.cuda.synchronize()`` and takes the CPU scheduler down (measured), and
  there is no accelerator memory to give back on CPU anyway.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from engine.rollout.sglang_launch import FORK_ENV, UNPINNED_HOST_ENV

CPU_STANDINS_DIR = Path(__file__).resolve().parents[2] / "launch" / "install" / "cpu_standins"
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
CPU_MIN_MEM_FRACTION_STATIC = 0.5
NO_NCCL_LIBRARY = "trident-cpu-has-no-nccl.so"  # dlopen fails on it, so SGLang disables PyNccl


def needs_cpu_adaptation() -> bool:
    """True when SGLang must run its CPU engine (no usable GPU in this process)."""
    return not torch.cuda.is_available()


def memory_occupation_control_supported() -> bool:
    """Whether the server's release/resume-memory endpoints may be called (not on CPU, see above)."""
    return not needs_cpu_adaptation()


def adapt_server_for_cpu(args: list[str], env: dict[str, str], tensor_model_parallel_size: int) -> tuple[list[str], dict[str, str]]:
    """Return the server arguments and environment with the CPU-only additions."""
    if not (CPU_STANDINS_DIR / "sgl_kernel" / "__init__.py").is_file():
        raise FileNotFoundError(f"the CPU sgl_kernel stand-in is missing: expected {CPU_STANDINS_DIR}/sgl_kernel/")
    args = list(args) + ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
                         "--lora-backend", "torch_native"]
    if "--mem-fraction-static" in args:
        index = args.index("--mem-fraction-static") + 1
        args[index] = str(max(float(args[index]), CPU_MIN_MEM_FRACTION_STATIC))
    if "--max-total-tokens" not in args:
        args += ["--max-total-tokens", str(CPU_DEFAULT_MAX_TOTAL_TOKENS)]
    env = dict(env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env[FORK_ENV] = "1"
    env[UNPINNED_HOST_ENV] = "1"
    env["SGLANG_NCCL_SO_PATH"] = NO_NCCL_LIBRARY
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_STANDINS_DIR), env.get("PYTHONPATH", "")) if p)
    if tensor_model_parallel_size > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
        # One core per TP rank (SGLang's CPU engine binds OpenMP threads per rank).
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(rank) for rank in range(tensor_model_parallel_size))
    return args, env


@contextlib.contextmanager
def rank_local_presharded_weights():
    """On CPU: SGLang's linear layers read a pre-sharded weight from row 0 (see the module docstring)."""
    if torch.cuda.is_available():
        yield
        return
    from sglang.srt.model_loader import weight_utils

    narrow = weight_utils.narrow_padded_param_and_loaded_weight

    def rank_local(param_data, loaded_weight, param_data_start, weight_start, dim, shard_size, narrow_weight=True):
        return narrow(param_data, loaded_weight, param_data_start, weight_start if narrow_weight else 0, dim,
                      shard_size, narrow_weight)

    weight_utils.narrow_padded_param_and_loaded_weight = rank_local
    try:
        yield
    finally:
        weight_utils.narrow_padded_param_and_loaded_weight = narrow
