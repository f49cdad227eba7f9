"""HF safetensors checkpoints <-> Megatron model chunks in any (tp, pp, vpp) layout.

Loading: every rank reads only the slices of the HF tensors it owns (``safe_open(...).get_slice``),
so a rank's memory grows with its shard, not with the model. The file of each tensor comes from
``model.safetensors.index.json`` (sharded checkpoints) or from the headers of the ``*.safetensors``
files in the folder.

Export: TP shards are all-gathered inside each tensor-parallel group (data/context-parallel rank 0
only), turned back into HF tensors by the mapping in ``weight_mapping``, and sent to one rank (or
broadcast to all).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from engine.models.gpt import named_global_parameters, use_transformer_engine
from engine.models.hf_config import MODEL_CLASS_PREFIXES, ModelArchitecture, architecture_from_hf
from engine.models.lora import adapters, is_adapter_parameter, merged_weights, peft_tensors
from engine.models.weight_mapping import (
    ParamMapping,
    hf_from_shards,
    mappings_by_megatron_name,
    shard_from_hf,
    weight_mappings,
)
from parallel.state import control_group, device

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Files besides the weights that make a folder loadable by HF / SGLang (tokenizer, templates).
NON_WEIGHT_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the folder and tensor."""


class SafetensorsCheckpoint:
    """Read access to the tensors of an HF safetensors folder, by slice."""

    def __init__(self, hf_dir: str | Path) -> None:
        from safetensors import safe_open

        self.hf_dir = Path(hf_dir)
        self._safe_open = safe_open
        index = self.hf_dir / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(path.name for path in self.hf_dir.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise CheckpointError(f"{self.hf_dir}: no *.safetensors files (and no {INDEX_FILE})")
        self._file_of: dict[str, Path] = {}
        self._shape_of: dict[str, tuple[int, ...]] = {}
        for file_name in files:
            path = self.hf_dir / file_name
            if not path.is_file():
                raise CheckpointError(f"{self.hf_dir}: {file_name} is listed in {INDEX_FILE} but missing")
            with safe_open(path, framework="pt", device="cpu") as handle:  # reads the header only
                for name in handle.keys():
                    if weight_map is None or weight_map.get(name) == file_name:
                        self._file_of[name] = path
                        self._shape_of[name] = tuple(handle.get_slice(name).get_shape())

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shape_of[name]

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        """The tensor ``name`` narrowed to [start, stop) along ``dim`` (a ``SliceReader``)."""
        if name not in self._file_of:
            raise CheckpointError(f"{self.hf_dir}: tensor {name!r} not found")
        index = (slice(None),) * dim + (slice(start, stop),)
        # Opened per read: the mapping (and the pages it touched) is released right after.
        with self._safe_open(self._file_of[name], framework="pt", device="cpu") as handle:
            return handle.get_slice(name)[index]


def _is_critic(model_chunks: Sequence[torch.nn.Module]) -> bool:
    return bool(getattr(model_chunks[0], "has_value_head", False))


def _chunk_architecture(model_chunks: Sequence[torch.nn.Module]) -> ModelArchitecture:
    if not model_chunks or not hasattr(model_chunks[0], "hf_architecture"):
        raise ValueError("model_chunks must come from engine.models.gpt.build_model_chunks")
    return model_chunks[0].hf_architecture


def _entries_for(model_chunks: Sequence[torch.nn.Module]) -> dict[str, ParamMapping]:
    return mappings_by_megatron_name(
        _chunk_architecture(model_chunks),
        transformer_engine=use_transformer_engine(),
        value_head=_is_critic(model_chunks),
    )


def _named_global_parameters(model_chunks: Sequence[torch.nn.Module], entries: dict[str, ParamMapping]):
    """(global megatron name, entry, parameter) for every parameter of this rank's chunks."""
    for chunk in model_chunks:
        for name, param in named_global_parameters(chunk):
            if is_adapter_parameter(name):
                continue  # LoRA: exported merged into its base weight, or by export_peft_state_dict
            if name not in entries:
                raise CheckpointError(f"megatron parameter {name} has no HF mapping (unexpected layer spec?)")
            yield name, entries[name], param


def _check_same_architecture(model: ModelArchitecture, checkpoint: ModelArchitecture, hf_dir: Path) -> None:
    fields = ("model_type", "vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
              "num_query_groups", "kv_channels", "tie_word_embeddings", "add_qkv_bias", "qk_layernorm", "moe")
    different = [f"{f}: model {getattr(model, f)} vs checkpoint {getattr(checkpoint, f)}"
                 for f in fields if getattr(model, f) != getattr(checkpoint, f)]
    if different:
        raise CheckpointError(f"{hf_dir}/config.json does not describe the built model: " + "; ".join(different))


@torch.no_grad()
def load_hf_weights(model_chunks: Sequence[torch.nn.Module], hf_dir: str | Path) -> list[str]:
    """Copy an HF safetensors checkpoint into this rank's model chunks, reading only owned slices.

    Returns the megatron names left as initialised because the checkpoint lacks them (only the
    critic's value head may be missing, e.g. when a critic starts from an actor checkpoint).
    """
    from megatron.core import parallel_state

    hf_dir = Path(hf_dir)
    architecture = _chunk_architecture(model_chunks)
    _check_same_architecture(architecture, architecture_from_hf(hf_dir), hf_dir)
    checkpoint = SafetensorsCheckpoint(hf_dir)
    tp = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    expert_tp = (parallel_state.get_expert_tensor_parallel_rank(),
                 parallel_state.get_expert_tensor_parallel_world_size())
    missing_optional = []
    for name, entry, param in _named_global_parameters(model_chunks, _entries_for(model_chunks)):
        absent = [hf_name for hf_name in entry.hf_names if hf_name not in checkpoint]
        if absent:
            if entry.optional:
                missing_optional.append(name)
                continue
            raise CheckpointError(f"{hf_dir}: tensor {absent[0]!r} (for megatron {name}) not in the checkpoint")
        for hf_name, expected in zip(entry.hf_names, entry.hf_shapes):
            if checkpoint.shape(hf_name) != expected:
                raise CheckpointError(
                    f"{hf_dir}: tensor {hf_name!r} has shape {checkpoint.shape(hf_name)}, config.json implies {expected}"
                )
        shard = shard_from_hf(entry, architecture, checkpoint.read, *(expert_tp if entry.expert else tp))
        if tuple(shard.shape) != tuple(param.shape):  # a mapping bug, not a user error
            raise AssertionError(f"{name}: shard {tuple(shard.shape)} != parameter {tuple(param.shape)}")
        param.copy_(shard)
    if missing_optional:
        logger.info("%s has no %s; kept their initial values", hf_dir, ", ".join(missing_optional))
    return missing_optional


def _tensor_parallel_shards(tensor: torch.Tensor, split: bool, tp_group, tp_size: int) -> list[torch.Tensor]:
    """Every TP rank's shard of a split tensor (index = TP rank); a replicated one as it is."""
    if not split or tp_size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(tp_size)]
    dist.all_gather(shards, tensor.contiguous(), group=tp_group)
    return shards


@torch.no_grad()
def _gather_local_hf_tensors(model_chunks, entries) -> dict[str, torch.Tensor]:
    """HF tensors of this pipeline stage, complete on TP rank 0 of data/context-parallel rank 0.

    Expert weights come from expert-data-parallel rank 0 instead: every expert-parallel rank holds
    other experts, gathered over its expert TP group.
    """
    from megatron.core import parallel_state as ps

    architecture = _chunk_architecture(model_chunks)
    groups = {  # expert weight? -> (exports, TP group, TP rank, TP size)
        False: (ps.get_data_parallel_rank(with_context_parallel=True) == 0, ps.get_tensor_model_parallel_group(),
                ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        True: (ps.get_expert_data_parallel_rank() == 0, ps.get_expert_tensor_parallel_group(),
               ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()),
    }
    merged = merged_weights(model_chunks)
    local: dict[str, torch.Tensor] = {}
    for name, entry, param in _named_global_parameters(model_chunks, entries):
        exports, tp_group, tp_rank, tp_size = groups[entry.expert]
        if not entry.exported or not exports:
            continue
        tensor = merged[name]() if name in merged else param.detach()
        shards = _tensor_parallel_shards(tensor, entry.tensor_parallel_dim is not None, tp_group, tp_size)
        if tp_rank == 0:
            local.update({hf_name: t.cpu() for hf_name, t in hf_from_shards(entry, architecture, shards).items()})
    return local


def export_hf_state_dict(
    model_chunks: Sequence[torch.nn.Module], *, destination_rank: int | None = 0
) -> dict[str, torch.Tensor]:
    """The full HF state dict (HF names, HF layout, CPU tensors) of the distributed model.

    Collective over the whole world. The dict is returned on ``destination_rank`` ({} elsewhere),
    or on every rank with ``destination_rank=None``. Tied models have no ``lm_head.weight``, as HF
    saves them; the critic's value head is ``score.weight`` / ``score.bias``.
    """
    entries = _entries_for(model_chunks)
    received = _collect(_gather_local_hf_tensors(model_chunks, entries), destination_rank)
    if destination_rank is not None and dist.get_rank() != destination_rank:
        return {}
    expected = [name for entry in weight_mappings(
        _chunk_architecture(model_chunks), transformer_engine=use_transformer_engine(),
        value_head=_is_critic(model_chunks)) if entry.exported for name in entry.hf_names]
    missing = [name for name in expected if name not in received]
    if missing:
        raise AssertionError(f"export is missing {missing[:5]} ({len(missing)} tensors)")
    return {name: received[name] for name in expected}


def _collect(local: dict[str, torch.Tensor], destination_rank: int | None) -> dict[str, torch.Tensor]:
    """Every rank's ``local`` tensors on ``destination_rank`` (on every rank for None); collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manifests: list[list[tuple[str, tuple[int, ...], torch.dtype]] | None] = [None] * world
    dist.all_gather_object(manifests, [(name, tuple(t.shape), t.dtype) for name, t in local.items()])
    comm_device = device()  # NCCL moves GPU tensors only
    received: dict[str, torch.Tensor] = {}
    for source, manifest in enumerate(manifests):
        for name, shape, dtype in manifest:
            if destination_rank is None:
                buffer = local[name].to(comm_device) if rank == source else torch.empty(shape, dtype=dtype, device=comm_device)
                dist.broadcast(buffer, src=source)
                received[name] = buffer.cpu()
            elif source == destination_rank:
                if rank == destination_rank:
                    received[name] = local[name]
            elif rank == source:
                dist.send(local[name].to(comm_device), dst=destination_rank)
            elif rank == destination_rank:
                buffer = torch.empty(shape, dtype=dtype, device=comm_device)
                dist.recv(buffer, src=source)
                received[name] = buffer.cpu()
    return received


@torch.no_grad()
def export_peft_state_dict(model_chunks: Sequence[torch.nn.Module], *, destinations: Sequence[int] = (0,),
                           bucket_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """The LoRA adapters as PEFT names and layout (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``),
    CPU tensors on each rank of ``destinations`` ({} elsewhere), sent there in buckets of at most
    ``bucket_bytes`` (None: no limit; ``_collect_in_buckets``). Collective."""
    from megatron.core import parallel_state as ps

    architecture, entries = _chunk_architecture(model_chunks), _entries_for(model_chunks)
    tp_group, tp_size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    local: dict[str, torch.Tensor] = {}
    if ps.get_data_parallel_rank(with_context_parallel=True) == 0:
        for chunk in model_chunks:
            for name, adapter in adapters(chunk):
                a_shards, b_shards = (_tensor_parallel_shards(factor.detach(), factor.tensor_model_parallel, tp_group,
                                                              tp_size) for factor in (adapter.lora_A, adapter.lora_B))
                if ps.get_tensor_model_parallel_rank() == 0:
                    tensors = peft_tensors(entries[name], a_shards, b_shards, architecture)
                    local.update({key: t.contiguous() for key, t in tensors.items()})
    return _collect_in_buckets(local, destinations, bucket_bytes)


def _collect_in_buckets(local: dict[str, torch.Tensor], destinations: Sequence[int],
                        bucket_bytes: int | None) -> dict[str, torch.Tensor]:
    """Every rank's ``local`` tensors, as CPU tensors, on each rank of ``destinations`` ({} elsewhere);
    collective. A source packs its tensors into flat buckets (one dtype each, at most ``bucket_bytes``
    unless one tensor is larger) and sends each bucket to each destination: a message per bucket and
    destination, each crossing to the host once, instead of a world broadcast and a copy per tensor
    (a LoRA sync of a 70B model moved ~1k adapter tensors that way to every rank, each step).
    Sources, buckets and destinations go in the same order on every rank, so the sends and receives
    pair up without a cycle."""
    rank, world = dist.get_rank(), dist.get_world_size()
    targets = sorted(set(destinations))
    manifests: list[list[tuple[str, tuple[int, ...], torch.dtype]] | None] = [None] * world
    dist.all_gather_object(manifests, [(name, tuple(t.shape), t.dtype) for name, t in local.items()])
    comm_device = device()  # NCCL moves GPU tensors only
    received: dict[str, torch.Tensor] = {}
    for source, manifest in enumerate(manifests):
        for bucket in _dtype_buckets(manifest, bucket_bytes):
            dtype, numel = bucket[0][2], sum(math.prod(shape) for _, shape, _ in bucket)
            if rank == source:
                flat = torch.cat([local[name].reshape(-1) for name, _, _ in bucket]).to(comm_device)
                for target in targets:
                    if target != rank:
                        dist.send(flat, dst=target)
            elif rank in targets:
                flat = torch.empty(numel, dtype=dtype, device=comm_device)
                dist.recv(flat, src=source)
            else:
                continue
            if rank in targets:
                offset, flat = 0, flat.cpu()
                for name, shape, _ in bucket:
                    size = math.prod(shape)
                    received[name] = flat[offset:offset + size].view(shape)
                    offset += size
    return received


def _dtype_buckets(manifest: Sequence[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int | None) -> list[list]:
    """``manifest``'s entries in consecutive buckets of one dtype and at most ``bucket_bytes`` each
    (a larger tensor alone; None: no limit)."""
    buckets: list[list] = []
    size = 0
    for entry in manifest:
        nbytes = math.prod(entry[1]) * entry[2].itemsize
        if not buckets or buckets[-1][0][2] != entry[2] or (bucket_bytes is not None and size + nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(entry)
        size += nbytes
    return buckets


def save_peft_adapter(model_chunks: Sequence[torch.nn.Module], out_dir: str | Path, *,
                      base_model_name_or_path: str | Path) -> None:
    """Write the LoRA adapters as a PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``,
    ``peft.PeftModel.from_pretrained(base, out_dir)`` loads it). Collective; global rank 0 writes."""
    from safetensors.torch import save_file

    settings = model_chunks[0].lora_settings
    state_dict = export_peft_state_dict(model_chunks, destinations=(0,))
    if dist.get_rank() == 0:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(state_dict, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
        config = {**settings.peft_config(), "base_model_name_or_path": str(base_model_name_or_path)}
        (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    dist.barrier()


def hf_config_for_export(architecture: ModelArchitecture, *, value_head: bool):
    """The HF config to save beside exported weights (a critic saves as *ForTokenClassification)."""
    config = copy.deepcopy(architecture.source_config)
    prefix = MODEL_CLASS_PREFIXES[architecture.model_type]
    if value_head:
        config.num_labels = 1
        config.architectures = [f"{prefix}ForTokenClassification"]
    else:
        config.architectures = [f"{prefix}ForCausalLM"]
    return config


def _shards_by_size(names: Iterable[str], state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = state_dict[name].numel() * state_dict[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_hf_checkpoint(
    model_chunks: Sequence[torch.nn.Module],
    out_dir: str | Path,
    *,
    copy_non_weight_files_from: str | Path | None = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> None:
    """Write the distributed model as an HF folder (config.json + safetensors, sharded with an
    index when there is more than one file). Collective.

    Every rank that completes some HF tensors (TP rank 0 of data-parallel rank 0 of each pipeline
    stage; for experts, of each expert-parallel rank) writes them itself, in files of at most
    ``max_shard_bytes``, and global rank 0 writes the index and the config: no rank holds more than
    its stage's tensors, and the stages write at once (one rank gathering a 70B model would hold
    ~140 GB of host memory and write it alone). Each file's metadata names the rank that wrote it
    (``trident_writer_rank``). ``copy_non_weight_files_from``: an HF folder whose tokenizer /
    generation config files are copied, so the result loads in HF or SGLang as is.
    """
    from safetensors.torch import save_file

    entries = _entries_for(model_chunks)
    local = _gather_local_hf_tensors(model_chunks, entries)
    shards = [names for names in _shards_by_size(local, local, max_shard_bytes) if names]
    # Every rank's planned files (names and bytes), so that all agree on the files' numbers.
    plans: list = [None] * dist.get_world_size()
    dist.all_gather_object(plans, [(names, sum(local[n].numel() * local[n].element_size() for n in names))
                                   for names in shards], group=control_group())
    files = [(rank, names, size) for rank, plan in enumerate(plans) for names, size in plan]
    file_names = (["model.safetensors"] if len(files) == 1 else
                  [f"model-{number:05d}-of-{len(files):05d}.safetensors" for number in range(1, len(files) + 1)])
    expected = [name for entry in weight_mappings(
        _chunk_architecture(model_chunks), transformer_engine=use_transformer_engine(),
        value_head=_is_critic(model_chunks)) if entry.exported for name in entry.hf_names]
    written = [name for _, names, _ in files for name in names]
    missing = sorted(set(expected) - set(written))
    if missing or len(written) != len(set(written)):
        raise AssertionError(f"export is missing {missing[:5]} ({len(missing)} tensors) or writes a tensor twice")
    out_dir = Path(out_dir)
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=control_group())
    for (rank, names, _), file_name in zip(files, file_names):
        if rank == dist.get_rank():
            save_file({n: local[n].contiguous() for n in names}, out_dir / file_name,
                      metadata={"format": "pt", "trident_writer_rank": str(rank)})
    if dist.get_rank() == 0:
        if len(files) > 1:
            weight_map = {name: file_name for (_, names, _), file_name in zip(files, file_names) for name in names}
            (out_dir / INDEX_FILE).write_text(json.dumps(
                {"metadata": {"total_size": sum(size for _, _, size in files)},
                 "weight_map": {name: weight_map[name] for name in expected}}, indent=2))
        hf_config_for_export(
            _chunk_architecture(model_chunks), value_head=_is_critic(model_chunks)
        ).save_pretrained(out_dir)
        if copy_non_weight_files_from is not None:
            for file_name in NON_WEIGHT_FILES:
                source = Path(copy_non_weight_files_from) / file_name
                if source.is_file():
                    shutil.copy2(source, out_dir / file_name)
    dist.barrier(group=control_group())  # every file is written
