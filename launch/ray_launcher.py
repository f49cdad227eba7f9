"""Run the Trident SPMD program on a Ray cluster: one worker per device, as torchrun would.

    python -m launch.ray_launcher yaml/X.yaml --num-gpus 16 [--gpus-per-node 8]
        [--placement-strategy STRICT_PACK|PACK] [--device gpu|cpu] [--rollout-gpus K | --rollout-nodes K]
        [--max-restarts N] [--dry-run] [key=value ...]

Workers are placed with a placement group: STRICT_PACK (default) makes one group per node of
``--gpus-per-node`` bundles, so every node is filled completely and ranks are contiguous per
node; PACK makes one group of all bundles and lets Ray pack them as tightly as it can. Each
worker is a Ray actor that starts the entry program (``python -m launch.main`` by default) as a
child process with the torchrun environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
NODE_RANK, MASTER_ADDR, MASTER_PORT, and CUDA_VISIBLE_DEVICES listing the node's GPUs of this
job (so LOCAL_RANK indexes them, as under torchrun). The program cannot tell the two launchers
apart. A child process (rather than a call inside the actor) gives each rank a fresh interpreter
and a clean exit, like torchrun's agent.

``--rollout-gpus K`` (disaggregated rollout, one node): the node's placement group also reserves
K GPUs for the SGLang servers rank 0 starts (held by idle workers, so Ray gives them to no one
else); they follow the trainer's GPUs in that node's CUDA_VISIBLE_DEVICES, where the trainer
looks for them, and the program gets ``actor_rollout_ref.rollout.mode=disaggregated``,
``rollout.num_gpus=K`` and ``trainer.n_gpus_per_node``.

``--rollout-nodes K`` (disaggregated rollout on nodes of their own): K more placement groups, one
node each (a bundle of ``--gpus-per-node`` GPUs), each with one actor running
``python -m launch.rollout_servers`` (SGLang servers on all its GPUs, on the node's address). The
driver generates the job's API key and hands it to the servers and the trainers in their
environment only; once every rollout node has reported its servers' addresses, the trainers start
with ``actor_rollout_ref.rollout.mode=disaggregated`` and ``rollout.server_addresses`` set to them.
The servers stop with the job.

The cluster is the one in RAY_ADDRESS (see launch/ray/start_cluster_in_slurm.sh), or a local one.
If any rank fails, the others are terminated and the launcher exits with that rank's status, or,
with ``--max-restarts N``, starts every rank again on the same workers (at most N times), as
torchrun's agent does: a fresh rendezvous port, ``TORCHELASTIC_RESTART_COUNT`` set to the attempt,
and the program resumes from the newest complete checkpoint. Rollout nodes keep their servers.
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from engine.rollout.sglang_launch import API_KEY_ENV

REPO_ROOT = Path(__file__).resolve().parent.parent
PLACEMENT_STRATEGIES = ("STRICT_PACK", "PACK")
DEVICES = ("gpu", "cpu")
PLACEMENT_TIMEOUT_S = 300
ROLLOUT_START_TIMEOUT_S = 3600  # an outer bound: launch.rollout_servers applies rollout.startup_timeout_s itself
TERMINATE_GRACE_S = 10
TIMEOUT_STATUS = 124  # --timeout-s ran out (as timeout(1) exits)
LOG_TAIL_LINES = 200


class RayLaunchError(RuntimeError):
    """The job cannot be placed or started; the message says what the cluster lacks."""


@dataclass(frozen=True)
class RayLaunchConfig:
    """What to run and how to place it.

    ``num_workers`` ranks (one per GPU, or per CPU bundle with ``device="cpu"``), in groups of
    ``workers_per_node``; ``program_args`` (the yaml, then the overrides) go to ``entry_module``.
    """

    program_args: tuple[str, ...]
    num_workers: int
    workers_per_node: int = 8
    placement_strategy: str = "STRICT_PACK"
    device: str = "gpu"
    cpus_per_worker: float = 1.0
    entry_module: str = "launch.main"
    log_dir: str | None = None
    timeout_s: float | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    rollout_gpus: int = 0
    rollout_nodes: int = 0
    max_restarts: int = 0

    def validate(self) -> None:
        if self.rollout_gpus < 0:
            raise RayLaunchError(f"--rollout-gpus must be >= 0, got {self.rollout_gpus}")
        if self.rollout_gpus and (self.placement_strategy != "STRICT_PACK"
                                  or self.num_workers + self.rollout_gpus > self.workers_per_node):
            raise RayLaunchError(
                f"--rollout-gpus {self.rollout_gpus} puts the servers on the trainer's node: it needs STRICT_PACK and "
                f"--num-gpus {self.num_workers} + {self.rollout_gpus} <= --gpus-per-node {self.workers_per_node} "
                f"(for servers on nodes of their own use --rollout-nodes)")
        if self.rollout_nodes < 0 or (self.rollout_nodes and self.rollout_gpus):
            raise RayLaunchError(f"--rollout-nodes must be >= 0 and excludes --rollout-gpus, got "
                                 f"--rollout-nodes {self.rollout_nodes} --rollout-gpus {self.rollout_gpus}")
        if self.num_workers < 1:
            raise RayLaunchError(f"--num-gpus must be >= 1, got {self.num_workers}")
        if self.max_restarts < 0:
            raise RayLaunchError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.workers_per_node < 1:
            raise RayLaunchError(f"--gpus-per-node must be >= 1, got {self.workers_per_node}")
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise RayLaunchError(f"--placement-strategy must be one of {PLACEMENT_STRATEGIES}, got {self.placement_strategy!r}")
        if self.device not in DEVICES:
            raise RayLaunchError(f"--device must be one of {DEVICES}, got {self.device!r}")
        if (
            self.placement_strategy == "STRICT_PACK"
            and self.num_workers > self.workers_per_node
            and self.num_workers % self.workers_per_node
        ):
            raise RayLaunchError(
                f"STRICT_PACK fills whole nodes: --num-gpus {self.num_workers} is not a multiple of "
                f"--gpus-per-node {self.workers_per_node}"
            )
        if not self.program_args:
            raise RayLaunchError("missing the experiment yaml")

    def bundle(self) -> dict[str, float]:
        resources = {"CPU": self.cpus_per_worker}
        if self.device == "gpu":
            resources["GPU"] = 1.0
        return resources

    def placement_groups(self) -> list[list[dict[str, float]]]:
        """Bundles per placement group: one group per node for STRICT_PACK, one in all for PACK;
        the first group ends with the rollout servers' bundles."""
        if self.placement_strategy == "PACK":
            return [[self.bundle() for _ in range(self.num_workers)]]
        sizes = [min(self.workers_per_node, self.num_workers - start) for start in range(0, self.num_workers, self.workers_per_node)]
        sizes[0] += self.rollout_gpus
        return [[self.bundle() for _ in range(size)] for size in sizes]

    def rollout_node_bundle(self) -> dict[str, float]:
        """A rollout node's one bundle: all its GPUs (CPU only with ``device="cpu"``, where the node runs one server)."""
        if self.device == "gpu":
            return {"CPU": self.cpus_per_worker, "GPU": float(self.workers_per_node)}
        return {"CPU": self.cpus_per_worker}

    def command(self, python: str = sys.executable, server_addresses: Sequence[str] = ()) -> list[str]:
        disaggregated: tuple[str, ...] = ()
        if self.rollout_gpus:
            disaggregated = ("actor_rollout_ref.rollout.mode=disaggregated", f"actor_rollout_ref.rollout.num_gpus={self.rollout_gpus}",
                             f"trainer.n_gpus_per_node={self.num_workers}")
        elif self.rollout_nodes:
            disaggregated = ("actor_rollout_ref.rollout.mode=disaggregated",
                             f"actor_rollout_ref.rollout.server_addresses=[{','.join(server_addresses)}]")
        return [python, "-m", self.entry_module, *self.program_args, *disaggregated]

    def rollout_servers_command(self, address_file: str, log_dir: str, python: str = sys.executable) -> list[str]:
        """What each rollout node runs."""
        return [python, "-m", "launch.rollout_servers", *self.program_args, "--address-file", address_file,
                "--log-dir", log_dir]


@dataclass(frozen=True)
class WorkerPlacement:
    """Where a worker landed: its node and the GPU ids Ray gave it (empty on CPU)."""

    node_ip: str
    gpu_ids: tuple[str, ...]


def rank_environments(placements: list[WorkerPlacement], master_port: int,
                      rollout: WorkerPlacement | None = None) -> list[dict[str, str]]:
    """The torchrun environment of each worker, in the order of ``placements``.

    Ranks are numbered node by node (nodes in order of first appearance, i.e. of placement
    groups / bundles), and within a node by GPU id (by bundle order on CPU). Every worker sees the
    GPUs of all workers of the job on its node, so LOCAL_RANK indexes CUDA_VISIBLE_DEVICES;
    ``rollout``: the GPUs reserved for the rollout servers, appended on their node.
    """
    nodes: list[str] = []
    for placement in placements:
        if placement.node_ip not in nodes:
            nodes.append(placement.node_ip)

    def order(index: int) -> tuple:
        placement = placements[index]
        gpu_key = tuple(int(gpu) if str(gpu).isdigit() else str(gpu) for gpu in placement.gpu_ids)
        return (nodes.index(placement.node_ip), gpu_key, index)

    ordered = sorted(range(len(placements)), key=order)
    rank_of = {worker: rank for rank, worker in enumerate(ordered)}
    master_addr = placements[ordered[0]].node_ip
    environments = []
    for worker, placement in enumerate(placements):
        same_node = [w for w in ordered if placements[w].node_ip == placement.node_ip]
        env = {
            "RANK": str(rank_of[worker]),
            "WORLD_SIZE": str(len(placements)),
            "LOCAL_RANK": str(same_node.index(worker)),
            "LOCAL_WORLD_SIZE": str(len(same_node)),
            "NODE_RANK": str(nodes.index(placement.node_ip)),
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
        }
        if placement.gpu_ids:
            gpus = [gpu for w in same_node for gpu in placements[w].gpu_ids]
            if rollout is not None and rollout.node_ip == placement.node_ip:
                gpus += list(rollout.gpu_ids)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        environments.append(env)
    return environments


class SpmdWorker:
    """Ray actor body: reports its placement, then runs one rank of the SPMD program as a child.

    Runs threaded (max_concurrency=2) so that ``terminate`` can stop a ``run`` in progress.
    """

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._terminated = False

    def placement(self) -> WorkerPlacement:
        import ray

        return WorkerPlacement(ray.util.get_node_ip_address(), tuple(str(gpu) for gpu in ray.get_gpu_ids()))

    def free_port(self) -> int:
        from parallel.state import find_free_port

        return find_free_port("")

    def run(self, command: list[str], env: dict[str, str], cwd: str, log_path: str | None) -> tuple[int, str]:
        """Run ``command`` with ``env`` added; its output goes to this actor's stdout (Ray forwards
        it to the driver) and to ``log_path``. Returns (exit status, last lines of output)."""
        child_env = {**os.environ, **env}
        tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        log = open(log_path, "a", buffering=1) if log_path else None
        try:
            with self._lock:
                if self._terminated:
                    return -signal.SIGTERM, "terminated before start"
                # Own process group: terminate() reaches the program's own children too.
                self._process = subprocess.Popen(
                    command, env=child_env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True, start_new_session=True,
                )
            prefix = f"[rank {env['RANK']}] "
            for line in self._process.stdout:
                tail.append(line)
                print(prefix + line, end="", flush=True)
                if log:
                    log.write(line)
            return self._process.wait(), "".join(tail)
        finally:
            if log:
                log.close()

    def start_rollout_servers(self, command: list[str], env: dict[str, str], cwd: str, address_file: str,
                              log_path: str, timeout_s: float) -> list[str]:
        """Start ``launch.rollout_servers`` (``command``) as this actor's child and return the
        addresses it writes to ``address_file`` (on this node) once its servers answer; the child
        keeps running until ``terminate``. Raises when it exits first or ``timeout_s`` passes."""
        with self._lock:
            if self._terminated:
                raise RuntimeError("terminated before start")
            with open(log_path, "a") as log:
                self._process = subprocess.Popen(command, env={**os.environ, **env}, cwd=cwd, stdout=log,
                                                 stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(address_file):
            if self._process.poll() is not None:
                raise RuntimeError(f"launch.rollout_servers exited with {self._process.returncode}; log {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"launch.rollout_servers was not ready after {timeout_s:.0f} s; log {log_path}")
            time.sleep(1.0)
        with open(address_file) as addresses:
            return addresses.read().split()

    def rearm(self) -> None:
        """After ``terminate``: let the next ``run`` start (a restarted job)."""
        with self._lock:
            self._terminated, self._process = False, None

    def terminate(self) -> None:
        """Stop the child's process group: SIGTERM, then SIGKILL after a grace period."""
        with self._lock:
            self._terminated = True
            process = self._process
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=TERMINATE_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def dry_run_lines(config: RayLaunchConfig, python: str = sys.executable) -> list[str]:
    """What ``launch`` would do, for the placement STRICT_PACK guarantees (one group per node).

    Node addresses and the port are known only once Ray has placed the workers; they are printed
    as <node of group K> and <free port on rank 0's node>. With PACK the ranks' nodes are Ray's
    choice, shown as <node of bundle K>.
    """
    lines = []
    groups = config.placement_groups()
    for index, bundles in enumerate(groups):
        lines.append(f"placement_group {index}: strategy={config.placement_strategy} bundles={bundles}")
    if config.rollout_gpus:
        lines.append(f"placement_group 0: the last {config.rollout_gpus} bundles hold the rollout servers' GPUs, "
                     f"listed after the trainer's in that node's CUDA_VISIBLE_DEVICES")
    for index in range(config.rollout_nodes):
        node = len(groups) + index
        lines.append(f"placement_group {node}: strategy=STRICT_PACK bundles={[config.rollout_node_bundle()]}")
        lines.append(f"rollout node {index} on <node of group {node}>: {API_KEY_ENV}=<generated for this job> "
                     + shlex.join(config.rollout_servers_command("<node-local addresses file>", "<node-local logs>", python)))
    rank = 0
    for group_index, bundles in enumerate(groups):
        ranks_here = len(bundles) - (config.rollout_gpus if group_index == 0 else 0)
        for bundle_index in range(ranks_here):
            if config.placement_strategy == "STRICT_PACK":
                node, local_rank, local_world = f"<node of group {group_index}>", bundle_index, ranks_here
                node_rank = group_index
                master = "<node of group 0>"
            else:
                node, local_rank, local_world, node_rank = f"<node of bundle {bundle_index}>", "<by node>", "<by node>", "<by node>"
                master = "<node of bundle 0>"
            env = {
                "RANK": rank, "WORLD_SIZE": config.num_workers, "LOCAL_RANK": local_rank,
                "LOCAL_WORLD_SIZE": local_world, "NODE_RANK": node_rank, "MASTER_ADDR": master,
                "MASTER_PORT": "<free port on rank 0's node>",
            }
            if config.device == "gpu":
                env["CUDA_VISIBLE_DEVICES"] = "<this job's GPUs on the node>"
            assignments = " ".join(f"{key}={shlex.quote(str(value))}" for key, value in env.items())
            addresses = ["<the rollout nodes' servers>"] if config.rollout_nodes else []
            secret = f" {API_KEY_ENV}=<generated for this job>" if config.rollout_nodes else ""
            lines.append(f"rank {rank} on {node}: {assignments}{secret} {shlex.join(config.command(python, addresses))}")
            rank += 1
    return lines


def launch(config: RayLaunchConfig) -> int:
    """Place the workers, run the program on every rank, return the job's exit status."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from engine.rewards.ray_pool import ensure_ray_initialized

    config.validate()
    cpus = (config.num_workers + config.rollout_nodes) * config.cpus_per_worker
    ensure_ray_initialized(num_cpus=max(1, int(cpus + 0.999)))
    groups = [placement_group(bundles, strategy=config.placement_strategy) for bundles in config.placement_groups()]
    # One group per rollout node, after the trainers' (STRICT_PACK keeps each on one node).
    rollout_groups = [placement_group([config.rollout_node_bundle()], strategy="STRICT_PACK")
                      for _ in range(config.rollout_nodes)]
    workers: list = []
    holders: list = []  # idle actors holding the rollout servers' GPUs: the last bundles of group 0
    rollout_nodes: list = []  # one actor per rollout node, running launch.rollout_servers
    try:
        every_group = groups + rollout_groups
        ready, _ = ray.wait([group.ready() for group in every_group], num_returns=len(every_group),
                            timeout=PLACEMENT_TIMEOUT_S)
        if len(ready) < len(every_group):
            raise RayLaunchError(
                f"the Ray cluster could not place {config.num_workers} workers x {config.bundle()} "
                f"({config.placement_strategy}, {config.workers_per_node} per node) and {config.rollout_nodes} "
                f"rollout node(s) x {config.rollout_node_bundle()} within {PLACEMENT_TIMEOUT_S} s; "
                f"available: {ray.available_resources()} (see `ray status`)"
            )
        actor_class = ray.remote(SpmdWorker)
        pythonpath = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
        secret_env = {}
        server_addresses: list[str] = []
        if rollout_groups:
            secret_env = {API_KEY_ENV: secrets.token_hex(32)}  # this job's; in environments only
            rollout_nodes = [actor_class.options(
                num_cpus=config.cpus_per_worker, num_gpus=config.rollout_node_bundle().get("GPU", 0), max_concurrency=2,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)).remote()
                for group in rollout_groups]
            server_addresses = _start_rollout_nodes(config, rollout_nodes, {**config.extra_env, **secret_env,
                                                                            "PYTHONPATH": pythonpath})
        for group_index, group in enumerate(groups):
            for bundle_index in range(group.bundle_count):
                held = group_index == 0 and bundle_index >= group.bundle_count - config.rollout_gpus
                (holders if held else workers).append(
                    actor_class.options(
                        num_cpus=config.cpus_per_worker,
                        num_gpus=1 if config.device == "gpu" else 0,
                        max_concurrency=2,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle_index),
                    ).remote()
                )
        placements = ray.get([worker.placement.remote() for worker in workers])
        rollout = None
        if holders:
            held = ray.get([holder.placement.remote() for holder in holders])
            rollout = WorkerPlacement(held[0].node_ip, tuple(gpu for h in held for gpu in h.gpu_ids))
        provisional = rank_environments(placements, master_port=0)
        rank0 = next(index for index, env in enumerate(provisional) if env["RANK"] == "0")
        if config.log_dir:
            Path(config.log_dir).mkdir(parents=True, exist_ok=True)
        deadline = None if config.timeout_s is None else time.monotonic() + config.timeout_s
        attempt = 0
        while True:
            # The rendezvous port must be free on rank 0's node, so ask the worker that gets rank 0.
            port = ray.get(workers[rank0].free_port.remote())
            restart_env = {"TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(config.max_restarts)}
            runs = {}
            for worker, env in zip(workers, rank_environments(placements, port, rollout)):
                log_path = str(Path(config.log_dir) / f"rank-{env['RANK']}.log") if config.log_dir else None
                env = {**config.extra_env, **env, **secret_env, **restart_env, "PYTHONPATH": pythonpath}
                runs[worker.run.remote(config.command(server_addresses=server_addresses), env, os.getcwd(), log_path)] = env["RANK"]
            status = _wait_for_ranks(runs, workers, None if deadline is None else deadline - time.monotonic())
            if status in (0, TIMEOUT_STATUS) or attempt == config.max_restarts:
                return status
            print(f"[ray_launcher] restarting every rank (restart {attempt + 1} of {config.max_restarts}); the job "
                  "resumes from its newest complete checkpoint", file=sys.stderr, flush=True)
            ray.get([worker.rearm.remote() for worker in workers])
            attempt += 1
    finally:
        if rollout_nodes:  # stop the servers gracefully (a lost node's actor just fails to answer)
            ray.wait([node.terminate.remote() for node in rollout_nodes], num_returns=len(rollout_nodes),
                     timeout=TERMINATE_GRACE_S + 5)
        for worker in workers + holders + rollout_nodes:
            ray.kill(worker)
        for group in groups + rollout_groups:
            remove_placement_group(group)


def _start_rollout_nodes(config: RayLaunchConfig, nodes: list, env: dict[str, str]) -> list[str]:
    """Start launch.rollout_servers on every rollout node; their servers' addresses, in node order."""
    import ray

    job = uuid.uuid4().hex[:8]
    log_dir = Path(config.log_dir) if config.log_dir else Path(tempfile.gettempdir()) / f"trident-rollout-{job}"
    log_dir.mkdir(parents=True, exist_ok=True)
    calls = []
    for index, node in enumerate(nodes):
        # The address file is on the rollout node's own disk; the actor reads it there.
        local = f"{tempfile.gettempdir()}/trident-rollout-{job}/node{index}"
        server_logs = str(log_dir / f"rollout-node-{index}") if config.log_dir else f"{local}/logs"
        command = config.rollout_servers_command(f"{local}/addresses", server_logs)
        calls.append(node.start_rollout_servers.remote(command, env, os.getcwd(), f"{local}/addresses",
                                                       str(log_dir / f"rollout-node-{index}.log"), ROLLOUT_START_TIMEOUT_S))
    try:
        addresses = [address for found in ray.get(calls) for address in found]
    except ray.exceptions.RayTaskError as error:
        raise RayLaunchError(f"the rollout servers did not start: {error.cause}") from None
    print(f"[ray_launcher] {len(addresses)} rollout server(s) on {len(nodes)} node(s) of their own: {', '.join(addresses)}",
          flush=True)
    return addresses


def _wait_for_ranks(runs: dict, workers: list, timeout_s: float | None) -> int:
    """Wait for every rank; on the first failure (or the timeout) stop the rest."""
    import ray

    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(runs)
    status = 0
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not done:
            print(f"[ray_launcher] timed out after {timeout_s} s; stopping all ranks", file=sys.stderr)
            status = TIMEOUT_STATUS
            break
        returncode, tail = ray.get(done[0])
        if returncode != 0:
            print(f"[ray_launcher] rank {runs[done[0]]} exited with {returncode}; stopping the other ranks\n"
                  f"--- rank {runs[done[0]]} output (tail) ---\n{tail}", file=sys.stderr)
            status = returncode if returncode > 0 else 128 - returncode
            break
    if pending:
        ray.get([worker.terminate.remote() for worker in workers])
        ray.wait(pending, num_returns=len(pending), timeout=TERMINATE_GRACE_S + 5)
    return status


def parse_args(argv: list[str] | None = None) -> tuple[RayLaunchConfig, bool]:
    parser = argparse.ArgumentParser(
        prog="python -m launch.ray_launcher",
        description="Run the SPMD program on a Ray cluster, one worker per GPU (torchrun's environment).",
    )
    parser.add_argument("experiment", help="the experiment yaml, passed to the program")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, passed to the program")
    parser.add_argument("--num-gpus", type=int, required=True, help="ranks to start (one GPU each; CPU bundles with --device cpu)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (STRICT_PACK group size)")
    parser.add_argument("--placement-strategy", default="STRICT_PACK", choices=PLACEMENT_STRATEGIES)
    parser.add_argument("--device", default="gpu", choices=DEVICES, help="cpu: CPU-only workers (tests, CPU clusters)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--module", default="launch.main", help="the SPMD entry module")
    parser.add_argument("--log-dir", default=None, help="write each rank's output to LOG_DIR/rank-R.log")
    parser.add_argument("--timeout-s", type=float, default=None, help="stop all ranks after this long (exit 124)")
    parser.add_argument("--rollout-gpus", type=int, default=0,
                        help="disaggregated rollout: GPUs of the trainer's node reserved for the SGLang servers")
    parser.add_argument("--rollout-nodes", type=int, default=0,
                        help="disaggregated rollout: nodes of their own (--gpus-per-node GPUs each) for the SGLang servers")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="when a rank fails, start every rank again (resuming from the newest checkpoint) up to N times")
    parser.add_argument("--dry-run", action="store_true", help="print the placement and the per-rank commands, run nothing")
    args = parser.parse_intermixed_args(argv)
    config = RayLaunchConfig(
        program_args=(args.experiment, *args.overrides),
        num_workers=args.num_gpus,
        workers_per_node=args.gpus_per_node,
        placement_strategy=args.placement_strategy,
        device=args.device,
        cpus_per_worker=args.cpus_per_worker,
        entry_module=args.module,
        log_dir=args.log_dir,
        timeout_s=args.timeout_s,
        extra_env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        rollout_gpus=args.rollout_gpus,
        rollout_nodes=args.rollout_nodes,
        max_restarts=args.max_restarts,
    )
    return config, args.dry_run


def main(argv: list[str] | None = None) -> int:
    config, dry_run = parse_args(argv)
    try:
        config.validate()
        if dry_run:
            print("\n".join(dry_run_lines(config)))
            return 0
        return launch(config)
    except RayLaunchError as err:
        print(f"launch.ray_launcher: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
