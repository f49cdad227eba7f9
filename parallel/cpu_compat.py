"""The CPU adaptation of megatron-core: the one place where Trident bends CUDA assumptions.

megatron-core 0.16.1 is written for GPUs: it calls ``torch.cuda.current_device()``,
``synchronize()`` and friends directly, creates tensors with ``device="cuda"`` in ~100 places
(schedules' token counts, the optimizer's ``found_inf``, grad clipping, dist-checkpointing), keeps
its tensor-parallel RNG streams as CUDA generator states and asserts ``param.type() ==
'torch.cuda.FloatTensor'`` in the optimizer. None of that math is CUDA-specific, so on a machine
without a GPU we run the real megatron-core code on CPU tensors by:

1. a process-wide ``TorchFunctionMode`` that rewrites every CUDA device argument to CPU
   (factory functions, ``Tensor.to``/``.cuda()``) and reports CPU float tensors under their CUDA
   type names to ``Tensor.type()``, which megatron uses only as a dtype key;
2. replacing the handful of ``torch.cuda`` runtime calls megatron makes with CPU equivalents
   (no-op synchronize/empty_cache/set_device, device 0, zero memory statistics);
3. a CPU RNG-states tracker standing in for ``CudaRNGStatesTracker`` (same protocol: named
   generator states that ``fork()`` swaps in and out, here on the CPU default generator);
4. allowing ``sequence_parallel`` with megatron's plain-torch norm (it refuses only because TE
   usually provides the norm; the local norm is sequence-parallel-correct once its weights'
   gradients are all-reduced, which megatron's DDP does for ``sequence_parallel`` params). What is
   missing here is transformer-engine, not CUDA: this one is installed wherever TE is (a GPU
   without TE builds the local spec too, and sequence parallelism is on by default);
5. 16-bit matrix products (``matmul``, ``@``, ``linear``, ``bmm``, ``baddbmm``, and the fused
   ``scaled_dot_product_attention``, whose CPU bf16 backward is ~3x slower than fp32's) computed as
   fp32 products of the bf16/fp16 inputs, rounded back to the input dtype. That is what a GPU's tensor
   cores compute (16-bit operands, fp32 accumulation, a rounded output); CPUs without AVX-512 BF16
   have no such kernel and torch falls back to a reference loop 50-70x slower than fp32 (measured
   here: 145 ms vs 2.7 ms for a 512x128 @ 128x1024 bf16 product). Patched as functions, so that
   megatron's linear layers' own backward passes (autograd Functions) take the fast path too;
6. ``torch.compile`` off (``torch._dynamo.config.disable``): megatron's jit fuser would compile for
   ~16 s on CPU, and dynamo's tracing rules reject the stand-ins of (2) ("Duplicate torch object");
7. the mode of (1) suspended inside the model's forward pass (``GPTModel.forward``) and the
   schedules' backward step: they create no CUDA tensors (their device queries go to the stand-ins
   of (2)), and each of their torch calls would otherwise pay the mode's Python dispatch (measured
   +1.7 us a call, +4.3 us before its fast path; on the demo model this took ~12k of the ~26k calls a
   PPO step made through the mode, ~70 per layer per forward or backward pass).
   The few places of the forward pass that do create CUDA tensors run with the mode again
   (:func:`_with_device_rewriting`: the unfused softmax's causal masks); a new one fails loudly
   ("Found no NVIDIA driver") and belongs in ``_model_compute_outside_mode`` (megatron's MoE
   aux-loss tracker will, when MoE runs here). Code that is not megatron's and runs many small
   ops (the embedded engine's HF generation) opts out with :func:`without_device_rewriting`;
8. MoE's all-to-all token dispatcher (the GPU default, kept here): it copies its split sizes to
   the host on a side CUDA stream, as numpy arrays (``_maybe_dtoh_and_synchronize``). On CPU the
   sizes are already host tensors, and megatron's copy skips them, so ``all_to_all_single`` would
   get tensors for split sizes and refuse them; here they only become numpy arrays, with no stream.
   With expert tensor parallelism it gathers and reduce-scatters tokens in uneven pieces over the
   expert TP group (a list ``all_gather`` / ``reduce_scatter``), which gloo does not have: the
   gather pads every piece to the largest and cuts the padding off, the reduce-scatter all-reduces
   the whole tensor and keeps this rank's piece. (The allgather dispatcher needs no bridge but
   aborts gloo when the ranks' token counts differ, which packed micro-batches make normal.)
9. dist-checkpointing's results queue: its writers report through a multiprocessing Manager that
   megatron starts with ``spawn`` at a process's first save (CUDA cannot be forked). That fresh
   interpreter imports torch once results reach it: ~5 s of CPU per rank and job, 12% of the CPU of
   a 4-rank rehearsal (py-spy). Without CUDA the Manager is forked instead, as megatron forks its
   writer processes from the same process anyway.
10. megatron's jit fuser off (``megatron.core.jit.disable_jit_fuser``) as soon as its module is
    imported, before any fusion is decorated with it: with dynamo off (6) the compiled functions run
    as plain Python anyway, and decorating them with ``torch.compile`` imports torch's inductor, 1.6 s
    of the 4.3 s ``import megatron.core`` takes here (measured), paid by every rank of every job.
    The hook lives in ``parallel/jit_import_hook.py`` (it must not import torch: importing
    ``engine.config`` stays torch-free) and is installed by ``parallel/__init__.py`` before megatron is
    imported; it checks for CUDA only when megatron is imported, and leaves the GPU path alone.

11. dist-checkpointing's asynchronous saves (:func:`async_checkpoint_queue`): Megatron-LM 0.16.1
    allows them only with the persistent worker (``--use-persistent-ckpt-worker``), a spawned process
    that copies each rank's GPU tensors to the host while the trainer waits, then writes them. On
    CPU that worker receives the trainer's own tensors through shared memory and its copy to the
    host copies nothing: tensors changed after the save was scheduled were written changed
    (measured), and the 2-rank checkpoint test job ran past its 300 s limit with it (not
    investigated further). Without CUDA the temporal worker is used: a fork per save, whose
    copy-on-write snapshot is the tensors as they were.
12. context parallelism's slice of the rotary embedding (``get_pos_emb_on_this_cp_rank``): megatron
    builds its two chunk indices in pinned host memory and copies them to the GPU, inside the
    forward pass (outside the mode of (1)); here the same ``index_select`` takes host indices. The CP
    attention itself, which megatron's local spec refuses, is ``parallel.context_parallel``'s
    stand-in for Transformer Engine's kernels (not a CUDA bridge: it runs wherever TE is missing).

``activate()`` does nothing else when CUDA is available: the GPU path runs megatron-core untouched
but for (4) where TE is missing (tests/test_cpu_compat.py proves both). Nothing else in Trident may
special-case CPU for megatron's sake; put any further bridge here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily

logger = logging.getLogger(__name__)

_ACTIVE: "_CudaToCpuMode | None" = None
_ORIGINALS: dict[tuple[object, str], Any] = {}

_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.DoubleTensor": "torch.cuda.DoubleTensor",
    "torch.LongTensor": "torch.cuda.LongTensor",
    "torch.IntTensor": "torch.cuda.IntTensor",
    "torch.BoolTensor": "torch.cuda.BoolTensor",
    "torch.ByteTensor": "torch.cuda.ByteTensor",
}
_CPU_TYPE_NAMES = {cuda: cpu for cpu, cuda in _CUDA_TYPE_NAMES.items()}


def is_active() -> bool:
    """True when the CPU adaptation is installed in this process."""
    return _ACTIVE is not None


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA ordinal in torch's device arguments (e.g. torch.cuda.current_device()).
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU for every torch call made while it is active.

    Every torch call of the process passes through here, so the common case (no device keyword,
    none of the three methods below) returns after one dict lookup and one set lookup.
    """

    _METHODS = frozenset({torch.Tensor.cuda, torch.Tensor.to, torch.Tensor.type})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            if _is_cuda_device(kwargs.get("device")):
                kwargs = {**kwargs, "device": "cpu"}
        else:
            kwargs = {}
        if func not in self._METHODS:
            return func(*args, **kwargs)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to:
            # Positional device of .to(); other methods' positional ints are sizes (new_empty(0)).
            args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
        elif len(args) == 1 and not kwargs:  # Tensor.type(): the type name
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        elif len(args) > 1 and isinstance(args[1], str):  # Tensor.type(name): a cast
            args = (args[0], _CPU_TYPE_NAMES.get(args[1], args[1]), *args[2:])
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """CPU stand-in for megatron's ``CudaRNGStatesTracker``, following its protocol.

    megatron keeps one named RNG stream per parallelism kind (data-parallel, model-parallel,
    expert-parallel) and forks into them around dropout and initialisation. Here each stream is a
    state of the CPU default generator.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        outer_state = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer_state)


_HALF = (torch.bfloat16, torch.float16)


def _via_fp32(original):
    """``original`` (a matrix product), computed in fp32 when every tensor input is a 16-bit CPU tensor
    (keyword tensors of that dtype, e.g. SDPA's additive ``attn_mask``, are widened with them)."""

    def product(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        dtype = tensors[0].dtype if tensors else None
        if dtype not in _HALF or "out" in kwargs or any(t.dtype != dtype or t.is_cuda for t in tensors):
            return original(*args, **kwargs)
        widened = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        keywords = {key: value.float() if isinstance(value, torch.Tensor) and value.dtype == dtype else value
                    for key, value in kwargs.items()}
        return original(*widened, **keywords).to(dtype)

    product.__wrapped__ = original
    return product


def _fast_half_precision_products() -> None:
    for owner, names in ((torch, ("matmul", "bmm", "baddbmm", "mm")),
                         (torch.nn.functional, ("linear", "scaled_dot_product_attention")),
                         (torch.Tensor, ("matmul", "__matmul__", "bmm", "baddbmm", "mm"))):
        for name in names:
            _patch(owner, name, _via_fp32(getattr(owner, name)))


def _patch(owner: object, name: str, value: Any) -> None:
    _ORIGINALS.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, value)


def without_device_rewriting(function):
    """``function`` run with the mode of (1) suspended, for code that creates no CUDA tensors.

    A no-op on the GPU path (the mode is never installed) and when another mode was pushed on top
    of ours (e.g. by a test): that one stays in charge.
    """

    @functools.wraps(function)
    def run(*args, **kwargs):
        if _ACTIVE is None or _get_current_function_mode() is not _ACTIVE:
            return function(*args, **kwargs)
        with _pop_mode_temporarily():
            return function(*args, **kwargs)

    return run


def _with_device_rewriting(function):
    """``function`` run with the mode of (1) back in force, inside a ``without_device_rewriting`` region."""

    @functools.wraps(function)
    def run(*args, **kwargs):
        if _ACTIVE is None or _get_current_function_mode() is _ACTIVE:
            return function(*args, **kwargs)
        with _ACTIVE:
            return function(*args, **kwargs)

    return run


def _model_compute_outside_mode() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.gpt import gpt_model
    from megatron.core.pipeline_parallel import schedules

    _patch(gpt_model.GPTModel, "forward", without_device_rewriting(gpt_model.GPTModel.forward))
    _patch(schedules, "backward_step", without_device_rewriting(schedules.backward_step))
    # The unfused softmax (dropout in training, non-SDPA attention) builds its causal masks on "cuda".
    softmax = fused_softmax.FusedScaleMaskSoftmax
    _patch(softmax, "forward_torch_softmax", _with_device_rewriting(softmax.forward_torch_softmax))


def _moe_alltoall_without_streams() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def splits_to_host(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    _patch(MoEAlltoAllTokenDispatcher, "_maybe_dtoh_and_synchronize", splits_to_host)
    # Not None, so that the constructor does not create its CUDA side stream.
    _patch(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", "no side stream on CPU")

    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(size) for size in output_split_sizes]
        padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:size] for piece, size in zip(pieces, sizes)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(total, group=group)
        return total.split([int(size) for size in input_split_sizes])[group.rank()].contiguous()

    _patch(mappings, "_gather_along_first_dim", gather_uneven)
    _patch(mappings, "_reduce_scatter_along_first_dim", reduce_scatter_uneven)


def _rotary_cp_slice_on_host() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    from parallel.context_parallel import row_positions

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        held = row_positions(pos_emb.shape[seq_dim], cp_group.size(), cp_group.rank(), pos_emb.device)
        return pos_emb.index_select(seq_dim, held)

    for module in (rotary_pos_embedding, yarn_rotary_pos_embedding):
        _patch(module, "get_pos_emb_on_this_cp_rank", get_pos_emb_on_this_cp_rank)


def _returning(value: Any):
    """A fresh stand-in function returning ``value``: one object per replaced name, since dynamo's
    rule table refuses one function object under two torch.cuda names."""
    def stand_in(*_args: Any, **_kwargs: Any) -> Any:
        return value() if callable(value) else value

    return stand_in


def _cuda_runtime_stand_ins() -> dict[str, Any]:
    return {
        # megatron passes this as a device argument almost everywhere; returning the CPU device
        # (not ordinal 0, which torch reads as cuda:0) keeps it right even where the function
        # mode is not consulted, e.g. inside autograd backward called through the mode.
        "current_device": _returning(lambda: torch.device("cpu")),
        "set_device": _returning(None),
        "synchronize": _returning(None),
        "empty_cache": _returning(None),
        "memory_allocated": _returning(0),
        "max_memory_allocated": _returning(0),
        "memory_reserved": _returning(0),
        "reset_peak_memory_stats": _returning(None),
        "manual_seed": _returning(None),  # megatron seeds its streams through the tracker; CPU seed is ours.
    }


def _transformer_engine_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _allow_sequence_parallel_torch_norm() -> None:
    from megatron.core.transformer import torch_norm

    if (torch_norm.WrappedTorchNorm, "__new__") in _ORIGINALS:
        return  # already allowed (activate() is idempotent)
    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False  # its assert is the only use of the flag in the wrapper
        try:
            norm = original_new(cls, config, hidden_size, *args, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for param in norm.parameters():
            # megatron's DDP all-reduces grads of params marked sequence_parallel across TP.
            setattr(param, "sequence_parallel", sequence_parallel)
        return norm

    _patch(torch_norm.WrappedTorchNorm, "__new__", staticmethod(new))


def _checkpoint_results_queue_by_fork() -> None:
    import multiprocessing

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queues = []

    def results_queue():
        if not queues:
            queues.append(multiprocessing.get_context("fork").Manager().Queue())
        return queues[0]

    _patch(filesystem_async, "_get_write_results_queue", results_queue)


def async_checkpoint_queue():
    """dist-checkpointing's queue of asynchronous saves: the persistent worker on GPUs, as Megatron-LM
    requires, the temporal (forked) one where the CPU adaptation is active (11)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue(persistent=not is_active())


def activate() -> bool:
    """Install the CPU adaptation if this process has no usable GPU, and (4) wherever
    transformer-engine is missing. Idempotent.

    Returns True when the CPU adaptation is (now) active, False on the GPU path.
    """
    global _ACTIVE
    if not _transformer_engine_installed():
        _allow_sequence_parallel_torch_norm()
    if torch.cuda.is_available():
        return False
    if _ACTIVE is not None:
        return True
    from megatron.core.tensor_parallel import random as megatron_random

    for name, stand_in in _cuda_runtime_stand_ins().items():
        _patch(torch.cuda, name, stand_in)
    _patch(megatron_random, "CudaRNGStatesTracker", CpuRNGStatesTracker)
    # Activation recompute saves and restores "the CUDA RNG state" around the recomputed region.
    _patch(megatron_random, "_get_cuda_rng_state", lambda *_a, **_k: torch.get_rng_state())
    _patch(megatron_random, "_set_cuda_rng_state", lambda state, *_a, **_k: torch.set_rng_state(state))
    _fast_half_precision_products()
    _model_compute_outside_mode()
    _moe_alltoall_without_streams()
    _checkpoint_results_queue_by_fork()
    _rotary_cp_slice_on_host()
    from torch import _dynamo

    _patch(_dynamo.config, "disable", True)
    mode = _CudaToCpuMode()
    mode.__enter__()
    _ACTIVE = mode
    logger.info("megatron-core CPU adaptation active (no CUDA device found)")
    return True


def deactivate() -> None:
    """Undo ``activate()`` (used by tests; a training process keeps it for its lifetime)."""
    global _ACTIVE
    if _ACTIVE is None:
        return
    _ACTIVE.__exit__(None, None, None)
    _ACTIVE = None
    for (owner, name), original in reversed(list(_ORIGINALS.items())):
        setattr(owner, name, original)
    _ORIGINALS.clear()
