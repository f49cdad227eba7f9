"""Core attention for megatron-core's local layer spec (the path without Transformer Engine)."""

from __future__ import annotations

import functools
import inspect

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from parallel.context_parallel import additive_attention_mask


class FusedLocalAttention(DotProductAttention):
    """megatron-core's local core attention, computed by torch's ``scaled_dot_product_attention``.

    The local spec (no Transformer Engine) materialises ``[b*np, sq, sk]`` scores with
    ``baddbmm``, a masked softmax and a ``bmm``, each with its own backward; SDPA computes the
    same softmax(Q K^T * scale + mask) V in one fused kernel. A THD pack (``packed_seq_params``,
    megatron's ``[t, heads, dim]`` rows) runs by its ``cu_seqlens`` (:func:`packed_causal_attention`),
    so no ``[T, T]`` mask exists. What SDPA cannot express the same way (dropout in training,
    softmax offsets, query-key layer scaling, non-causal masks) runs megatron's own code.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if ((self.training and self.attention_dropout.p > 0) or self.config.softmax_type != "vanilla"
                or self.config.apply_query_key_layer_scaling or attention_bias is not None
                or mask_type != AttnMaskType.causal):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        if packed_seq_params is not None:
            context = packed_causal_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                              packed_seq_params.max_seqlen_q, self.softmax_scale)
            return context.reshape(context.shape[0], -1)
        # [s, b, heads, dim] -> [b, heads, s, dim]; megatron's mask is True where attention is blocked.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # A packed row's block-causal mask in SDPA's additive form, made once for every layer (the CP
        # stand-in's path, parallel.context_parallel).
        mask = None if attention_mask is None else additive_attention_mask(attention_mask, q.dtype)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=attention_mask is None, scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1])
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)


@functools.cache
def _torch_varlen():
    """torch's varlen flash attention (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.9) and
    the names of its parameters, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def uses_varlen_kernel(query: torch.Tensor) -> bool:
    """Whether :func:`packed_causal_attention` runs ``query``'s pack with torch's varlen flash kernel:
    CUDA tensors in half precision (flash attention's dtypes) where this torch has the kernel."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _torch_varlen() is not None


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float) -> torch.Tensor:
    """Causal attention within each sequence of a THD pack: ``query [T, hq, d]``, ``key``/``value
    [T, hkv, d]`` (``hq`` a multiple of ``hkv``), sequence boundaries ``cu_seqlens [n + 1]``.
    Returns ``[T, hq, d]``.

    On GPU torch's varlen flash kernel runs the whole pack in one call (O(sum L_i^2) work); elsewhere
    (the CPU, float32 on GPU, a torch without the kernel) each sequence runs as one causal SDPA call,
    the same work with a launch per sequence. The API changed in torch 2.10 (``window_size``,
    ``scale``, ``enable_gqa`` instead of ``is_causal``): the older form gets its scale folded into
    the queries and grouped heads repeated.
    """
    if uses_varlen_kernel(query):
        varlen_attn, parameters = _torch_varlen()
        cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32)
        grouped = query.shape[1] != key.shape[1]
        if "window_size" in parameters:  # (-1, 0): causal
            return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale,
                               window_size=(-1, 0), enable_gqa=grouped)
        if grouped:
            repeats = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        query = query * (scale * query.shape[-1] ** 0.5)  # the kernel's own scale is 1/sqrt(d)
        return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, is_causal=True)
    bounds = cu_seqlens.tolist()
    outputs = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        # [L, heads, dim] -> [1, heads, L, dim]
        q, k, v = (t[start:stop].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        outputs.append(context.squeeze(0).transpose(0, 1))
    return torch.cat(outputs)


def packs_by_cu_seqlens(transformer_engine: bool, context_parallel_size: int) -> bool:
    """Whether a packed row reaches core attention as a THD pack (``packed_seq_params``) rather than
    one row with its ``[T, T]`` block-causal mask: always with TE; without it wherever CP does not
    split the row (the CP stand-in, ``parallel.context_parallel``, takes the mask)."""
    return transformer_engine or context_parallel_size == 1


def attention_path(packed: bool, context_parallel_size: int = 1) -> str:
    """How core attention runs on this process's rows (``packed``: THD packs), in the start banner's
    and ``benchmarks.gpu_smoke``'s words."""
    from engine.models.gpt import use_transformer_engine

    if use_transformer_engine():
        return "Transformer Engine, packed rows by cu_seqlens (THD)" if packed else "Transformer Engine"
    if not packed:
        return "torch SDPA, causal"
    if not packs_by_cu_seqlens(False, context_parallel_size):
        return "torch SDPA with each pack's dense block-causal mask (the context-parallel stand-in)"
    if torch.cuda.is_available() and _torch_varlen() is not None:
        return "torch varlen flash attention, packed rows by cu_seqlens (THD; SDPA per sequence in float32)"
    return "torch SDPA per packed sequence, causal (THD by cu_seqlens, no mask)"
