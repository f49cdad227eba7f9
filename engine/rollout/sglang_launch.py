"""``python -m engine.rollout.sglang_launch ARGS``: ``sglang.launch_server ARGS`` with two additions,
each switched on by the environment the server is started with (``engine.rollout.sglang_server``).

- ``TRIDENT_ROLLOUT_API_KEY``: the API key goes into SGLang's arguments inside the process, not on
  the command line. A key on the command line is readable by every user of the node
  (``/proc/<pid>/cmdline``, ``ps``), and SGLang 0.5 logs its ``server_args`` with ``api_key`` in
  clear; here its start-up log shows ``<redacted>`` in its place.
- ``TRIDENT_SGLANG_UNPINNED_HOST=1`` (set on CPU only, by ``engine.rollout.sglang_cpu``): SGLang's
  host buffers (the routed-experts capture of ``--enable-return-routed-experts``, the LoRA layers'
  offsets and adapter pool of ``--enable-lora``) are allocated in plain memory: it pins them with
  ``cudaHostRegister`` or ``pin_memory=True``, which need CUDA. The CPU stand-in for pinned
  memory; nothing else changes.
- ``TRIDENT_SGLANG_FORK=1`` (set on CPU only, by ``engine.rollout.sglang_cpu``): SGLang's scheduler
  and detokenizer processes are forked from the launcher, which has already imported SGLang, instead
  of spawned. SGLang forces the ``spawn`` start method because CUDA cannot be forked; a spawned
  child imports SGLang and torch again, ~6 s of CPU each. Measured on the 2-core machine, one TP1
  server of the demo model: ready in 11 s with 9 s of CPU forked, 18 s with 21 s of CPU spawned
  (TP2: 13 s / 13 s against 23 s / 33 s); the same greedy tokens and log-probs.
"""
from __future__ import annotations

import multiprocessing
import os
import runpy
import sys

API_KEY_ENV = "TRIDENT_ROLLOUT_API_KEY"
FORK_ENV = "TRIDENT_SGLANG_FORK"
UNPINNED_HOST_ENV = "TRIDENT_SGLANG_UNPINNED_HOST"


def _redact_api_key(key: str) -> None:
    from sglang.srt.entrypoints import engine

    log_view = engine._server_args_for_logging  # the dict SGLang logs as server_args=...

    def redacted(server_args):
        return {**log_view(server_args), "api_key": "<redacted>"}

    engine._server_args_for_logging = redacted
    sys.argv += ["--api-key", key]


def _fork_subprocesses() -> None:
    """SGLang's ``mp.set_start_method("spawn", force=True)`` selects ``fork`` instead."""
    set_start_method = multiprocessing.set_start_method

    def fork_instead(method=None, force=False):
        set_start_method("fork", force=True)

    multiprocessing.set_start_method = fork_instead


def _unpinned_host_memory() -> None:
    """SGLang's host-buffer allocator for ``cpu``, without ``cudaHostRegister``."""
    import torch
    from sglang.srt.mem_cache.pool_host import common

    def allocate(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):
        return allocator.allocate(dims, dtype=dtype, device=device)

    common.ALLOC_MEMORY_FUNCS["cpu"] = allocate
    # Its LoRA layers and adapter pool pin their host copies the same way (``pin_memory=True``).
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    for factory in ("tensor", "empty", "zeros"):
        setattr(torch, factory, _unpinned(getattr(torch, factory)))


def _unpinned(factory):
    import functools

    @functools.wraps(factory)
    def unpinned(*args, pin_memory=False, **kwargs):
        return factory(*args, **kwargs)
    return unpinned


def main() -> None:
    sys.argv = ["sglang.launch_server", *sys.argv[1:]]
    key = os.environ.get(API_KEY_ENV)
    if key:
        _redact_api_key(key)
    if os.environ.get(FORK_ENV) == "1":
        _fork_subprocesses()
    if os.environ.get(UNPINNED_HOST_ENV) == "1":
        _unpinned_host_memory()
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
