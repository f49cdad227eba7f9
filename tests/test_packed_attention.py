"""Packed (THD) rows without Transformer Engine run by their ``cu_seqlens``, never a ``[T, T]`` mask
(issue 45, defect 5: ``engine/models/attention.py:31-36`` and ``parallel/context_parallel.py:73-90`` gave
every pack a dense additive mask, which keeps SDPA off its flash kernels and costs O(T^2)).

The math is checked in float64 against the dense block-causal mask it replaces; the GPU kernel's
call (torch >= 2.9 ``torch.nn.attention.varlen.varlen_attn``, both of its signatures) against the
same reference through a stand-in that follows the kernel's documented protocol; the model-level
parity of packed and unpacked rows is ``tests/test_roles.py``'s, which now runs this path.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from engine.batching import pack_sequences
from engine.models import attention
from engine.models.attention import attention_path, packed_causal_attention, packs_by_cu_seqlens
from parallel.context_parallel import additive_attention_mask

LENGTHS = [5, 1, 9, 3]
HEADS, KV_HEADS, DIM = 4, 2, 8
SCALE = 0.3  # not 1/sqrt(DIM): a lost or doubled scale shows


def _pack(dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, DIM, dtype=dtype, generator=generator, requires_grad=True)
    k = torch.randn(total, KV_HEADS, DIM, dtype=dtype, generator=generator, requires_grad=True)
    v = torch.randn(total, KV_HEADS, DIM, dtype=dtype, generator=generator, requires_grad=True)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_seqlens


def _dense_reference(q, k, v, cu_seqlens):
    """What the pack got before: one SDPA call over the whole row with its block-causal mask."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    position = torch.arange(len(segment))
    blocked = ~((segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None]))
    mask = additive_attention_mask(blocked[None, None], q.dtype)
    context = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), attn_mask=mask, scale=SCALE, enable_gqa=True)
    return context.squeeze(0).transpose(0, 1)


def _values_and_grads(function, q, k, v, cu_seqlens):
    out = function(q, k, v, cu_seqlens)
    grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum(),
                                (q, k, v))
    return out, grads


def test_per_sequence_attention_equals_the_dense_block_causal_mask():
    q, k, v, cu = _pack()
    out, grads = _values_and_grads(lambda *a: packed_causal_attention(*a, max(LENGTHS), SCALE), q, k, v, cu)
    ref, ref_grads = _values_and_grads(_dense_reference, q, k, v, cu)
    assert out.shape == (sum(LENGTHS), HEADS, DIM)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)


def _new_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.10+'s ``varlen_attn`` protocol (``window_size=(-1, 0)`` is causal), computed per sequence."""
    assert window_size == (-1, 0) and cu_seq_q.dtype == torch.int32 and max_q == max_k == max(LENGTHS)
    assert enable_gqa == (query.shape[1] != key.shape[1])
    return _per_sequence(query, key, value, cu_seq_q, scale)


def _old_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9's ``varlen_attn`` protocol: ``is_causal``, scale 1/sqrt(d), equal head counts."""
    assert is_causal and cu_seq_q.dtype == torch.int32 and query.shape[1] == key.shape[1]
    return _per_sequence(query, key, value, cu_seq_q, query.shape[-1] ** -0.5)


def _per_sequence(query, key, value, cu, scale):
    bounds = cu.tolist()
    return torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[a:b].transpose(0, 1) for t in (query, key, value)), is_causal=True, scale=scale,
        enable_gqa=query.shape[1] != key.shape[1]).transpose(0, 1) for a, b in zip(bounds[:-1], bounds[1:])])


@pytest.mark.parametrize("kernel", [_new_varlen, _old_varlen], ids=["torch-2.10+", "torch-2.9"])
def test_the_gpu_kernel_gets_a_causal_pack_with_its_scale_and_grouped_heads(kernel, monkeypatch):
    """Where the kernel runs (CUDA, half precision) it takes the whole pack in one call, with the
    causal window, int32 ``cu_seqlens``, the layer's softmax scale and grouped key/value heads,
    in whichever of the two signatures the installed torch has."""
    monkeypatch.setattr(attention, "_torch_varlen", lambda: (kernel, frozenset(inspect.signature(kernel).parameters)))
    monkeypatch.setattr(attention, "uses_varlen_kernel", lambda query: True)
    q, k, v, cu = _pack()
    reference = _dense_reference(q, k, v, cu)
    calls = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        _counting(torch.nn.functional.scaled_dot_product_attention, calls))
    out = packed_causal_attention(q, k, v, cu.long(), max(LENGTHS), SCALE)
    assert len(calls) == len(LENGTHS)  # the stand-in's per-sequence calls, so the kernel ran once, whole
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)


def _counting(function, calls):
    def counted(*args, **kwargs):
        calls.append(kwargs.get("attn_mask"))
        assert kwargs.get("attn_mask") is None  # never a mask
        return function(*args, **kwargs)
    return counted


def test_only_the_context_parallel_stand_in_keeps_the_mask():
    assert packs_by_cu_seqlens(transformer_engine=True, context_parallel_size=2)
    assert packs_by_cu_seqlens(transformer_engine=False, context_parallel_size=1)
    assert not packs_by_cu_seqlens(transformer_engine=False, context_parallel_size=2)
    # this machine: no TE, no CUDA; the banner says which path a packed row takes
    assert attention_path(packed=True) == "torch SDPA per packed sequence, causal (THD by cu_seqlens, no mask)"
    assert "dense block-causal mask" in attention_path(packed=True, context_parallel_size=2)


def test_a_packed_micro_batch_reaches_the_model_as_thd_without_a_mask():
    """The worker's model inputs for a packed micro-batch (no TE, CP 1): ``packed_seq_params`` with
    the pack's boundaries, and no block-causal mask made."""
    from engine.roles.worker import MegatronWorker

    ids = torch.tensor([[0, 0, 3, 4, 5], [0, 6, 7, 8, 9]])
    layout = pack_sequences(ids, (ids != 0).long(), alignment=1)
    worker = MegatronWorker.__new__(MegatronWorker)  # model_inputs reads only these
    worker.transformer_engine, worker.cp_size = False, 1
    worker.model_config = type("Config", (), {"num_moe_experts": None})()
    inputs = worker.model_inputs(layout)
    assert inputs.attention_mask() is None and not inputs.block_causal
    assert inputs.packed_seq_params.qkv_format == "thd"
    assert inputs.packed_seq_params.cu_seqlens_q.tolist() == [0, 3, 7]
