"""Training checkpoints: megatron-core distributed checkpoints of every trained model, written atomically.

Layout of ``checkpoints_dir`` (one run's ``checkpoints/``)::

    latest                      text file naming the newest complete checkpoint ("step_40")
    step_40/
        trident_checkpoint.json  written last (before the rename): step, models, layouts, time, and
                                 the manifest: every other file's size and SHA-256
        actor/                   megatron dist_checkpointing folder: model chunks, optimizer, LR scheduler
        critic/
        extra_state.pt           the caller's plain dict (KL controller, data sampler, global step ...)
        rng/rank_00000.pt        python / numpy / torch / CUDA / megatron-TP RNG states of each rank
    step_50.tmp/                 a save in progress (or one that crashed): never read, removed later

A save writes into ``step_N.tmp/``; after a barrier rank 0 renames it to ``step_N/`` and replaces
``latest`` with ``os.replace`` (both atomic on POSIX file systems), so a crash at any point leaves
the previous checkpoint complete and pointed to. Only then are checkpoints beyond the newest
``max_ckpt_to_keep`` deleted. With ``async_save`` (megatron-core's asynchronous distributed save)
``save`` returns once every rank's tensors are set aside and a background process writes them;
``finalize`` (collective, called at every step boundary) completes the checkpoint (manifest,
rename, ``latest``, pruning) once every rank's writer is done; one save is in flight at most.
Before writing, the free space of the file system is checked against the size the checkpoint
will take (the previous one's, or the models' tensors for the first).

A resume checks the chosen checkpoint against its manifest (the ranks hash the files between them).
A damaged one (a truncated or changed shard, a missing file) is skipped for the newest older one
that checks out, and the terminal says which and why; ``resume_mode=resume_path`` naming a damaged
checkpoint stops with that message instead.

Model weights are stored in model space (one tensor per parameter, whole across tensor/pipeline/data
parallelism), so they load into a different TP/PP/VPP/DP layout than they were saved from:
megatron's dist_checkpointing reads each rank's new shard. The distributed optimizer's state is
stored in one of two megatron formats (``trainer.checkpoint.optimizer_format``):

- ``dp_reshardable`` (the default, Megatron-LM's): each rank writes its own shard of the optimizer's
  gradient buckets as they are, with no gather and no copy. It loads at any data- or context-parallel
  size, but only at the saved tensor/pipeline/expert layout and gradient buckets
  (``BUCKET_LAYOUT_KEYS``; ``load`` refuses anything else by name, before reading a byte).
- ``fully_reshardable``: the state is all-gathered over data parallelism and stored per parameter,
  so it loads at any layout; the gather holds the whole model-parallel shard's Adam state on every
  data-parallel rank (host memory: about 16 bytes per parameter of the shard, ~48 GB per rank for 8B
  at TP2) and copies it one parameter at a time. megatron-core 0.16.1 misplaces the state of every
  gradient bucket after the first in this format (``get_parameter_state_dp_zero`` packs buckets
  without their end padding, ``sharded_param_state_fully_reshardable`` slices with it:
  distrib_optimizer.py:1112-1118 vs 1479-1501; fixed upstream by NVIDIA/Megatron-LM#5077), so a
  model with several buckets is refused in it (:func:`optimizer_format_problem`).

The format a checkpoint was saved in is read from its ``trident_checkpoint.json`` at load, as
Megatron-LM reads it from the checkpoint's content metadata (``training/checkpointing.py``). The
distributed optimizer's own default (``fully_sharded_model_space``) fails on the CPU path
(``ShardedTensor.flattened_range is not supported``) and is deprecated upstream.

All ranks share one file system (dist_checkpointing requires it for multi-node jobs as well).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from engine.config.trainer import OPTIMIZER_FORMATS, RESUME_MODES
from engine.trainer.console import say
from parallel import cpu_compat
from parallel.state import control_group

logger = logging.getLogger(__name__)

LATEST_FILE = "latest"
METADATA_FILE = "trident_checkpoint.json"
EXTRA_STATE_FILE = "extra_state.pt"
RNG_DIR = "rng"
FORMAT_VERSION = 1
# What a dp_reshardable optimizer state is tied to: its tensors are the distributed optimizer's
# gradient buckets, keyed by model-parallel rank (distrib_optimizer.py:1539-1687, 1772-1783).
# Context parallelism only changes how many ranks share the buckets (megatron shards the optimizer
# over data x context parallel ranks), as the data-parallel size does.
BUCKET_LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                      "expert_tensor_parallel_size")
# What a checkpoint writes of a trained model: its weights and its optimizer's state. Gradients are
# zeroed before every mini-batch, so a save (and a load) leaves them where they are, offloaded or not.
CHECKPOINTED_PARTS = ("params", "optimizer")
MANIFEST_KEY = "files"  # in METADATA_FILE: relative path -> [size in bytes, SHA-256]
# A first save's size from its models' tensors: each trained element also has an fp32 main copy
# and Adam's two moments in the checkpoint; a margin covers the files' own headers and metadata.
OPTIMIZER_BYTES_PER_ELEMENT = 12
FREE_SPACE_MARGIN = 1.1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not fit this run; the message names it."""


@dataclass
class CheckpointTarget:
    """One trained model as the checkpoint sees it (the actor, the critic ...).

    Attributes:
        model_chunks: this rank's megatron model chunks (DDP-wrapped or not), one per virtual
            pipeline stage.
        optimizer: its megatron optimizer (``get_megatron_optimizer``), or None to store weights only.
        lr_scheduler: its ``OptimizerParamScheduler``, or None.
    """

    model_chunks: Sequence[torch.nn.Module]
    optimizer: Any = None
    lr_scheduler: Any = None


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier(group=control_group())  # rank 0 may be writing, renaming, pruning meanwhile


def _broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank (file-system views can lag on network file systems)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=control_group())
    return box[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _gathered(share: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's ``share``, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(share)
    shares: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(shares, share, group=control_group())
    return {key: value for part in shares for key, value in part.items()}


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _checkpoint_files(checkpoint_dir: Path) -> list[str]:
    """Every file of a checkpoint folder but its metadata, as sorted relative paths."""
    return sorted(str(path.relative_to(checkpoint_dir)) for path in checkpoint_dir.rglob("*")
                  if path.is_file() and path.name != METADATA_FILE and not path.name.startswith(f".{METADATA_FILE}"))


def _manifest(checkpoint_dir: Path) -> dict[str, list]:
    """Size and SHA-256 of every file (collective: rank r hashes files r, r + W, ...)."""
    files = _broadcast_from_rank0(_checkpoint_files(checkpoint_dir) if _rank() == 0 else None)
    share = {name: [(checkpoint_dir / name).stat().st_size, _sha256(checkpoint_dir / name)]
             for index, name in enumerate(files) if index % _world_size() == _rank()}
    return dict(sorted(_gathered(share).items()))


def checkpoint_problems(checkpoint_dir: str | Path) -> list[str]:
    """What is wrong with a complete checkpoint's files, by its manifest; empty when it checks out
    (collective where torch.distributed is initialised: the ranks hash the files between them)."""
    checkpoint_dir = Path(checkpoint_dir)
    manifest = None
    if _rank() == 0:
        try:
            manifest = read_checkpoint_metadata(checkpoint_dir).get(MANIFEST_KEY)
        except (CheckpointError, ValueError, OSError) as error:
            manifest = str(error)
    manifest = _broadcast_from_rank0(manifest)
    if isinstance(manifest, str):
        return [manifest]
    if manifest is None:  # written before checkpoints had manifests
        logger.warning("%s has no manifest: its files are not verified", checkpoint_dir)
        return []
    problems = {}
    for index, (name, (size, digest)) in enumerate(sorted(manifest.items())):
        if index % _world_size() != _rank():
            continue
        path = checkpoint_dir / name
        found = path.stat().st_size if path.is_file() else None
        if found is None:
            problems[name] = f"{name} is missing"
        elif found != size:
            problems[name] = f"{name} has {found} bytes, the manifest says {size}"
        elif _sha256(path) != digest:
            problems[name] = f"{name} does not match its SHA-256 in the manifest"
    return [problem for _, problem in sorted(_gathered(problems).items())]


# --------------------------------------------------------------------------------------------
# Finding checkpoints (plain file-system functions: no torch.distributed needed)
# --------------------------------------------------------------------------------------------

def is_complete_checkpoint(path: str | Path) -> bool:
    """True for a finished ``step_N`` folder (its metadata file is written last, before the rename)."""
    path = Path(path)
    return _STEP_DIR.match(path.name) is not None and (path / METADATA_FILE).is_file()


def list_checkpoints(checkpoints_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``checkpoints_dir`` as (step, path), oldest first."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for child in checkpoints_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and is_complete_checkpoint(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    """The checkpoint named by ``latest``; the newest complete one if the pointer is missing or stale."""
    checkpoints_dir = Path(checkpoints_dir)
    pointer = checkpoints_dir / LATEST_FILE
    if pointer.is_file():
        candidate = checkpoints_dir / pointer.read_text().strip()
        if is_complete_checkpoint(candidate):
            return candidate
        logger.warning("%s names %s, which is not a complete checkpoint; using the newest complete one",
                       pointer, candidate)
    found = list_checkpoints(checkpoints_dir)
    return found[-1][1] if found else None


def resolve_resume_checkpoint(
    checkpoints_dir: str | Path, resume_mode: str, resume_from_path: str | Path | None = None
) -> Path | None:
    """The checkpoint a run resumes from, or None to start fresh (``trainer.resume_mode``).

    ``auto``: the latest checkpoint in ``checkpoints_dir`` if there is one; ``disable``: none;
    ``resume_path``: ``resume_from_path``, either a ``step_N`` folder or a checkpoints folder
    (its latest checkpoint is used). Raises CheckpointError naming the path when it holds no
    complete checkpoint.
    """
    if resume_mode == "disable":
        return None
    if resume_mode == "auto":
        return latest_checkpoint(checkpoints_dir)
    if resume_mode == "resume_path":
        if resume_from_path is None:
            raise CheckpointError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        path = Path(resume_from_path)
        if is_complete_checkpoint(path):
            return path
        if path.is_dir() and (found := latest_checkpoint(path)) is not None:
            return found
        raise CheckpointError(
            f"trainer.resume_from_path={path} is not a complete checkpoint (a step_N folder with "
            f"{METADATA_FILE}) nor a folder containing one"
        )
    raise CheckpointError(f"trainer.resume_mode must be one of {RESUME_MODES}, got {resume_mode!r}")


def read_checkpoint_metadata(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The ``trident_checkpoint.json`` of a checkpoint (step, models, layouts at save time)."""
    path = Path(checkpoint_dir) / METADATA_FILE
    if not path.is_file():
        raise CheckpointError(f"{checkpoint_dir} is not a complete checkpoint: {METADATA_FILE} is missing")
    try:
        metadata = json.loads(path.read_text())
    except ValueError as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}): the checkpoint is damaged") from None
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {metadata.get('format_version')} is not {FORMAT_VERSION} (written by "
            "another Trident version)"
        )
    return metadata


# --------------------------------------------------------------------------------------------
# megatron-core 0.16.1 + torch.optim.Adam fallback: distributed-optimizer load bugs
# --------------------------------------------------------------------------------------------
#
# Without TE/apex (always on CPU, and on GPUs without them) megatron wraps ``torch.optim.Adam``
# and its DistributedOptimizer has three bugs on checkpoint load (megatron-core 0.16.1,
# distrib_optimizer.py ``state_dict`` / ``load_state_dict`` /
# ``_set_main_param_and_optimizer_states``):
#   1. ``sharded_state_dict(is_loading=True)`` calls ``state_dict()``, which asserts that all
#      params' Adam ``step`` values agree; a fresh optimizer has no state, so the set of steps is
#      empty and the assert fails (this is how every resume starts). The same happens when saving
#      an optimizer that has not stepped yet.
#   2. ``load_state_dict`` first gives every param state a ``step``, then loads the
#      ``fully_reshardable`` param state, whose tensors deliberately exclude ``step``; the copy
#      loop iterates over the destination's keys and raises KeyError 'step'.
#   3. ``load_state_dict`` puts ONE ``torch.tensor(step)`` object into every param's state; torch
#      Adam increments ``state['step']`` in place once per param, so after a resume the shared
#      counter advances by (number of params) per iteration and the bias correction 1 - beta^t
#      silently drifts away from an uninterrupted run.
# The two functions below are the whole workaround: a complete zero state for every param before
# building a save/load request (1), and loading the optimizer in two parts -- param groups first,
# then the param state with ``step`` set aside (2) -- after which every param gets its own ``step``
# tensor (3). They act only on torch.optim.Adam/AdamW inside DistributedOptimizers; TE/apex
# fused optimizers keep ``step`` in the param group and take megatron's own path.

def _torch_adam_of(part: Any) -> torch.optim.Optimizer | None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(part, DistributedOptimizer) and isinstance(part.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return part.optimizer
    return None


def _optimizer_parts(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


@torch.no_grad()
def _fill_missing_adam_state(optimizer: Any) -> None:
    """Workaround for bug 1 above: complete zero Adam state (step 0) for every param without one.

    Equivalent to a fresh state: torch Adam initialises exactly these values at its first step.
    """
    for part in _optimizer_parts(optimizer):
        adam = _torch_adam_of(part)
        if adam is None:
            continue
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                state.setdefault("step", torch.tensor(0.0, dtype=torch.float32))
                state.setdefault("exp_avg", torch.zeros_like(param, memory_format=torch.preserve_format))
                state.setdefault("exp_avg_sq", torch.zeros_like(param, memory_format=torch.preserve_format))


@torch.no_grad()  # dp_reshardable's load copies into fp32 models' own parameters (their main params)
def _load_optimizer_state(optimizer: Any, state_dict: Any) -> None:
    """``optimizer.load_state_dict(state_dict)``, with the workaround for bugs 2 and 3 above."""
    parts = _optimizer_parts(optimizer)
    if not any(_torch_adam_of(part) is not None for part in parts):
        optimizer.load_state_dict(state_dict)
        return
    # ChainedOptimizer stores a single optimizer's dict as is, several as {index: dict}.
    part_states = [state_dict] if len(parts) == 1 else [state_dict[index] for index in sorted(state_dict)]
    for part, part_state in zip(parts, part_states):
        adam = _torch_adam_of(part)
        sharding_type = part_state.get("param_state_sharding_type")
        if adam is None or sharding_type not in OPTIMIZER_FORMATS:
            part.load_state_dict(part_state)
            continue
        part_state = dict(part_state)
        param_state = part_state.pop("param_state")
        del part_state["param_state_sharding_type"]
        part.load_state_dict(part_state)  # param groups (lr, wd, the saved step) and grad scaler
        # dp_reshardable's entries carry the step the optimizer had before the load; set aside too
        steps = {param: state.pop("step") for param, state in adam.state.items()}
        getattr(part, f"load_parameter_state_from_{sharding_type}")(param_state)  # main params, exp_avg(_sq)
        for param, state in adam.state.items():
            state["step"] = steps[param].detach().clone()


# --------------------------------------------------------------------------------------------
# State dicts
# --------------------------------------------------------------------------------------------

def _unwrapped(model_chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """The GPTModels inside DDP / Float16Module wrappers: checkpoint keys must not depend on wrapping."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(model_chunks))


def _model_sharded_state_dict(model_chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    # Tensor keys are global layer names, so chunk boundaries (PP/VPP) may differ at load time.
    return {f"chunk{index}": _without_frozen(chunk.sharded_state_dict())
            for index, chunk in enumerate(_unwrapped(model_chunks))}


def _without_frozen(state: dict[str, Any]) -> dict[str, Any]:
    """Drop frozen parameters (LoRA's base weights, loaded from ``model.path`` at start-up): a
    checkpoint holds what trains (the adapters) and its optimizer state."""
    return {key: value for key, value in state.items()
            if not (isinstance(getattr(value, "data", None), torch.nn.Parameter) and not value.data.requires_grad)}


def _load_model_state(chunk: torch.nn.Module, state: dict[str, Any]) -> None:
    """``load_state_dict`` that accepts the absence of frozen parameters only."""
    result = chunk.load_state_dict(state, strict=False)
    frozen = {name for name, param in chunk.named_parameters() if not param.requires_grad}
    missing = [key for key in result.missing_keys if key not in frozen]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"checkpoint does not fit the model: missing {missing[:5]}, "
                              f"unexpected {result.unexpected_keys[:5]}")


def _target_sharded_state_dict(target: CheckpointTarget, *, is_loading: bool, with_optimizer: bool,
                               optimizer_format: str) -> dict[str, Any]:
    model_state = _model_sharded_state_dict(target.model_chunks)
    state: dict[str, Any] = {"model": model_state}
    if with_optimizer and target.optimizer is not None:
        _fill_missing_adam_state(target.optimizer)
        state["optimizer"] = target.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": optimizer_format},
        )
        if not is_loading:
            _zero_bucket_padding(state["optimizer"])
    if with_optimizer and target.lr_scheduler is not None:
        state["lr_scheduler"] = target.lr_scheduler.state_dict()
    return state


def _zero_bucket_padding(state: Any) -> None:
    """Zeros in the gaps between parameters of a dp_reshardable bucket, which megatron fills with
    ``torch.empty`` (distrib_optimizer.py:1632-1636): the same state then gives the same bytes (the
    asynchronous save's files equal the synchronous save's, and a manifest hash means the state)."""
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    if isinstance(state, dict):
        padding = state.get("padding")
        if isinstance(padding, LocalNonpersistentObject) and padding.obj:
            for value in state.values():
                if isinstance(value, ShardedTensor):
                    value.data.zero_()
            return
        values = state.values()
    elif isinstance(state, (list, tuple)):
        values = state
    else:
        return
    for value in values:
        _zero_bucket_padding(value)


def _layout_of_this_rank() -> dict[str, Any]:
    from megatron.core import parallel_state

    return {
        "world_size": _world_size(),
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "virtual_pipeline_model_parallel_size": parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        "context_parallel_size": parallel_state.get_context_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        "expert_model_parallel_size": parallel_state.get_expert_model_parallel_world_size(),
        "expert_tensor_parallel_size": parallel_state.get_expert_tensor_parallel_world_size(),
    }


def grad_buckets(target: CheckpointTarget) -> list[list[int]]:
    """Each gradient buffer's buckets (elements, without the end padding) of this rank's chunks of
    ``target``: what a dp_reshardable optimizer state is stored as. Empty without megatron's DDP."""
    buffers = [buffer for chunk in target.model_chunks
               for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]]
    return [[bucket.numel_unpadded for bucket in buffer.buckets] for buffer in buffers]


def optimizer_format_problem(optimizer_format: str, models: Mapping[str, CheckpointTarget]) -> str | None:
    """Why ``models`` cannot be saved in ``optimizer_format`` (one of ``OPTIMIZER_FORMATS``), or None
    (collective: every rank's buckets count, and every rank gets the same answer)."""
    if optimizer_format != "fully_reshardable":
        return None
    several = [name for name, target in models.items() if target.optimizer is not None
               and any(len(buckets) > 1 for buckets in grad_buckets(target))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, several, group=control_group())
        several = sorted({name for names in gathered for name in names})
    if not several:
        return None
    return (f"trainer.checkpoint.optimizer_format=fully_reshardable: the distributed optimizer of "
            f"{', '.join(several)} has several gradient buckets, and megatron-core 0.16.1 saves every bucket "
            "after the first at the wrong offsets in this format (distrib_optimizer.py:1112-1118 vs 1479-1501, "
            "fixed upstream by NVIDIA/Megatron-LM#5077); use trainer.checkpoint.optimizer_format=dp_reshardable "
            "(resumable at any data-parallel size)")


def capture_rng_state() -> dict[str, Any]:
    """This rank's RNG states: python, numpy, torch CPU, the current CUDA device, megatron's TP tracker."""
    from megatron.core import tensor_parallel

    numpy_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy's legacy state holds an ndarray; store it as a tensor so torch.load(weights_only) reads it.
        "numpy": (numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    tracker = tensor_parallel.get_cuda_rng_tracker()
    state["megatron_tracker"] = tracker.get_states() if tracker.is_initialized() else None
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of ``capture_rng_state``."""
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if state["megatron_tracker"] is not None:
        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _rng_file(checkpoint_dir: Path, rank: int) -> Path:
    return checkpoint_dir / RNG_DIR / f"rank_{rank:05d}.pt"


def _save_strategy(fully_parallel: bool):
    """dist_checkpointing's default writer; fully parallel spreads replicated shards over DP ranks."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = get_default_save_sharded_strategy()
    if not fully_parallel:
        return strategy
    return FullyParallelSaveStrategyWrapper(strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))


def _load_strategy(fully_parallel: bool, checkpoint_dir: Path):
    """The reader for ``checkpoint_dir``; fully parallel reads each replicated shard once per DP group."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy(str(checkpoint_dir))
    if not fully_parallel:
        return strategy
    return FullyParallelLoadStrategyWrapper(strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))


# --------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------

class CheckpointManager:
    """Saves, prunes and loads the checkpoints of one run (collective calls: every rank calls them).

    Args:
        checkpoints_dir: the run's ``checkpoints/`` folder (created if missing).
        max_ckpt_to_keep: keep only the newest this-many checkpoints; None keeps all
            (``trainer.max_ckpt_to_keep``).
        fully_parallel: spread dist_checkpointing writes and reads of replicated tensors over the
            data-parallel ranks (megatron's fully parallel strategies) instead of one writer per
            shard.
        async_save: write the model files in the background (``trainer.checkpoint.async_save``);
            the checkpoint is complete after ``finalize``.
    """

    def __init__(self, checkpoints_dir: str | Path, *, max_ckpt_to_keep: int | None = None,
                 fully_parallel: bool = True, async_save: bool = False,
                 optimizer_format: str = OPTIMIZER_FORMATS[0]) -> None:
        if max_ckpt_to_keep is not None and max_ckpt_to_keep < 1:
            raise ValueError(f"trainer.max_ckpt_to_keep must be >= 1 or null, got {max_ckpt_to_keep}")
        if optimizer_format not in OPTIMIZER_FORMATS:
            raise ValueError(f"trainer.checkpoint.optimizer_format must be one of {OPTIMIZER_FORMATS}, "
                             f"got {optimizer_format!r}")
        self.optimizer_format = optimizer_format
        self.checkpoints_dir = Path(checkpoints_dir)
        self.max_ckpt_to_keep = max_ckpt_to_keep
        self.fully_parallel = fully_parallel
        self.async_save = async_save
        self._async_queue = None  # dist-checkpointing's AsyncCallsQueue, made at the first async save

    # ---- save -------------------------------------------------------------------------------
    def save(self, step: int, models: Mapping[str, CheckpointTarget], extra_state: Mapping[str, Any] | None = None) -> Path:
        """Write checkpoint ``step_<step>`` of ``models`` plus ``extra_state`` (rank 0's plain dict:
        KL controller, sampler, counters; tensors, numbers, strings, lists, dicts). RNG states of
        every rank are added automatically. Returns the final folder, which holds the checkpoint
        on return, or with ``async_save`` once ``finalize`` has found the writers done."""
        from megatron.core import dist_checkpointing

        self.finalize(blocking=True)  # one save in flight at most
        if not models:
            raise ValueError("save() needs at least one model")
        for name in models:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == RNG_DIR:
                raise ValueError(f"model name {name!r} must be a plain folder name (letters, digits, _ . -), not {RNG_DIR!r}")
        problem = optimizer_format_problem(self.optimizer_format, models)
        if problem is not None:
            raise CheckpointError(problem)
        started = time.perf_counter()
        rng_state = capture_rng_state()  # the step boundary's, before the writers (and what they draw) start
        final_dir = self.checkpoints_dir / step_dir_name(step)
        tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
        self._check_free_space(final_dir, models)
        if _rank() == 0:
            if tmp_dir.exists():  # left by a crashed save of this step
                shutil.rmtree(tmp_dir)
            for name in models:
                (tmp_dir / name).mkdir(parents=True)
            (tmp_dir / RNG_DIR).mkdir()
        _barrier()

        layouts, requests = {}, []
        for name, target in models.items():
            state = _target_sharded_state_dict(target, is_loading=False, with_optimizer=True,
                                               optimizer_format=self.optimizer_format)
            requests.append(dist_checkpointing.save(state, str(tmp_dir / name), async_sharded_save=self.async_save,
                                                    sharded_strategy=_save_strategy(self.fully_parallel)))
            layouts[name] = _layout_of_this_rank()
        _write_rank_state(tmp_dir, rng_state, extra_state)
        metadata = {
            "format_version": FORMAT_VERSION, "step": step, "models": sorted(models), "layouts": layouts,
            "distributed_optimizer_format": self.optimizer_format,
            "grad_buckets": {name: grad_buckets(target) for name, target in models.items()},  # rank 0's
            "has_optimizer": {name: t.optimizer is not None for name, t in models.items()},
        }
        publish = partial(self._publish, tmp_dir, final_dir, metadata, started)
        if not self.async_save:
            publish()
            return final_dir
        # Each model's writer runs in the background; the last one's finalization (after the others',
        # in queue order) makes the checkpoint complete.
        requests[-1].add_finalize_fn(publish)
        if self._async_queue is None:
            self._async_queue = cpu_compat.async_checkpoint_queue()
        for request in requests:
            self._async_queue.schedule_async_request(request)
        logger.info("checkpoint %s: tensors set aside in %.1f s, written in the background", final_dir,
                    time.perf_counter() - started)
        return final_dir

    def finalize(self, blocking: bool = False) -> None:
        """Complete the asynchronous save in flight once every rank's writer is done (``blocking``:
        wait for them). Collective: call on every rank at the same points (each step boundary)."""
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=blocking)

    def close(self) -> None:
        """Complete any save in flight and stop the background writer (collective)."""
        if self._async_queue is not None:
            self._async_queue.close()
            # Its persistent worker's __del__ would close it again, after the process groups are gone.
            self._async_queue.persistent_caller = None
            self._async_queue = None

    def _publish(self, tmp_dir: Path, final_dir: Path, metadata: dict[str, Any], started: float) -> None:
        """Every rank's files are written: the manifest, the rename, ``latest``, pruning (collective)."""
        _barrier()  # every rank's files are on disk
        manifest = _manifest(tmp_dir)
        if _rank() == 0:
            metadata = {**metadata, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), MANIFEST_KEY: manifest}
            _write_text_atomically(tmp_dir / METADATA_FILE, json.dumps(metadata, indent=2))
            if final_dir.exists():  # re-saving a step (e.g. after resuming from an older one)
                shutil.rmtree(final_dir)
            os.rename(tmp_dir, final_dir)
            _fsync_dir(self.checkpoints_dir)
            _write_text_atomically(self.checkpoints_dir / LATEST_FILE, final_dir.name + "\n")
            self._prune(keep=final_dir)
        _barrier()
        seconds = time.perf_counter() - started
        logger.info("saved checkpoint %s in %.1f s", final_dir, seconds)
        say(f"[trident] checkpoint saved: {final_dir}"
            + (f" (written in the background, {seconds:.1f} s after the save began)" if self.async_save else ""))

    def _check_free_space(self, final_dir: Path, models: Mapping[str, CheckpointTarget]) -> None:
        """Stop before writing a checkpoint the file system cannot hold (collective): the size of
        the newest complete checkpoint, or for the first one its models' tensors."""
        previous_size = 0
        if _rank() == 0:
            previous = list_checkpoints(self.checkpoints_dir)
            if previous:
                manifest = read_checkpoint_metadata(previous[-1][1]).get(MANIFEST_KEY) or {}
                previous_size = sum(size for size, _ in manifest.values())
        previous_size = _broadcast_from_rank0(previous_size)
        expected = previous_size or _tensor_bytes(models)  # the tensors only when there is nothing to go by
        error = None
        if _rank() == 0:
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
            free, needed = shutil.disk_usage(self.checkpoints_dir).free, int(expected * FREE_SPACE_MARGIN)
            if free < needed:
                error = (f"not enough disk space for checkpoint {final_dir}: {free / 2**30:.2f} GiB free on "
                         f"{self.checkpoints_dir}'s file system, the checkpoint needs about {needed / 2**30:.2f} "
                         "GiB (free some space, point trainer.default_local_dir elsewhere or set "
                         "trainer.max_ckpt_to_keep)")
        error = _broadcast_from_rank0(error)
        if error is not None:
            raise CheckpointError(error)

    def _prune(self, keep: Path) -> None:
        """Delete checkpoints beyond the newest ``max_ckpt_to_keep`` and leftovers of crashed saves."""
        for child in self.checkpoints_dir.glob("step_*.tmp"):
            shutil.rmtree(child, ignore_errors=True)
        if self.max_ckpt_to_keep is None:
            return
        complete = [path for _, path in list_checkpoints(self.checkpoints_dir)]
        for path in complete[: max(0, len(complete) - self.max_ckpt_to_keep)]:
            if path != keep:
                logger.info("deleting old checkpoint %s (trainer.max_ckpt_to_keep=%d)", path, self.max_ckpt_to_keep)
                shutil.rmtree(path, ignore_errors=True)

    # ---- resume -----------------------------------------------------------------------------
    def resolve_resume(self, resume_mode: str, resume_from_path: str | Path | None = None) -> Path | None:
        """``resolve_resume_checkpoint`` decided on rank 0 and shared, so all ranks load the same one,
        then checked against its manifest: with ``auto`` a damaged checkpoint gives way to the
        newest older one that checks out (said on the terminal); with ``resume_path`` it is an error."""
        candidates = None
        error = None
        if _rank() == 0:
            try:
                choice = resolve_resume_checkpoint(self.checkpoints_dir, resume_mode, resume_from_path)
                candidates = [] if choice is None else [str(choice)]
                if choice is not None and resume_mode == "auto":  # then the older ones, newest first
                    latest_step = read_checkpoint_metadata(choice)["step"]
                    candidates += [str(path) for step, path in reversed(list_checkpoints(self.checkpoints_dir))
                                   if step < latest_step]
            except CheckpointError as err:
                error = str(err)
        candidates, error = _broadcast_from_rank0((candidates, error))
        if error is not None:
            raise CheckpointError(error)
        damaged = []
        for candidate in map(Path, candidates):
            problems = checkpoint_problems(candidate)
            if not problems:
                if damaged:
                    say(f"[trident] resuming from {candidate}, the newest checkpoint that checks out: "
                        + "; ".join(damaged))
                return candidate
            why = f"{candidate} is damaged ({problems[0]}" + (f", and {len(problems) - 1} more)" if len(problems) > 1 else ")")
            if resume_mode == "resume_path":
                raise CheckpointError(f"trainer.resume_from_path: {why}; resume from another checkpoint")
            damaged.append(why)
        if damaged:
            raise CheckpointError(f"no checkpoint in {self.checkpoints_dir} checks out: " + "; ".join(damaged)
                                  + " (move them away to start afresh, or set trainer.resume_mode=disable)")
        return None

    def load(self, checkpoint_dir: str | Path, models: Mapping[str, CheckpointTarget], *,
             load_optimizer: bool = True, load_rng: bool = True) -> dict[str, Any]:
        """Load ``models`` (any subset of the saved ones, in any parallel layout) from a checkpoint
        and return its extra state dict. Restores this rank's RNG states when the world size is
        the one saved (a resharded run keeps its fresh, seeded RNG)."""
        from megatron.core import dist_checkpointing

        checkpoint_dir = Path(checkpoint_dir)
        metadata = read_checkpoint_metadata(checkpoint_dir)
        missing = sorted(set(models) - set(metadata["models"]))
        if missing:
            raise CheckpointError(f"{checkpoint_dir} has no model(s) {missing}; it holds {metadata['models']}")
        started = time.perf_counter()
        for name, target in models.items():
            with_optimizer = load_optimizer and target.optimizer is not None
            if with_optimizer and not metadata["has_optimizer"].get(name, False):
                raise CheckpointError(f"{checkpoint_dir}/{name} was saved without optimizer state; "
                                      "load it with load_optimizer=False")
            saved, now = metadata["layouts"][name], _layout_of_this_rank()
            if saved != now:
                logger.info("resharding %s from %s to %s", name, saved, now)
            # saved before the key existed: megatron's fully_reshardable, the only format then
            optimizer_format = metadata.get("distributed_optimizer_format", "fully_reshardable")
            if with_optimizer and optimizer_format == "dp_reshardable":
                _check_bucket_layout(checkpoint_dir / name, saved, now, metadata.get("grad_buckets", {}).get(name), target)
            request = _target_sharded_state_dict(target, is_loading=True, with_optimizer=with_optimizer,
                                                 optimizer_format=optimizer_format)
            model_dir = checkpoint_dir / name
            loaded = dist_checkpointing.load(request, str(model_dir),
                                             sharded_strategy=_load_strategy(self.fully_parallel, model_dir))
            for index, chunk in enumerate(_unwrapped(target.model_chunks)):
                _load_model_state(chunk, loaded["model"][f"chunk{index}"])
            if with_optimizer:
                _load_optimizer_state(target.optimizer, loaded["optimizer"])
                if target.lr_scheduler is not None:
                    target.lr_scheduler.load_state_dict(loaded["lr_scheduler"])
        extra_state = torch.load(checkpoint_dir / EXTRA_STATE_FILE, weights_only=True)
        if load_rng:
            if metadata["layouts"][next(iter(metadata["models"]))]["world_size"] == _world_size():
                restore_rng_state(torch.load(_rng_file(checkpoint_dir, _rank()), weights_only=True))
            elif _rank() == 0:
                logger.warning("%s was saved by a different number of ranks; RNG states are not restored",
                               checkpoint_dir)
        _barrier()
        logger.info("loaded checkpoint %s (models %s) in %.1f s", checkpoint_dir, sorted(models),
                    time.perf_counter() - started)
        return extra_state


def _check_bucket_layout(model_dir: Path, saved: dict[str, Any], now: dict[str, Any], saved_buckets: list | None,
                         target: CheckpointTarget) -> None:
    """A dp_reshardable optimizer state loads only where its buckets are the saved ones: the same
    model-parallel layout (the data- and context-parallel sizes may change) and gradient buckets
    (collective). ``saved`` / ``now``: the layouts (``_layout_of_this_rank``)."""
    changed = {key: (saved[key], now[key]) for key in BUCKET_LAYOUT_KEYS if key in saved and saved[key] != now[key]}
    how = ("resume once at the saved layout with trainer.checkpoint.optimizer_format=fully_reshardable "
           "and save, then change the layout")
    if changed:
        raise CheckpointError(
            f"{model_dir}: its optimizer state was saved as dp_reshardable, which loads at another "
            f"data- or context-parallel size but not another "
            + ", ".join(f"{key} ({was} saved, {this} here)" for key, (was, this) in changed.items())
            + f"; {how}")
    problem = None
    buckets = grad_buckets(target) if _rank() == 0 else None
    if saved_buckets is not None and buckets is not None and buckets != saved_buckets:
        problem = (f"{model_dir}: its optimizer state was saved as dp_reshardable with gradient buckets "
                   f"{saved_buckets} (elements), this run's are {buckets} (a changed overlap_grad_reduce "
                   f"or model); {how}")
    problem = _broadcast_from_rank0(problem)
    if problem is not None:
        raise CheckpointError(problem)


def _tensor_bytes(models: Mapping[str, CheckpointTarget]) -> int:
    """Bytes the models' tensors take in a checkpoint, summed over the ranks' main replicas (collective)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica

    total = 0
    for target in models.values():
        per_element = OPTIMIZER_BYTES_PER_ELEMENT if target.optimizer is not None else 0
        for value in nested_values(_model_sharded_state_dict(target.model_chunks)):
            if isinstance(value, ShardedTensor) and is_main_replica(value.replica_id):
                total += value.data.numel() * (value.data.element_size() + per_element)
    if dist.is_initialized():
        summed = torch.tensor([total], dtype=torch.int64)
        dist.all_reduce(summed, group=control_group())
        total = int(summed.item())
    return total


def _write_rank_state(tmp_dir: Path, rng_state: dict[str, Any], extra_state: Mapping[str, Any] | None) -> None:
    torch.save(rng_state, _rng_file(tmp_dir, _rank()))
    if _rank() == 0:
        torch.save(dict(extra_state or {}), tmp_dir / EXTRA_STATE_FILE)


def export_hf_model(model_chunks: Sequence[torch.nn.Module], out_dir: str | Path, *,
                    copy_non_weight_files_from: str | Path | None = None) -> Path:
    """Write the (actor) model as a HuggingFace folder at ``out_dir``, atomically (collective).

    ``model_chunks``: from ``engine.models.gpt.build_model_chunks``, DDP-wrapped or not.
    Uses ``engine.models.checkpoint.save_hf_checkpoint`` into ``<out_dir>.tmp`` and renames, so a
    crash never leaves a half-written folder that HF / SGLang would load. ``copy_non_weight_files_from``:
    the HF folder the model came from (tokenizer, chat template, generation config are copied).
    """
    from engine.models.checkpoint import save_hf_checkpoint

    out_dir = Path(out_dir)
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")
    if _rank() == 0 and tmp_dir.exists():
        shutil.rmtree(tmp_dir)
    _barrier()
    save_hf_checkpoint(_unwrapped(model_chunks), tmp_dir, copy_non_weight_files_from=copy_non_weight_files_from)
    if _rank() == 0:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.rename(tmp_dir, out_dir)
    _barrier()
    return out_dir
