"""Context parallelism (CP): each sequence split over the ranks of megatron's CP group.

Megatron's split (``get_batch_on_this_cp_rank`` in Megatron-LM, ``get_pos_emb_on_this_cp_rank`` in
megatron-core): a row of ``S`` tokens is cut into ``2 * cp`` equal chunks and rank ``r`` holds chunks
``r`` and ``2 * cp - 1 - r``. Under causal attention an early chunk is cheap (few keys) and a late
one dear, so every rank gets the same amount of attention work. Transformer Engine's THD path
(packed rows with ``cu_seqlens``) cuts every *sequence* of the pack that way instead
(``thd_get_partitioned_indices``), so each sequence length must be a multiple of ``2 * cp``.

This module holds what a CP rank needs beside megatron's own code:

- :func:`row_positions` / :func:`thd_positions`: which token positions a rank holds;
- :func:`gather_sequence`: per-token results of every rank put back in sequence order, with a
  backward that keeps this rank's slice of the gradient (every CP rank computes the same loss on the
  whole sequence, so no sum is needed);
- :class:`ContextParallelAttention`: core attention over the CP group for megatron-core's local layer
  spec, which refuses CP (only ``TEDotProductAttention`` runs it). It is the stand-in for TE's CP
  kernels where TE is missing (the CPU path); it computes exactly what TE computes for the
  load-balanced chunks, softmax(Q K^T * scale + mask) V over the whole sequence, by two of
  megatron's ``cp_comm_type`` schedules:

  * ``all_gather``: keys and values are all-gathered over CP (their gradients reduce-scattered back);
    each rank attends its own queries to every key. Padded rows only: TE's takes no packed rows
    (``parallel.layout.PACKED_ROW_COMM_TYPES``), and neither does the stand-in;
  * ``a2a`` (DeepSpeed-Ulysses): an all-to-all trades the sequence split for a split of the heads,
    each rank attends its heads over the whole sequence, and a second all-to-all trades back.

  ``p2p`` (ring attention) and ``a2a+p2p`` are TE's only: the stand-in refuses them by name.
"""

from __future__ import annotations

import copy

import torch

from parallel.layout import CP_COMM_TYPES, PACKED_ROW_COMM_TYPES, STAND_IN_COMM_TYPES



def row_positions(width: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions of a ``width``-token row held by CP rank ``cp_rank``: chunks r and 2cp-1-r."""
    if width % (2 * cp_size):
        raise ValueError(f"a row of {width} tokens does not split into 2 x context_parallel_size={cp_size} chunks")
    chunk = width // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def thd_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions of a THD pack held by CP rank ``cp_rank``: each sequence cut as :func:`row_positions`
    cuts a row, sequence after sequence (Transformer Engine's ``thd_get_partitioned_indices``)."""
    bounds = cu_seqlens.tolist()
    return torch.cat([start + row_positions(stop - start, cp_size, cp_rank, device)
                      for start, stop in zip(bounds[:-1], bounds[1:])])


def gather_sequence(local: torch.Tensor, positions: list[torch.Tensor], group, dim: int = 1) -> torch.Tensor:
    """Per-token values of every CP rank along ``dim``, in sequence order.

    ``positions[r]`` are the positions rank r holds (:func:`row_positions` / :func:`thd_positions`),
    ``local`` this rank's values at its positions. Differentiable: the gradient keeps this rank's
    slice, as megatron's gather does for a region every rank computes alike.
    """
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    moved = local.movedim(dim, 0)
    gathered = gather_from_sequence_parallel_region(moved.contiguous(), tensor_parallel_output_grad=False, group=group)
    order = torch.argsort(torch.cat(positions).to(gathered.device))
    return gathered.index_select(0, order).movedim(0, dim)


def additive_attention_mask(blocked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's additive form (0 where a query may attend, -inf where ``blocked``) of megatron's boolean
    attention mask, made once per mask and kept on it.

    Given a boolean mask SDPA makes this float mask itself on every call, and autograd keeps each
    layer's copy for the backward pass: L x S^2 floats for one packed row. Made once (the model
    passes one mask object to every layer), it is kept once.
    """
    cache = getattr(blocked, "_additive_masks", None)
    if cache is None:
        cache = {}
        blocked._additive_masks = cache
    if dtype not in cache:
        cache[dtype] = torch.zeros(blocked.shape, dtype=dtype, device=blocked.device).masked_fill_(blocked, float("-inf"))
    return cache[dtype]


def _held_positions(local_length: int, group, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions this rank holds, rank-order -> sequence-order permutation) for a row split by CP."""
    cp_size, cp_rank = group.size(), group.rank()
    width = local_length * cp_size
    every = [row_positions(width, cp_size, rank, device) for rank in range(cp_size)]
    return every[cp_rank], torch.argsort(torch.cat(every))


class ContextParallelAttention(torch.nn.Module):
    """Core attention over the CP group for megatron's local layer spec (see the module docstring).

    Takes megatron's core-attention call: ``query [sq, b, np, hn]``, ``key``/``value [sq, b, ng, hn]``
    (this rank's tokens, rotary embedding applied by megatron with its CP slice) and
    ``attention_mask`` of the *whole* row (``[b|1, 1, S, S]``, True = blocked) or None for causal.
    Returns ``[sq, b, np * hn]``.
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        from megatron.core import parallel_state
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        super().__init__()
        comm_type = cp_comm_type or config.cp_comm_type or "p2p"
        if comm_type not in STAND_IN_COMM_TYPES:
            raise ValueError(
                f"cp_comm_type={comm_type!r}: without Transformer Engine, context parallelism runs "
                f"{' or '.join(STAND_IN_COMM_TYPES)} (the stand-in for TE's kernels); {comm_type} is TE's only"
            )
        # megatron's local attention sets up the per-partition sizes and the softmax scale; it only
        # refuses CP in its constructor, so it is built with CP 1 and kept for those values.
        local_config = copy.copy(config)
        local_config.context_parallel_size = 1
        local = DotProductAttention(local_config, layer_number, attn_mask_type, attention_type,
                                    attention_dropout, softmax_scale, pg_collection=pg_collection)
        if local.attention_dropout.p > 0 or config.softmax_type != "vanilla" or config.apply_query_key_layer_scaling:
            raise ValueError("context parallelism without Transformer Engine computes plain softmax attention "
                             "(no attention dropout, softmax offsets or query-key layer scaling)")
        self.config = config
        self.comm_type = comm_type
        self.softmax_scale = local.softmax_scale
        self.heads = local.num_attention_heads_per_partition
        self.groups = local.num_query_groups_per_partition
        self.cp_group = parallel_state.get_context_parallel_group()
        cp_size = self.cp_group.size()
        if comm_type == "a2a" and (self.heads % cp_size or self.groups % cp_size):
            raise ValueError(
                f"cp_comm_type=a2a splits the heads over context_parallel_size={cp_size}: each tensor-parallel "
                f"rank's {self.heads} attention heads and {self.groups} key/value heads must divide by it "
                "(use all_gather, with padded rows)"
            )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("the CP attention without Transformer Engine takes neither an attention bias nor "
                             "packed_seq_params (packed rows come with their block-causal mask)")
        if attention_mask is not None and self.comm_type not in PACKED_ROW_COMM_TYPES:
            # Only a packed row comes with a mask (its block-causal one); TE refuses such rows here.
            raise ValueError(f"cp_comm_type={self.comm_type} takes no packed (THD) rows, as in Transformer Engine "
                             f"(parallel.layout.PACKED_ROW_COMM_TYPES); use {' or '.join(PACKED_ROW_COMM_TYPES)}, "
                             "or padded rows (use_remove_padding=false)")
        held, to_sequence_order = _held_positions(query.shape[0], self.cp_group, query.device)
        if self.comm_type == "all_gather":
            return self._all_gather(query, key, value, attention_mask, held, to_sequence_order)
        return self._all_to_all(query, key, value, attention_mask, held, to_sequence_order)

    def _attend(self, query, key, value, mask=None):
        """softmax(Q K^T * scale + mask) V, causal without a mask; [s, b, heads, hn] in, [sq, b, heads, hn] out."""
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1])
        return context.permute(2, 0, 1, 3)

    def _all_gather(self, query, key, value, attention_mask, held, to_sequence_order):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        # Every rank's keys and values, in sequence order; their gradients are summed back.
        key, value = (gather_from_sequence_parallel_region(t.contiguous(), group=self.cp_group)
                      .index_select(0, to_sequence_order) for t in (key, value))
        # Causal over the whole sequence (padded rows only, see forward): key j is visible to the query
        # at position p iff j <= p.
        keys = torch.arange(key.shape[0], device=query.device)
        mask = torch.zeros((1, 1, len(held), len(keys)), dtype=query.dtype, device=query.device)
        mask.masked_fill_((keys[None, :] > held[:, None])[None, None], float("-inf"))
        context = self._attend(query, key, value, mask)
        return context.reshape(context.shape[0], context.shape[1], -1)

    def _all_to_all(self, query, key, value, attention_mask, held, to_sequence_order):
        cp_size = self.cp_group.size()
        whole = [self._sequence_for_heads(t, cp_size).index_select(0, to_sequence_order) for t in (query, key, value)]
        # The whole sequence in order: plain causal attention, or the whole row's mask.
        mask = None if attention_mask is None else additive_attention_mask(attention_mask, query.dtype)
        context = self._attend(*whole, mask)
        context = self._heads_for_sequence(context.index_select(0, torch.argsort(to_sequence_order)), cp_size)
        return context.reshape(context.shape[0], context.shape[1], -1)

    def _sequence_for_heads(self, local, cp_size):
        """``[sq, b, h, hn]`` (this rank's tokens, all heads) -> ``[cp * sq, b, h / cp, hn]`` (every
        rank's tokens in rank order, this rank's heads)."""
        from megatron.core.tensor_parallel import all_to_all

        sq, b, h, hn = local.shape
        by_head_group = local.reshape(sq, b, cp_size, h // cp_size, hn).permute(2, 0, 1, 3, 4).contiguous()
        exchanged = all_to_all(self.cp_group, by_head_group.reshape(cp_size * sq, b, h // cp_size, hn))
        return exchanged

    def _heads_for_sequence(self, whole, cp_size):
        """The inverse of :meth:`_sequence_for_heads`."""
        from megatron.core.tensor_parallel import all_to_all

        s, b, h, hn = whole.shape
        exchanged = all_to_all(self.cp_group, whole.contiguous()).reshape(cp_size, s // cp_size, b, h, hn)
        return exchanged.permute(1, 2, 0, 3, 4).reshape(s // cp_size, b, cp_size * h, hn)

