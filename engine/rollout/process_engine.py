"""The embedded engine in a process of its own, beside the trainer on its device (``rollout.name:
torch-process``): colocated the way an SGLang server is, for machines without SGLang.

The child process holds the model (transformers' ``generate``, ``TorchRolloutEngine``) and, as
SGLang does, reserves a static pool for its KV cache when it starts: ``mem_fraction_static`` (here
``rollout.gpu_memory_utilization``) of the memory free then, less its weights (the same rule as
SGLang's, ``engine.rollout.base.sglang_static_pool_bytes``; transformers allocates its own cache
inside ``generate``, so the pool is a reservation that stands for SGLang's, not a cache that is
used). ``release_memory`` / ``resume_memory`` free and allocate weights and pool *in the child*
(with ``empty_cache`` there), and pushed weights travel by handle (CUDA IPC on a GPU, shared memory
on CPU). So the trainer's cached memory really competes with a second process: a training rank that
does not hand its cache back, or an engine started after the training models, fails here exactly as
with SGLang (``benchmarks/gpu_smoke.py`` runs this engine on a lent GPU for that reason). On CPU the
pool is the KV cache of one full batch of ``max_batch_size`` sequences of the model's context (a
fraction of host memory would take gigabytes for nothing).
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch

from engine.config.actor_rollout_ref import RolloutConfig
from engine.rollout.base import (
    KV_CACHE,
    MEMORY_TAGS,
    PauseMode,
    RolloutEngine,
    RolloutError,
    RolloutSample,
    SamplingParams,
    WeightUpdateError,
    check_memory_tags,
    check_pause_mode,
    sglang_static_pool_bytes,
)
from engine.rollout.shared_memory import use_file_system_sharing

POLL_S = 0.5
# Errors of the child's engine raised in the parent as the same class (anything else: RolloutError).
_RAISED_AS = {cls.__name__: cls for cls in (RolloutError, WeightUpdateError, ValueError, TypeError)}


class ProcessRolloutEngine(RolloutEngine):
    """``TorchRolloutEngine`` in a child process; every call is forwarded and answered in order.

    ``startup``: what the child measured when it started (``free_at_start_bytes``, ``weight_bytes``,
    ``pool_bytes``). Args as ``TorchRolloutEngine``'s.
    """

    def __init__(self, model_path: str, rollout: RolloutConfig, *, device: str | None = None, max_batch_size: int = 64,
                 pad_token_id: int | None = None, trust_remote_code: bool = False):
        self.rollout = rollout
        context = torch.multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._requests, child_requests = context.Pipe()
        self._control, child_control = context.Pipe()
        self._process = context.Process(
            target=_serve, name="trident-rollout-engine", daemon=True,
            args=(child_requests, child_control, model_path, dataclasses.asdict(rollout),
                  dict(device=device, max_batch_size=max_batch_size, pad_token_id=pad_token_id,
                       trust_remote_code=trust_remote_code)))
        self._process.start()
        child_requests.close()
        child_control.close()
        self._lock = threading.Lock()
        self._closed = False
        self.startup: dict[str, float] = self._answer(self._requests, "start")

    # ----------------------------------------------------------------------------- plumbing

    def _answer(self, connection, what: str) -> Any:
        """The child's answer on ``connection``; a dead child or an error there is a RolloutError."""
        while not connection.poll(POLL_S):
            if not self._process.is_alive():
                raise RolloutError(f"the rollout engine's process exited (code {self._process.exitcode}) during {what}")
        try:
            status, value = connection.recv()
        except EOFError:
            raise RolloutError(f"the rollout engine's process exited during {what}") from None
        if status != "ok":  # the engine's own error class where the caller may expect it
            error_class, message = value
            raise _RAISED_AS.get(error_class, RolloutError)(f"rollout engine process, {what}: {message}")
        return value

    def _call(self, operation: str, *args: Any) -> Any:
        if self._closed:
            raise RolloutError(f"{operation}() on a shut-down engine")
        with self._lock:
            self._requests.send((operation, args))
            return self._answer(self._requests, operation)

    def _control_call(self, operation: str, *args: Any) -> Any:
        """Pause and continue go through a second pipe, served while a generation is running."""
        self._control.send((operation, args))
        return self._answer(self._control, operation)

    # ----------------------------------------------------------------------------- the engine

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling_params: SamplingParams) -> list[list[RolloutSample]]:
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        return self._call("generate", [list(p) for p in prompt_token_ids], sampling_params)

    def begin_weight_update(self) -> None:
        self._call("begin_weight_update")

    def push_weights(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        # The tensors travel by handle and stay alive here until the child has copied them.
        self._call("push_weights", [(name, tensor.detach().contiguous()) for name, tensor in named_tensors])

    def end_weight_update(self) -> None:
        self._call("end_weight_update")

    def release_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._call("release_memory", check_memory_tags(tags))

    def resume_memory(self, tags: Sequence[str] = MEMORY_TAGS) -> None:
        self._call("resume_memory", check_memory_tags(tags))

    def memory(self) -> dict[str, float]:
        """The child's device memory now: its weights, its pool, and (on a GPU) its allocator's counts."""
        return self._call("memory")

    def resident_weight_bytes(self) -> int:
        return int(self.memory()["weight_bytes"])

    def pause_generation(self, mode: PauseMode = "abort") -> None:
        check_pause_mode(mode)
        self._control_call("pause_generation", mode)

    def continue_generation(self) -> None:
        self._control_call("continue_generation")

    def health(self) -> bool:
        if not self._process.is_alive():
            raise RolloutError(f"the rollout engine's process exited (code {self._process.exitcode})")
        return True

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            self._call("shutdown")
        except RolloutError:
            pass
        self._closed = True
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
        self._requests.close()
        self._control.close()


# ----------------------------------------------------------------------------- the child


class _Pool:
    """The static reservation SGLang makes for its KV cache (see the module doc)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes, self.device = nbytes, device
        self.tensor: torch.Tensor | None = None
        self.allocate()

    def allocate(self) -> None:
        if self.tensor is None:
            self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            if self.device.type == "cuda":
                self.tensor.fill_(0)  # touched, so the memory is really taken now

    def free(self) -> None:
        self.tensor = None


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def _pool_bytes(engine, rollout: RolloutConfig, free_at_start: int, weight_bytes: int, max_batch_size: int) -> int:
    if engine.device.type == "cuda":
        pool = int(sglang_static_pool_bytes(free_at_start, rollout.gpu_memory_utilization)) - weight_bytes
        if pool <= 0:
            raise RolloutError(f"gpu_memory_utilization={rollout.gpu_memory_utilization} of the {free_at_start / 2**30:.2f} "
                               f"GiB free when the engine started leaves no KV cache after its {weight_bytes / 2**30:.2f} "
                               "GiB of weights (was it started after the training models?)")
        return pool
    config = engine.model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = torch.empty((), dtype=engine.model.dtype).element_size()
    per_token = 2 * config.num_hidden_layers * heads * head_dim * element
    return per_token * max_batch_size * config.max_position_embeddings


def _serve(requests, control, model_path: str, rollout_fields: dict, launch: dict) -> None:
    from engine.rollout.torch_engine import TorchRolloutEngine

    try:
        rollout = RolloutConfig(**rollout_fields)
        device = torch.device(launch["device"] or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            use_file_system_sharing()
        free_at_start = _free_bytes(device)
        engine = TorchRolloutEngine(model_path, rollout, **launch)
        weight_bytes = engine.resident_weight_bytes()
        pool = _Pool(_pool_bytes(engine, rollout, free_at_start, weight_bytes, launch["max_batch_size"]), device)
    except BaseException as error:  # reported to the parent, which raises it
        requests.send(("error", (type(error).__name__, str(error))))
        return
    threading.Thread(target=_serve_control, args=(control, engine), daemon=True).start()
    requests.send(("ok", {"free_at_start_bytes": free_at_start, "weight_bytes": weight_bytes, "pool_bytes": pool.nbytes}))

    def release_memory(tags):
        engine.release_memory(tags)
        if KV_CACHE in tags:
            pool.free()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the freed blocks go back to the driver, for the trainer

    def resume_memory(tags):
        try:
            engine.resume_memory(tags)  # the weights, allocated again (zero-filled until the push)
            if KV_CACHE in tags:
                pool.allocate()
        except torch.OutOfMemoryError as error:
            free = _free_bytes(device) / 2**30
            raise RolloutError(f"resuming {list(tags)} ran out of device memory with {free:.2f} GiB free (does every "
                               f"training rank hand its cached memory back first?): {error}") from None

    def memory():
        report = {"weight_bytes": engine.resident_weight_bytes(), "pool_bytes": pool.nbytes if pool.tensor is not None else 0}
        if device.type == "cuda":
            report.update(allocated_bytes=torch.cuda.memory_allocated(device), reserved_bytes=torch.cuda.memory_reserved(device),
                          free_bytes=_free_bytes(device))
        return report

    _answer_requests(requests, {
        "generate": engine.generate, "begin_weight_update": engine.begin_weight_update,
        "push_weights": engine.push_weights, "end_weight_update": engine.end_weight_update,
        "release_memory": release_memory, "resume_memory": resume_memory, "memory": memory,
        "shutdown": lambda: None,
    })


def _serve_control(control, engine) -> None:
    _answer_requests(control, {"pause_generation": engine.pause_generation,
                               "continue_generation": engine.continue_generation})


def _answer_requests(connection, handlers: dict) -> None:
    """Answer ``(operation, args)`` requests on ``connection`` with ``("ok", result)`` or
    ``("error", (class name, message))``, until the parent is gone or asks for "shutdown"."""
    while True:
        try:
            operation, args = connection.recv()
        except EOFError:  # the parent is gone
            return
        try:
            connection.send(("ok", handlers[operation](*args)))
        except BaseException as error:
            connection.send(("error", (type(error).__name__, str(error))))
        if operation == "shutdown":
            return
