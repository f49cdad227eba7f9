"""Process groups: torch.distributed and megatron-core's parallel state, started from a layout.

A thin layer over ``megatron.core.parallel_state``: NCCL on GPU, gloo on CPU (where
``parallel.cpu_compat`` adapts megatron-core). Ranks are read from the torchrun environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

The control plane runs on gloo, on every device: barriers and object gathers while some ranks wait
on others (leaders starting rollout servers or waiting on HTTP generation, rank 0 renaming a
checkpoint) go over ``control_group()`` and the gloo groups of ``control_groups``, created with the
job's collective timeout. On NCCL such a wait would spin a kernel on the GPU (time-slicing it with
SGLang's decode) and end at NCCL's timeout instead of the configured one (verl and slime do the
same; gloo needs ``GLOO_SOCKET_IFNAME`` where the default route is not the cluster network).
"""

from __future__ import annotations

import datetime
import os
import random

import numpy as np
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


# The control plane's gloo groups, by the ranks they hold (tuple() = the world), and their timeout.
_CONTROL_GROUPS: dict[tuple[int, ...], object] = {}
_CONTROL_TIMEOUT: list[datetime.timedelta] = []


def control_group():
    """The world's control-plane group: gloo, with the job's collective timeout (see the module doc)."""
    if () not in _CONTROL_GROUPS:
        raise RuntimeError("torch.distributed is not initialised; call parallel.state.init_distributed() first")
    return _CONTROL_GROUPS[()]


def control_groups(rank_lists: list[list[int]]):
    """The gloo control group of this rank among ``rank_lists`` (a partition of the world, the same
    on every rank), created once per partition with the job's collective timeout; collective the
    first time it is asked for."""
    key = tuple(sorted(tuple(ranks) for ranks in rank_lists))
    mine = next(tuple(ranks) for ranks in key if dist.get_rank() in ranks)
    if mine not in _CONTROL_GROUPS:
        for ranks in key:  # every rank creates every group of the partition, in the same order
            group = dist.new_group(list(ranks), backend="gloo", timeout=_CONTROL_TIMEOUT[0])
            _CONTROL_GROUPS.setdefault(ranks, group)
    return _CONTROL_GROUPS[mine]


def control_group_like(group):
    """The gloo control group holding ``group``'s ranks (in its order); collective over the world."""
    partition: list = [None] * dist.get_world_size()
    dist.all_gather_object(partition, dist.get_process_group_ranks(group), group=control_group())
    return control_groups([list(ranks) for ranks in {tuple(ranks): None for ranks in partition}])


def control_plane_timeout() -> datetime.timedelta:
    """The timeout of every control-plane group (``trainer.collective_timeout_minutes``)."""
    return _CONTROL_TIMEOUT[0]


def is_control_group(group) -> bool:
    return any(group is known for known in _CONTROL_GROUPS.values())


def init_distributed(timeout_minutes: int = 30) -> None:
    """Start the default process group from the torchrun environment (a world of 1 without it),
    and the control plane's gloo group with the same timeout."""
    if dist.is_initialized():
        return
    cpu_compat.activate()
    if torch.cuda.is_available():
        # One hardware queue, so that tensor-parallel communication kernels run in the order they are
        # issued and overlap compute as megatron plans it (megatron-core warns without it; Megatron-LM
        # asserts it for TP > 1). Read when this process's CUDA context is made, which is next.
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" not in os.environ:  # a plain `python ...` run: a single-rank world
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend() == "gloo":
        _gloo_groups_share_devices()
    timeout = datetime.timedelta(minutes=timeout_minutes)
    dist.init_process_group(backend=backend(), timeout=timeout)
    _CONTROL_TIMEOUT[:] = [timeout]
    _CONTROL_GROUPS[()] = dist.new_group(backend="gloo", timeout=timeout)


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
        hierarchical_context_parallel_sizes=layout.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def seed_everything(seed: int) -> None:
    """Seed Python, numpy, torch (CPU and CUDA) identically on every rank; megatron offsets per TP rank."""
    random.seed(seed)
    np.random.seed(seed)  # reward functions and user code draw from it too (megatron seeds it as well)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    _CONTROL_GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


# Ports below this are left to services a node runs on well-known and registered ports.
_LOW_PORT = 20000


def address_towards(host: str, port: int) -> str:
    """This machine's IP address on the route to ``host`` (what a process there connects back to);
    a UDP ``connect`` picks the route without sending anything."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return probe.getsockname()[0]


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a process that binds it later (a server, a rendezvous).

    Drawn at random below the kernel's ephemeral range: a port the OS hands out (``bind(host, 0)``,
    the local end of any outgoing connection, gloo's and Ray's own sockets) comes from that range,
    so it could be taken by any process on the node between this call and the later bind
    (observed: an SGLang server of a 4-rank job lost its HTTP port that way and never served).
    SGLang picks its scheduler's port the same way (``sglang/srt/utils/network.py``,
    ``get_free_port_below_ephemeral``). The OS's own pick where no such range is left."""
    import random
    import socket

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            ephemeral_low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    candidates = range(_LOW_PORT, ephemeral_low)
    # The OS's randomness: ranks seeded alike draw different ports, and no job's seeded stream moves.
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
