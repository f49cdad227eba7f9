"""Core attention for megatron-core's local layer spec (the path without Transformer Engine)."""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from parallel.context_parallel import additive_attention_mask


class FusedLocalAttention(DotProductAttention):
    """megatron-core's local core attention, computed by torch's ``scaled_dot_product_attention``.

    The local spec (no Transformer Engine) materialises ``[b*np, sq, sk]`` scores with
    ``baddbmm``, a masked softmax and a ``bmm``, each with its own backward; SDPA computes the
    same softmax(Q K^T * scale + mask) V in one fused kernel. What SDPA cannot express the same
    way (dropout in training, softmax offsets, query-key layer scaling, non-causal masks) runs
    megatron's own code.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if ((self.training and self.attention_dropout.p > 0) or self.config.softmax_type != "vanilla"
                or self.config.apply_query_key_layer_scaling or attention_bias is not None
                or packed_seq_params is not None or mask_type != AttnMaskType.causal):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # [s, b, heads, dim] -> [b, heads, s, dim]; megatron's mask is True where attention is blocked.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        # A packed row's block-causal mask in SDPA's additive form, made once for every layer.
        mask = None if attention_mask is None else additive_attention_mask(attention_mask, q.dtype)
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=attention_mask is None, scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1])
        return context.permute(2, 0, 1, 3).reshape(context.shape[2], context.shape[0], -1)


def attention_path(packed: bool) -> str:
    """How core attention runs on this process's rows (``packed``: THD packs), in the start banner's
    and ``benchmarks.gpu_smoke``'s words."""
    from engine.models.gpt import use_transformer_engine

    if use_transformer_engine():
        return "Transformer Engine, packed rows by cu_seqlens (THD)" if packed else "Transformer Engine"
    if packed:  # FusedLocalAttention above: SDPA takes the pack's [1, 1, T, T] mask, so no flash kernel
        return "torch SDPA with each pack's dense block-causal mask (no varlen kernel without Transformer Engine)"
    return "torch SDPA, causal"
