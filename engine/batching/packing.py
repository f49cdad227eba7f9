"""Token layouts for the model: THD sequence packing (``use_remove_padding``) or left-aligned rows.

A padded batch ``input_ids [B, S]`` with ``attention_mask [B, S]`` becomes one row of ``T`` tokens:
the valid tokens of each sequence in order, each sequence followed by a few pad tokens so its
length is a multiple of ``alignment``. ``cu_seqlens`` holds the (aligned) sequence boundaries, the
format of megatron-core's ``PackedSeqParams(qkv_format="thd")``.

Alignment: sequence parallelism splits the token dimension over TP ranks, so the pack must divide
by the TP size; context parallelism with THD splits every sequence into ``2 * cp`` chunks
(load-balanced causal attention), so each sequence must divide by ``2 * cp`` (times TP with
sequence parallelism). See :func:`packing_alignment`.

The pad tokens sit at the *end* of their sequence and attention is causal, so they never
influence a real token; the outputs at pad positions are dropped by :meth:`TokenLayout.unpack`.

Attention backends: megatron-core's local ``DotProductAttention`` asserts ``packed_seq_params is
None``; ``TEDotProductAttention`` (Transformer Engine, GPU) runs THD, and so does
``engine.models.attention.FusedLocalAttention`` (torch's varlen flash kernel on GPU, one causal SDPA
call per sequence on CPU). The context-parallel stand-in without TE runs the same packed row with
:meth:`TokenLayout.block_causal_mask`, a ``[1, 1, T, T]`` mask that lets each token see only the
earlier tokens of its own sequence: the same attention pattern, so identical results (RoPE depends
only on relative positions within a sequence).

Without packing, rows are *left-aligned* (valid tokens first, padding after): causal attention
alone then keeps real tokens from seeing padding on every backend, so no padding mask is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


def packing_alignment(
    tensor_model_parallel_size: int, context_parallel_size: int, sequence_parallel: bool
) -> int:
    """Per-sequence length multiple that TP (with sequence parallelism) and CP require."""
    tensor_factor = tensor_model_parallel_size if sequence_parallel else 1
    if context_parallel_size > 1:
        return 2 * context_parallel_size * tensor_factor
    return tensor_factor


@dataclass
class TokenLayout:
    """Valid tokens of a padded batch laid out for the model, and the map back.

    Two layouts: *packed* (THD), one row of ``T`` tokens holding every sequence
    (:func:`pack_sequences`); and *left-aligned*, one row per sequence with its valid tokens first
    and padding after (:func:`left_align_sequences`): with causal attention the trailing padding
    is never attended to, so no attention mask is needed whatever the input's padding side.

    Attributes:
        input_ids: ``[rows, width]`` token ids for the model.
        cu_seqlens: ``[n + 1]`` int32 aligned sequence boundaries of the packed row (None when
            left-aligned).
        max_seqlen: longest aligned sequence.
        rows, cols: ``[num_valid_tokens]`` where each valid token sat in the padded batch.
        layout_rows, layout_cols: where it sits in ``input_ids``.
        batch_shape: ``(B, S)`` of the padded batch.
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor | None
    max_seqlen: int
    rows: torch.Tensor
    cols: torch.Tensor
    layout_rows: torch.Tensor
    layout_cols: torch.Tensor
    batch_shape: tuple[int, int]

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    def padded_to(self, rows: int, width: int, pad_token_id: int = 0) -> "TokenLayout":
        """The same layout in a larger ``[rows, width]`` block (extra rows and columns are padding).

        Megatron's interleaved pipeline schedule needs every micro-batch to have one shape. In a
        packed row the extra columns form one more (ignored) sequence, so they attend only to
        themselves; in left-aligned rows they trail every sequence, unseen under causal attention.
        """
        current_rows, current_width = self.input_ids.shape
        if rows < current_rows or width < current_width or (self.is_packed and rows != 1):
            raise ValueError(f"cannot pad a {tuple(self.input_ids.shape)} layout to {(rows, width)}")
        input_ids = self.input_ids.new_full((rows, width), pad_token_id)
        input_ids[:current_rows, :current_width] = self.input_ids
        cu_seqlens, max_seqlen = self.cu_seqlens, self.max_seqlen
        if self.is_packed and width > current_width:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([width])])
            max_seqlen = max(max_seqlen, width - current_width)
        return replace(self, input_ids=input_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

    def packed_seq_params(self):
        """megatron-core's THD descriptor of this pack (for Transformer Engine attention)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        if self.cu_seqlens is None:
            raise ValueError("a left-aligned layout has no packed_seq_params")
        cu_seqlens = self.cu_seqlens.to(self.input_ids.device)
        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def block_causal_mask(self) -> torch.Tensor:
        """``[1, 1, T, T]`` bool, True where attention is *blocked* (megatron's mask convention):
        query i sees key j iff both lie in the same packed sequence and j <= i."""
        if self.cu_seqlens is None:
            raise ValueError("a left-aligned layout needs no mask: plain causal attention is exact")
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        device = self.input_ids.device
        segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
        position = torch.arange(self.input_ids.shape[1], device=device)
        allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
        return ~allowed[None, None]

    def unpack(self, values: torch.Tensor, fill_value: float = 0.0) -> torch.Tensor:
        """Per-token model outputs ``[rows, width, ...]`` back to ``[B, S, ...]`` (differentiable);
        positions that held padding get ``fill_value``."""
        if tuple(values.shape[:2]) != tuple(self.input_ids.shape):
            raise ValueError(f"expected outputs of shape {tuple(self.input_ids.shape)}, got {tuple(values.shape)}")
        device = values.device
        out = values.new_full((*self.batch_shape, *values.shape[2:]), fill_value)
        out[self.rows.to(device), self.cols.to(device)] = values[
            self.layout_rows.to(device), self.layout_cols.to(device)
        ]
        return out


def _valid_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor, alignment: int):
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must both be [batch, seq_len]"
        )
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    valid = attention_mask.bool()
    lengths = valid.sum(dim=1)
    empty = (lengths == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty[:8]} have no tokens (attention_mask all zero)")
    rows, cols = valid.nonzero(as_tuple=True)  # row-major: rows ascending, columns in order
    # Rank of each valid token within its row = its offset in that row's sequence.
    offset_in_row = torch.cumsum(valid.long(), dim=1)[rows, cols] - 1
    aligned = (lengths + alignment - 1) // alignment * alignment
    return rows, cols, offset_in_row, aligned


def pack_sequences(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, alignment: int = 1, pad_token_id: int = 0
) -> TokenLayout:
    """Pack the valid tokens (``attention_mask == 1``) of all rows into one row, in row order.

    Args:
        input_ids: ``[B, S]`` token ids.
        attention_mask: ``[B, S]``, 1 on real tokens (any pattern: left and right padding both work).
        alignment: each sequence is padded at its end to a multiple of this
            (:func:`packing_alignment`).
        pad_token_id: id written into alignment padding (never attended to by real tokens).
    """
    rows, cols, offset_in_row, aligned = _valid_tokens(input_ids, attention_mask, alignment)
    cu_seqlens = torch.zeros(len(aligned) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(aligned, dim=0).to(torch.int32)
    layout_cols = cu_seqlens[:-1].long().to(rows.device)[rows] + offset_in_row
    packed = input_ids.new_full((1, int(cu_seqlens[-1])), pad_token_id)
    packed[0, layout_cols] = input_ids[rows, cols]
    return TokenLayout(
        input_ids=packed, cu_seqlens=cu_seqlens, max_seqlen=int(aligned.max()), rows=rows, cols=cols,
        layout_rows=torch.zeros_like(rows), layout_cols=layout_cols,
        batch_shape=(input_ids.shape[0], input_ids.shape[1]),
    )


def left_align_sequences(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, alignment: int = 1, pad_token_id: int = 0
) -> TokenLayout:
    """One row per sequence, valid tokens first; width = longest sequence rounded up to
    ``alignment`` (the sequence-parallel split needs width divisible by TP)."""
    rows, cols, offset_in_row, aligned = _valid_tokens(input_ids, attention_mask, alignment)
    width = int(aligned.max())
    out = input_ids.new_full((input_ids.shape[0], width), pad_token_id)
    out[rows, offset_in_row] = input_ids[rows, cols]
    return TokenLayout(
        input_ids=out, cu_seqlens=None, max_seqlen=width, rows=rows, cols=cols,
        layout_rows=rows, layout_cols=offset_in_row,
        batch_shape=(input_ids.shape[0], input_ids.shape[1]),
    )


def next_token_labels(input_ids: torch.Tensor) -> torch.Tensor:
    """Position t's label is token t + 1 of the same row (the last position gets a wrapped,
    meaningless label: callers only read positions whose next token is real).

    For a packed row this crosses sequence boundaries only at positions whose next token is
    padding or another sequence, which are never read either.
    """
    return torch.roll(input_ids, shifts=-1, dims=-1)
