"""Process groups: torch.distributed and megatron-core's parallel state, started from a layout.

A thin layer over ``megatron.core.parallel_state``: NCCL on GPU, gloo on CPU (where
``parallel.cpu_compat`` adapts megatron-core). Ranks are read from the torchrun environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import datetime
import os
import random

import torch
import torch.distributed as dist

from parallel import cpu_compat
from parallel.layout import ParallelLayout


def device() -> torch.device:
    """The device this rank computes on: its local GPU, or the CPU when there is none."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(timeout_minutes: int = 30) -> None:
    """Start the default process group from the torchrun environment (a world of 1 without it)."""
    if dist.is_initialized():
        return
    cpu_compat.activate()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:  # a plain `python ...` run: a single-rank world
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend() == "gloo":
        _gloo_groups_share_devices()
    dist.init_process_group(backend=backend(), timeout=datetime.timedelta(minutes=timeout_minutes))


def _gloo_groups_share_devices() -> None:
    """Every gloo process group of this process on the same gloo device(s).

    torch gives each gloo group a device of its own, and each device runs an I/O thread that wakes
    every 10 ms (``epoll_wait`` with a 10 ms timeout) even when idle. megatron-core creates ~20
    groups, so an idle CPU rank woke ~2,700 times a second (115 with one device), and during PPO
    steps its compute threads were preempted 14x as often as a plain PyTorch loop's (4.6x with one
    device). One shared device multiplexes every group's connections on one event loop.
    The devices are built as torch builds them (``GLOO_SOCKET_IFNAME``, else the default device).
    """
    from torch.distributed import ProcessGroupGloo
    from torch.distributed.distributed_c10d import Backend

    devices: list = []

    def create(opts, _backend_options):
        if not devices:
            interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
            devices.extend([ProcessGroupGloo.create_device(interface=name) for name in interfaces]
                           or [ProcessGroupGloo.create_default_device()])
        options = ProcessGroupGloo._Options()
        options._devices = devices
        options._threads = 2 * len(devices)
        options._timeout = opts.timeout
        group = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)
        group.options.global_ranks_in_group = opts.global_ranks_in_group
        group.options.group_name = opts.group_id
        return group

    Backend._plugins["GLOO"] = Backend._BackendPlugin(create, extended_api=True)


def initialize_model_parallel(
    layout: ParallelLayout, seed: int = 1234, timeout_minutes: int = 30
) -> None:
    """Start torch.distributed (if needed) and megatron's TP/PP/VPP/CP/DP groups for ``layout``."""
    from megatron.core import parallel_state, tensor_parallel

    init_distributed(timeout_minutes)
    layout.validate(dist.get_world_size())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def seed_everything(seed: int) -> None:
    """Seed Python, torch (CPU and CUDA) identically on every rank; megatron offsets per TP rank."""
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def address_towards(host: str, port: int) -> str:
    """This machine's IP address on the route to ``host`` (what a process there connects back to);
    a UDP ``connect`` picks the route without sending anything."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` now (rendezvous and server ports of launchers and tests)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
