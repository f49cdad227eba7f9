"""Offload a megatron model's parameters, gradient buffers and optimizer state to host memory and back.

In colocated mode every role shares the GPUs with the rollout engine, so what a phase does not use
can leave the device (verl's ``param_offload`` / ``grad_offload`` / ``optimizer_offload``). The
unit moved is a tensor *storage*: megatron's DDP keeps parameters and ``main_grad`` as views into
flat buffers, and a storage resized to 0 bytes frees its memory while every view keeps pointing to
it; resized back and refilled, the views see the same values (bit for bit). So there is never a
second resident copy on the device: the device storage is freed (on CPU too, which makes the drop
measurable here); the host buffers are allocated once (pinned on GPU machines: pinning is slow, the
copies fast) and reused at every offload.

Gradients are not copied: megatron zeroes the gradient buffers before every mini-batch, so they
are freed and come back zeroed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

PARTS = ("params", "grads", "optimizer")


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each storage once (``_cdata`` names the storage itself, stable across resizes)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen.setdefault(storage._cdata, storage)
    return list(seen.values())


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage (copies every byte whatever the tensors' dtypes)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Part:
    """One offloadable part: how to find its storages (Adam creates its state at the first step),
    their sizes and the host buffers that hold them while offloaded."""

    collect: Callable[[], list[torch.UntypedStorage]]
    copy_back: bool  # False: the contents are not needed afterwards (zeroed instead)
    storages: list[torch.UntypedStorage] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    host: list[torch.Tensor] = field(default_factory=list)
    offloaded: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the part (on the device, or on the host while offloaded)."""
        return sum(self.sizes) if self.offloaded else sum(s.nbytes() for s in self.collect())

    def offload(self) -> None:
        if self.offloaded:
            return
        pin = torch.cuda.is_available()
        self.storages = [storage for storage in self.collect() if storage.nbytes()]
        sizes = [storage.nbytes() for storage in self.storages]
        if self.copy_back and sizes != self.sizes:  # host buffers: allocated (pinned) once, reused
            self.host = [torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=pin) for size in sizes]
        self.sizes = sizes
        if self.copy_back:
            for storage, copy in zip(self.storages, self.host):
                copy.copy_(_bytes_view(storage), non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        for storage in self.storages:
            storage.resize_(0)
        if pin:
            torch.cuda.empty_cache()  # back to the driver: the engine is another process
        self.offloaded = True

    def reload(self) -> None:
        if not self.offloaded:
            return
        for index, (storage, size) in enumerate(zip(self.storages, self.sizes)):
            storage.resize_(size)
            view = _bytes_view(storage)
            if self.copy_back:
                view.copy_(self.host[index], non_blocking=self.host[index].is_pinned())
            else:
                view.zero_()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.offloaded = False


class ModelOffloader:
    """The offloadable parts of one model: ``params`` (every parameter storage of the chunks, with
    DDP's flat parameter buffers), ``grads`` (DDP's gradient buffers) and ``optimizer`` (the Adam
    moments and fp32 main weights of a megatron optimizer; storages shared with the model's
    parameters, as fp32 models have, stay with ``params``).

    ``enabled``: the parts this model offloads between its phases (the config's ``*_offload``);
    ``resident(*parts)`` brings parts in for a phase and sends the enabled ones out afterwards.
    """

    def __init__(self, model_chunks: Sequence[torch.nn.Module], optimizer=None, *, enabled: Sequence[str] = ()) -> None:
        unknown = set(enabled) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown offload part(s) {sorted(unknown)}; parts are {PARTS}")
        self.enabled = tuple(enabled)
        # told of each move ("offload" / "onload", the parts that moved): the run's memory record
        self.observer: Callable[[str, list[str]], None] | None = None
        chunks = list(model_chunks)
        parameters = [p for chunk in chunks for p in chunk.parameters()]
        buffers = [buffer for chunk in chunks for buffer in _ddp_buffers(chunk)]
        param_storages = _unique_storages([*parameters, *(b.param_data for b in buffers if b.param_data is not None)])
        grad_storages = _unique_storages(b.grad_data for b in buffers)
        model_storages = {s._cdata for s in (*param_storages, *grad_storages)}

        def optimizer_storages() -> list[torch.UntypedStorage]:
            return [s for s in _unique_storages(_optimizer_tensors(optimizer)) if s._cdata not in model_storages]

        self.parts = {
            "params": _Part(lambda: param_storages, copy_back=True),
            "grads": _Part(lambda: grad_storages, copy_back=False),
            "optimizer": _Part(optimizer_storages, copy_back=True),
        }

    def nbytes(self, part: str) -> int:
        """Bytes of ``part``, on the device or (offloaded) on the host."""
        return self.parts[part].nbytes

    def resident_parts(self) -> list[str]:
        """The parts on the device now (all but the offloaded ones)."""
        return [name for name, part in self.parts.items() if not part.offloaded]

    def offload(self, *parts: str) -> None:
        moved = [part for part in parts if not self.parts[part].offloaded]
        for part in moved:
            self.parts[part].offload()
        self._tell("offload", moved)

    def reload(self, *parts: str) -> None:
        moved = [part for part in parts if self.parts[part].offloaded]
        for part in moved:
            self.parts[part].reload()
        self._tell("onload", moved)

    def _tell(self, move: str, parts: list[str]) -> None:
        if parts and self.observer is not None:
            self.observer(move, parts)

    def offload_enabled(self) -> None:
        """Send the enabled parts out (after the model is built, and between its phases)."""
        self.offload(*self.enabled)

    @contextlib.contextmanager
    def resident(self, *parts: str):
        """``parts`` on the device inside the block; the enabled ones offloaded again after it."""
        self.reload(*parts)
        try:
            yield
        finally:
            self.offload(*(part for part in parts if part in self.enabled))


def _ddp_buffers(chunk: torch.nn.Module) -> list:
    """megatron DDP's flat parameter/gradient buffers (lists; ``nn.Module.buffers`` is a method)."""
    found = []
    for name in ("buffers", "expert_parallel_buffers"):
        value = getattr(chunk, name, None)
        if isinstance(value, list):
            found.extend(value)
    return found


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Adam's state tensors and the fp32 main parameters of a megatron optimizer (chained or not)."""
    if optimizer is None:
        return []
    tensors: list[torch.Tensor] = []
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        for group in inner.param_groups:
            tensors.extend(group["params"])
        for state in inner.state.values():
            tensors.extend(value for value in state.values() if torch.is_tensor(value) and value.dim() > 0)
    return tensors
