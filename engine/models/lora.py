"""LoRA (Hu et al. 2021) on megatron-core's linear layers, split the way their base layer is.

Each adapted layer keeps its frozen weight W and gains ``W x + (alpha / r) * B A x``. The
adapter sits beside its base layer (``self_attention.linear_qkv`` -> ``linear_qkv_adapter``, with
parameters ``lora_A`` [r, in] and ``lora_B`` [out, r]) and is applied by a forward hook on it, so
every megatron name, the HF mapping and the HybridEngine specs stay those of the base model.

Tensor parallelism, with megatron's mappings:

- column-parallel base (``linear_qkv``, ``linear_fc1``; W split by rows): A is whole on every TP
  rank, B holds this rank's rows. ``h = A x`` is the same on every rank; the backward all-reduces
  dL/dh over TP (each rank's B sees only its rows), so every rank gets the full dL/dA. With
  sequence parallelism x is gathered along the sequence and the gradient only split back (it is
  already the sum).
- row-parallel base (``linear_proj``, ``linear_fc2``; W split by columns): A holds this rank's
  columns, B is whole. ``h = sum_ranks A_r x_r`` by all-reduce (reduce-scatter along the sequence
  with SP, where each rank's dL/dB then covers its tokens only and megatron's
  ``finalize_model_grads`` all-reduces it, as for the norms: ``param.sequence_parallel``).

Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``; one adapter on the fused
layer is exactly a PEFT adapter on each part with the same A and B's rows of that part, which is
how ``peft_state_dict`` exports it. Hence q/k/v (and gate/up) are adapted together or not at all.
Why not Megatron-Bridge's ``LoRA`` transform: it needs megatron-core >= 0.19 (we are pinned to
0.16.1, the newest that installs on Python 3.11) and wraps modules, renaming every adapted weight.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

# HF projection names (PEFT's target_modules) -> the megatron layer that holds them.
HF_TARGETS = {
    "q_proj": "self_attention.linear_qkv",
    "k_proj": "self_attention.linear_qkv",
    "v_proj": "self_attention.linear_qkv",
    "o_proj": "self_attention.linear_proj",
    "gate_proj": "mlp.linear_fc1",
    "up_proj": "mlp.linear_fc1",
    "down_proj": "mlp.linear_fc2",
}
ALL_LINEAR = "all-linear"
_COLUMN_PARALLEL = ("self_attention.linear_qkv", "mlp.linear_fc1")
ADAPTER_SUFFIX = "_adapter"
_ADAPTER_PARAMETER = re.compile(rf"^(.*){ADAPTER_SUFFIX}\.lora_[AB]$")


@dataclass(frozen=True)
class LoRASettings:
    """``model.lora_rank``, ``model.lora_alpha``, ``model.target_modules`` and the init seed."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    seed: int = 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def megatron_layers(self) -> tuple[str, ...]:
        """The adapted layers of each transformer layer (``self_attention.linear_qkv``, ...)."""
        names = set(HF_TARGETS) if ALL_LINEAR in self.target_modules else set(self.target_modules)
        unknown = sorted(names - set(HF_TARGETS))
        if unknown:
            raise ValueError(f"model.target_modules: unknown module {unknown[0]!r}; use {ALL_LINEAR!r} or names from "
                             f"{', '.join(HF_TARGETS)}")
        layers = []
        for layer in dict.fromkeys(HF_TARGETS.values()):
            parts = {name for name, target in HF_TARGETS.items() if target == layer}
            if parts & names and parts - names:
                raise ValueError(f"model.target_modules: megatron fuses {', '.join(sorted(parts))} into one layer "
                                 f"({layer}); adapt all of them or none (missing: {', '.join(sorted(parts - names))})")
            if parts <= names:
                layers.append(layer)
        if not layers:
            raise ValueError("model.target_modules names no module")
        return tuple(layers)

    def peft_target_modules(self) -> list[str]:
        layers = self.megatron_layers()
        return [name for name, layer in HF_TARGETS.items() if layer in layers]

    def peft_config(self) -> dict:
        """PEFT's ``adapter_config.json`` fields for these adapters (as ``peft_tensors`` names them)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": self.peft_target_modules(), "lora_dropout": 0.0, "bias": "none",
                "fan_in_fan_out": False, "inference_mode": True}

    def peft_elements(self, architecture) -> int:
        """Elements of the PEFT adapters of ``architecture`` (every part of a fused layer has its own
        copy of A, as ``peft_tensors`` exports them): what an adapters-only sync moves."""
        from engine.models.weight_mapping import weight_mappings

        layers = self.megatron_layers()
        return sum(self.rank * (shape[0] + shape[1])
                   for entry in weight_mappings(architecture, transformer_engine=False)
                   if entry.megatron_name.endswith(tuple(f".{layer}.weight" for layer in layers))
                   for shape in entry.hf_shapes)


class LoRAAdapter(torch.nn.Module):
    """``scaling * B A x`` for one megatron linear layer (see the module docstring for the split)."""

    def __init__(self, base: torch.nn.Module, column_parallel: bool, settings: LoRASettings, config,
                 generator: torch.Generator) -> None:
        from megatron.core import parallel_state

        super().__init__()
        self.column_parallel = column_parallel
        self.scaling = settings.scaling
        self.sequence_parallel = config.sequence_parallel
        self.enabled = True
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # The base layer, unregistered (a tuple hides it from state_dict and named_parameters).
        self.base = (base,)
        # TE fuses the input norm into linear_qkv / linear_fc1: the adapter sees the un-normalised input.
        self.fused_norm = hasattr(base, "layer_norm_weight")
        self.norm_epsilon, self.normalization = config.layernorm_epsilon, config.normalization
        out_local, in_local = base.weight.shape
        in_full = in_local if column_parallel else in_local * self.tp_size
        # PEFT's init: A Kaiming-uniform, B zero (the adapted model starts as the base model). A is
        # drawn whole from a generator seeded per layer, so every TP layout starts from the same A.
        full_a = torch.empty(settings.rank, in_full)
        torch.nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
        local_a = full_a if column_parallel else full_a.chunk(self.tp_size, dim=1)[self.tp_rank]
        dtype, device = base.weight.dtype, base.weight.device
        self.lora_A = torch.nn.Parameter(local_a.to(dtype=dtype, device=device).contiguous())
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, settings.rank, dtype=dtype, device=device))
        # Which parameter is split over TP (megatron's grad norm counts replicated ones once).
        split = self.lora_B if column_parallel else self.lora_A
        replicated = self.lora_A if column_parallel else self.lora_B
        split.tensor_model_parallel, split.partition_dim, split.partition_stride = True, (0 if column_parallel else 1), 1
        replicated.tensor_model_parallel = False
        if not column_parallel and self.sequence_parallel:
            replicated.sequence_parallel = True  # dL/dB covers this rank's tokens: summed over TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )

        if self.fused_norm:
            x = self._norm(x)
        if self.column_parallel:
            if self.sequence_parallel:
                x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False)
            h = copy_to_tensor_model_parallel_region(torch.nn.functional.linear(x, self.lora_A))
        else:
            h = torch.nn.functional.linear(x, self.lora_A)
            if self.sequence_parallel:
                h = reduce_scatter_to_sequence_parallel_region(h)
            elif self.tp_size > 1:
                h = reduce_from_tensor_model_parallel_region(h)
        return torch.nn.functional.linear(h, self.lora_B) * self.scaling

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base[0]
        weight = base.layer_norm_weight
        if self.normalization == "RMSNorm":
            variance = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(variance + self.norm_epsilon)).to(x.dtype) * weight
        return torch.nn.functional.layer_norm(x, weight.shape, weight, getattr(base, "layer_norm_bias", None),
                                              self.norm_epsilon)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + scaling B A``, in W's dtype (summed in float32)."""
        weight = self.base[0].weight
        return (weight.float() + (self.lora_B.float() @ self.lora_A.float()) * self.scaling).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron dist-checkpointing entries: the TP-split factor marked as split, per layer."""
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = self.state_dict(prefix="", keep_vars=True)
        axis = {"lora_B": 0} if self.column_parallel else {"lora_A": 1}
        return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group(),
                                                   dp_cp_group=metadata["dp_cp_group"])


def _add_adapter_output(adapter: LoRAAdapter, module, args, output):
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(args[0]).to(out.dtype), bias


def add_lora(model_chunks: Sequence[torch.nn.Module], settings: LoRASettings) -> None:
    """Freeze every weight of ``model_chunks`` and attach adapters to the target layers (after the
    HF weights are loaded). Raises ValueError for targets the model does not have (MoE experts)."""
    from engine.models.gpt import layer_offset

    layers = settings.megatron_layers()
    for chunk in model_chunks:
        chunk.requires_grad_(False)
        offset = layer_offset(chunk)
        for local_index, layer in enumerate(chunk.decoder.layers):
            for target_index, target in enumerate(layers):
                parent_name, attribute = target.split(".")
                parent = getattr(layer, parent_name)
                base = getattr(parent, attribute, None)
                if base is None or not hasattr(base, "weight"):
                    raise ValueError(f"model.target_modules: layer {offset + local_index} has no {target} "
                                     "(LoRA on MoE expert weights is not built yet; adapt the attention only)")
                seed = settings.seed * 1_000_003 + (offset + local_index) * len(HF_TARGETS) + target_index
                adapter = LoRAAdapter(base, target in _COLUMN_PARALLEL, settings, chunk.config,
                                      torch.Generator().manual_seed(seed))
                parent.add_module(attribute + ADAPTER_SUFFIX, adapter)
                base.register_forward_hook(functools.partial(_add_adapter_output, adapter))
        if getattr(chunk, "pre_process", False):
            # Nothing before the first layer needs gradients; activation recompute would then cut
            # the adapters out of the graph (megatron's checkpoint passes no grad to frozen inputs).
            chunk.embedding.register_forward_hook(lambda module, args, output: output.requires_grad_(True))
        chunk.lora_settings = settings


def describe(model_chunks: Sequence[torch.nn.Module]) -> str:
    """One line for the console: the adapters and the share of this rank's parameters that train."""
    settings = model_chunks[0].lora_settings
    parameters = [p for chunk in model_chunks for p in chunk.parameters()]
    trained = sum(p.numel() for p in parameters if p.requires_grad)
    return (f"LoRA rank {settings.rank} (alpha {settings.alpha:g}) on {', '.join(settings.peft_target_modules())}: "
            f"{trained:,} trained parameters of {sum(p.numel() for p in parameters):,} on this rank")


def has_lora(model_chunks: Sequence[torch.nn.Module]) -> bool:
    return getattr(model_chunks[0], "lora_settings", None) is not None


def is_adapter_parameter(name: str) -> bool:
    return _ADAPTER_PARAMETER.match(name) is not None


def adapters(chunk: torch.nn.Module) -> Iterator[tuple[str, LoRAAdapter]]:
    """(global name of the adapted weight, adapter) of one chunk, e.g.
    ``decoder.layers.7.self_attention.linear_qkv.weight``."""
    from engine.models.gpt import layer_offset
    from engine.models.weight_mapping import global_megatron_name

    offset = layer_offset(chunk)
    for name, module in chunk.named_modules():
        if isinstance(module, LoRAAdapter):
            base = name[: -len(ADAPTER_SUFFIX)]
            yield global_megatron_name(f"{base}.weight", offset), module


@contextlib.contextmanager
def adapters_disabled(model_chunks: Sequence[torch.nn.Module]):
    """The base model: every adapter off inside the block (the reference policy)."""
    found = [adapter for chunk in model_chunks for _, adapter in adapters(chunk)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True


def merged_weights(model_chunks: Sequence[torch.nn.Module]) -> dict[str, Callable[[], torch.Tensor]]:
    """Global weight name -> a function computing this rank's shard of ``W + scaling B A`` (one
    weight at a time, so the extra memory is one weight shard)."""
    return {name: adapter.merged_weight for chunk in model_chunks for name, adapter in adapters(chunk)}


def peft_tensors(entry, a_shards: Sequence[torch.Tensor], b_shards: Sequence[torch.Tensor],
                 architecture) -> dict[str, torch.Tensor]:
    """PEFT's tensors (``base_model.model.<hf module>.lora_A.weight`` ...) of one adapted layer from
    its A and B of every TP rank (index = TP rank); ``entry``: the base weight's ``ParamMapping``.
    The TP-split factor is converted as its base weight is (fused layers give each part its rows of
    B and the same A; padding is dropped)."""
    from engine.models.weight_mapping import hf_from_shards

    if entry.tensor_parallel_dim == 0:  # column-parallel: B's rows are laid out as the weight's
        a_parts, b_parts = {name: a_shards[0] for name in entry.hf_names}, hf_from_shards(entry, architecture, b_shards)
    else:  # row-parallel: A's columns are
        a_parts, b_parts = hf_from_shards(entry, architecture, a_shards), {name: b_shards[0] for name in entry.hf_names}
    tensors = {}
    for name in entry.hf_names:
        module = name[: -len(".weight")]
        # Copies: the parts of a fused layer share A, and safetensors refuses shared storage.
        tensors[f"base_model.model.{module}.lora_A.weight"] = a_parts[name].clone(memory_format=torch.contiguous_format)
        tensors[f"base_model.model.{module}.lora_B.weight"] = b_parts[name].clone(memory_format=torch.contiguous_format)
    return tensors
