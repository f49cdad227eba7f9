"""The memory choreography of a colocated run, and a record of it.

Colocated, a GPU holds a training rank and (part of) an SGLang server, two processes that take
turns with the same memory (the anchors agree on the order; slime's ``train.py``, verl's
``rollout_mode``):

- **start** (``components.build_components``): the engine starts first and releases everything
  (weights, KV cache, CUDA graphs), then the training models are built. SGLang sizes its KV pool as
  a fraction of the memory free *when it starts* (``--mem-fraction-static``), so an engine started
  next to resident training models gets a fraction of what is left, or fails to start.
- **every step** (``ppo_trainer``): generate, release everything; train; then hand the training
  ranks' cached memory back (``hand_back_cache`` on every rank: PyTorch's caching allocator keeps
  the blocks of the last phase's peak, which the engine, another process, cannot map), resume the
  weights, push them (the cache handed back after each bucket the engine took), resume the KV cache
  and CUDA graphs.

Each operation is recorded in the rank's log as one line of the ``trident.memory`` logger,
``memory: {"event": ...}`` (``record``), so the order a run took can be read back from it
(``read_events``). Servers on devices of their own keep their memory; nothing is released there.
"""
from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("trident.memory")
_PREFIX = "memory: "


def record(event: str, **details: Any) -> None:
    """One memory operation of this rank, in the order it happens (``read_events`` reads them back)."""
    logger.info("%s%s", _PREFIX, json.dumps({"event": event, **details}, sort_keys=True))


def hand_back_cache(reason: str) -> None:
    """Give this process's cached device memory back to the driver: garbage first (cycles holding
    tensors), then PyTorch's allocator cache, then the CUDA IPC handles the engine has closed
    (slime collects them after every bucket: each handle pins its block until collected). Without
    CUDA there is no allocator cache to hand back, and the garbage pass alone costs ~0.35 s of CPU
    per rank and step (a full collection over megatron's and transformers' objects): only the
    record is kept."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.ipc_collect()
    record("hand_back_cache", reason=reason)


def hand_back_bucket() -> None:
    """After the engine took a weight bucket: its CUDA IPC handles and blocks back to the driver
    (slime's ``update_weight_from_tensor``; no garbage pass, this runs once per bucket)."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


def read_events(log_file: str | Path) -> list[dict[str, Any]]:
    """The memory events of one rank's log (``<run>/logs/rank_<r>.log``), in order."""
    events = []
    for line in Path(log_file).read_text(errors="replace").splitlines():
        start = line.find(_PREFIX + "{")  # after the logger's name, "trident.memory: "
        if start >= 0:
            events.append(json.loads(line[start + len(_PREFIX):]))
    return events
