"""Model FLOPs of a decoder (dense or Mixture-of-Experts) and model FLOPs utilisation (MFU).

Counting follows PaLM (Chowdhery et al. 2022, appendix B): a training token costs
``6 N + 12 L H Q T`` FLOPs -- 2 per multiply-accumulate, times 3 for forward + backward (the
backward costs twice the forward) -- where N is the number of parameters in matrix multiplies, L
layers, H heads of size Q, and T the sequence length; the second term is the attention score and
value products ``Q K^T`` and ``A V``, counted over the full T x T matrix (no causal discount).
For a plain MHA / 4h-MLP model this is exactly Megatron-LM's
``72 B s L h^2 (1 + s / (6 h) + V / (12 L h))`` per batch (Narayanan et al. 2021, eq. 3
without activation recomputation); tests/test_tracking_flops.py checks the two against each other.

Per sequence of length s, summed over the batch (packed or padded-free sequences):

    forward  = 2 N s + 4 L (H Q) s^2
    training = 3 x forward     (+1 forward with full activation recomputation)

N here = per layer [h (H + 2 G) Q  (q, k, v)  +  H Q h  (output)  +  k_mlp h f  (MLP; k_mlp = 3
for SwiGLU, 2 otherwise)] + the output layer (h V, or h for the critic's value head). The input
embedding is a lookup (no FLOPs); norms, softmax and rotary are ignored (< 1% at these sizes).
An MoE layer's MLP term counts the experts a token runs through, k x 3 h f_expert, plus the router
h E (the "activated" parameters; token dispatch moves data and adds no FLOPs).

MFU = model FLOPs / (seconds x peak FLOP/s per device x devices). MFU counts useful model FLOPs
only: recomputation and padding add time but not model FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch

# Dense (no sparsity) tensor-core peaks from NVIDIA's datasheets, for bf16/fp16 matmuls. Matched
# as substrings of torch.cuda.get_device_name(), most specific first.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM; 1979e12 in the datasheet is with 2:4 sparsity
    ("H200", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
)


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a dense decoder that determine its FLOPs."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    gated_linear_unit: bool = True
    value_head: bool = False
    moe_layers: int = 0  # of num_layers, the ones with routed experts instead of the dense MLP
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0

    @classmethod
    def from_architecture(cls, architecture: Any, *, value_head: bool = False) -> "DecoderShape":
        """From ``engine.models.hf_config.ModelArchitecture`` (actor/reference, or critic with value_head)."""
        moe = architecture.moe
        experts = dict(moe_layers=len(moe.layers), num_experts=moe.num_experts, moe_topk=moe.topk,
                       moe_ffn_hidden_size=moe.ffn_hidden_size) if moe is not None else {}
        return cls(
            num_layers=architecture.num_layers, hidden_size=architecture.hidden_size,
            ffn_hidden_size=architecture.ffn_hidden_size, num_attention_heads=architecture.num_attention_heads,
            num_query_groups=architecture.num_query_groups, kv_channels=architecture.kv_channels,
            vocab_size=architecture.vocab_size, gated_linear_unit=True, value_head=value_head, **experts,
        )

    def matmul_parameters(self) -> int:
        """N: parameters that take part in a matrix multiply for every token."""
        h, heads_dim = self.hidden_size, self.num_attention_heads * self.kv_channels
        qkv = h * (self.num_attention_heads + 2 * self.num_query_groups) * self.kv_channels
        attention_output = heads_dim * h
        per_matrix = 3 if self.gated_linear_unit else 2
        mlp = per_matrix * h * self.ffn_hidden_size
        routed = self.moe_topk * per_matrix * h * self.moe_ffn_hidden_size + h * self.num_experts
        head = h * (1 if self.value_head else self.vocab_size)
        dense_layers = self.num_layers - self.moe_layers
        return self.num_layers * (qkv + attention_output) + dense_layers * mlp + self.moe_layers * routed + head


def forward_flops(shape: DecoderShape, sequence_lengths: Iterable[int]) -> float:
    """FLOPs of one forward pass over sequences of these lengths."""
    lengths = [int(s) for s in sequence_lengths]
    n = shape.matmul_parameters()
    attention_width = shape.num_attention_heads * shape.kv_channels
    return float(sum(2 * n * s + 4 * shape.num_layers * attention_width * s * s for s in lengths))


def training_flops(shape: DecoderShape, sequence_lengths: Iterable[int], *, activation_recompute: bool = False) -> float:
    """Model FLOPs of forward + backward over these sequences (3 forwards).

    ``activation_recompute`` (full recomputation) adds the extra forward that the hardware runs;
    leave it False for MFU, which counts model FLOPs only.
    """
    return (4.0 if activation_recompute else 3.0) * forward_flops(shape, sequence_lengths)


def peak_flops_per_device(device_name: str | None = None, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """Dense bf16/fp16 peak FLOP/s of a GPU by name (the current CUDA device by default).

    None when unknown: on CPU, for fp32 training (its peak depends on TF32 settings), or a GPU
    not in ``PEAK_BF16_FLOPS`` -- MFU is then not reported rather than made up.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        return None
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for marker, peak in PEAK_BF16_FLOPS:
        if marker in device_name:
            return peak
    return None


def model_flops_utilization(flops: float, seconds: float, num_devices: int, peak_flops: float | None) -> float | None:
    """Achieved / peak: ``flops / seconds / (peak_flops * num_devices)``; None without a peak or time."""
    if peak_flops is None or seconds <= 0 or num_devices <= 0:
        return None
    return flops / seconds / (peak_flops * num_devices)
