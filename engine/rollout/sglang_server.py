"""Start, watch and stop one SGLang server process (one generation replica): ``sglang.launch_server``
through ``engine.rollout.sglang_launch`` (the API key from the environment, forked children on CPU).

The server runs in its own process group (its scheduler and detokenizer are children), logs to a
file in the run directory, and the whole group is killed on ``stop()`` and at interpreter exit.
Any request that fails because the process died raises ``SGLangServerCrashed`` naming the log.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import psutil
import requests

from engine.config.actor_rollout_ref import RolloutConfig
from engine.lifecycle import forget_process_group, watch_process_group
from engine.preload import NVML_CHECK
from engine.rollout.base import RolloutError
from engine.rollout.sglang_cpu import adapt_server_for_cpu, needs_cpu_adaptation
from engine.rollout.sglang_forkserver import SERVER_MODULE, prepare_own_forkserver, start_server_process
from engine.rollout.sglang_presharded import LOADER as PRESHARDED_LOADER
from engine.rollout.sglang_launch import API_KEY_ENV
from parallel.state import find_free_port

LOG_TAIL_LINES = 30
# Starts on a fresh port after the chosen one was taken before the server bound it (see wait_until_ready).
PORT_ATTEMPTS = 3
# What uvicorn logs, and then hangs, when the HTTP port is not free.
PORT_TAKEN = "address already in use"
# An external server's address that refuses connections this long has no server behind it: the job
# stops naming it instead of waiting out the start-up timeout (such servers are started ready).
REFUSED_LIMIT_S = 60.0
# Polls while a server starts: a forked server answers ~4 s after its request, so a 1 s poll kept a
# started server idle for half a second on average.
READY_POLL_S = 0.25
# Ready means it generates: one token of a request of its own, once the server is up (503 before;
# a busy server counts its running requests instead). It stands in for SGLang's warm-up, which our
# servers skip (``command``).
READY_PATH = "/health_generate"
# How long a server we start keeps an idle HTTP connection open: longer than any gap between one
# thread's requests (a step, a checkpoint, a validation), so no request meets a closing connection.
KEEP_ALIVE_S = 24 * 3600
# A wait on servers says on rank 0's terminal what it waits for once it has lasted this long, again
# at each later mark, then every (last mark) seconds: 10 s, 30 s, 60 s, 120 s, 180 s ...
WAIT_REPORT_MARKS_S = (10.0, 30.0, 60.0)
# The setting that bounds each request, named when it times out (control and weight requests use
# the weight-update timeout).
TIMEOUT_SETTINGS = {"/generate": "actor_rollout_ref.rollout.request_timeout_s"}


class SGLangServerCrashed(RolloutError):
    """The server process exited; the message names its log file and quotes its last lines."""


@dataclasses.dataclass
class SGLangServerConfig:
    """How to launch one SGLang server (the user's settings are ``rollout``)."""

    model_path: str
    log_path: Path
    # actor_rollout_ref.rollout: --tp-size, --dtype, --mem-fraction-static, the memory saver
    # (colocated mode) and the start-up timeout.
    rollout: RolloutConfig
    host: str = "127.0.0.1"
    # None: a free port is chosen.
    port: int | None = None
    # Node-local GPU indices (the launching process's CUDA numbering) of the server's TP ranks, in
    # TP order; empty = SGLang's default (GPUs 0..tp-1). The server sees only these GPUs.
    gpu_ids: tuple[int, ...] = ()
    context_length: int | None = None
    max_total_tokens: int | None = None
    random_seed: int | None = None
    trust_remote_code: bool = False
    # The trainer's rollout servers take and return token ids; a judge serves chat text.
    skip_tokenizer_init: bool = True
    extra_args: tuple[str, ...] = ()
    # Servers that other nodes reach require this key on every request (SGLang's --api-key, passed
    # to the process in its environment, see engine.rollout.sglang_launch); None on loopback.
    api_key: str | None = dataclasses.field(default=None, repr=False)
    python_executable: str = sys.executable


def feature_args(rollout: RolloutConfig, return_routed_experts: bool, lora=None) -> tuple[str, ...]:
    """The server flags Trident's features need, wherever the server is started from.

    - ``return_routed_experts`` (``actor.megatron.moe_router_replay``): the server records the
      experts each token was routed to and returns them on request (R3).
    - ``rollout.partial_rollout``: no prefix cache. SGLang flushes it after a push only when idle,
      which servers whose generations go on across pushes never are, so a new request could start
      from a prefix computed by weights older than ``trainer.max_staleness``.
    - ``lora`` (a ``LoRASettings``, with ``rollout.lora_sync=adapters``): LoRA enabled for adapters
      of that rank on those modules, one adapter per batch (the actor's), and the base weights
      backed up in host memory when released (``--enable-weights-cpu-backup``), since no sync
      brings them back.
    """
    adapters = ("--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules",
                *lora.peft_target_modules(), "--max-loras-per-batch", "1", "--enable-weights-cpu-backup") if lora else ()
    return (("--enable-return-routed-experts",) if return_routed_experts else ()) + (
        ("--disable-radix-cache",) if rollout.partial_rollout else ()) + adapters


def live_processes_in_group(process_group: int) -> list[int]:
    """Pids of running (not zombie) processes in a process group, read from /proc (Linux)."""
    pids = []
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid pgrp ...": comm may contain spaces, so split after the ')'.
            state, _ppid, pgrp = stat_file.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == process_group and state != "Z":
            pids.append(int(stat_file.parent.name))
    return pids


def visible_devices(gpu_ids: Sequence[int], parent_visible: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that must see the parent's GPUs ``gpu_ids`` (in order).

    The parent's own ``CUDA_VISIBLE_DEVICES`` (a Slurm or container binding) renumbers its GPUs, so
    the ids are mapped through it; ids, UUIDs and MIG names all pass through unchanged.
    """
    if not parent_visible:
        return ",".join(str(gpu) for gpu in gpu_ids)
    parent = [entry.strip() for entry in parent_visible.split(",") if entry.strip()]
    missing = [gpu for gpu in gpu_ids if not 0 <= gpu < len(parent)]
    if missing:
        raise RolloutError(f"GPUs {missing} are not among this process's CUDA_VISIBLE_DEVICES={parent_visible!r}")
    return ",".join(parent[gpu] for gpu in gpu_ids)


class WaitReport:
    """Says (rank 0's terminal, every rank's log) what a wait on servers is for and how long it has
    lasted, at the ``WAIT_REPORT_MARKS_S``; call ``tick`` while waiting."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock, self._start, self._reported = clock, clock(), 0

    def _mark(self, index: int) -> float:
        last = len(WAIT_REPORT_MARKS_S) - 1
        return WAIT_REPORT_MARKS_S[index] if index <= last else WAIT_REPORT_MARKS_S[last] * (index - last + 1)

    def tick(self, what: Callable[[], str]) -> None:
        elapsed = self._clock() - self._start
        if elapsed >= self._mark(self._reported):
            from engine.trainer.console import say

            say(f"[trident] waiting {elapsed:.0f} s for {what()}")
            while elapsed >= self._mark(self._reported):
                self._reported += 1


def wait_reporting(futures: Collection[concurrent.futures.Future], what: Callable[[int], str]) -> None:
    """Until every future is done; ``what(number done)`` says what is awaited (``WaitReport``)."""
    report, pending = WaitReport(), set(futures)
    while pending:
        _, pending = concurrent.futures.wait(pending, timeout=1.0)
        if pending:
            report.tick(lambda: what(len(futures) - len(pending)))


_LIVE_SERVERS: "weakref.WeakSet[SGLangServer]" = weakref.WeakSet()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.stop()


class SGLangServer:
    """One supervised SGLang server process."""

    def __init__(self, config: SGLangServerConfig):
        self.config = config
        self.port = config.port or find_free_port(config.host)
        self.log_path = Path(config.log_path)
        self.process: subprocess.Popen | None = None
        self._env: dict[str, str] = {}  # the environment of its last start
        self._log_offset = 0  # where this start's part of the (appended) log begins
        self._nccl_port: int | None = None  # drawn afresh by each ``command``
        # A server another process started and supervises (``attach``): only HTTP requests from here.
        self.attached = False
        self.refused_limit_s: float | None = None  # see REFUSED_LIMIT_S
        self._local = threading.local()
        # Tokens of the KV pool its first start sized (SGLang's max_total_num_tokens): what a restart
        # asks for (``restart``).
        self.first_pool_tokens: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @classmethod
    def attach(cls, config: SGLangServerConfig, external: bool = False) -> "SGLangServer":
        """A handle on a running server (``config.host``, ``config.port``) started by another process;
        ``start``/``stop`` do nothing and a dead server shows as a failed request. ``external``: a
        server of ``rollout.server_addresses``, up before the job starts, so an address that refuses
        connections for ``REFUSED_LIMIT_S`` stops the wait (a colocated peer's may still be loading)."""
        if config.port is None:
            raise ValueError("SGLangServer.attach needs the server's port")
        server = cls(config)
        server.attached = True
        server.refused_limit_s = REFUSED_LIMIT_S if external else None
        return server

    def command(self) -> tuple[list[str], dict[str, str]]:
        """The server command line and environment (plain SGLang on GPU, CPU additions otherwise), with
        a freshly drawn NCCL port."""
        cfg = self.config
        self._nccl_port = find_free_port(cfg.host)
        args = [
            cfg.python_executable, "-m", SERVER_MODULE,
            "--model-path", str(cfg.model_path),
            "--host", cfg.host,
            "--port", str(self.port),
            "--nccl-port", str(self._nccl_port),
            "--tp-size", str(cfg.rollout.tensor_model_parallel_size),
            "--mem-fraction-static", str(cfg.rollout.gpu_memory_utilization),
            "--dtype", cfg.rollout.dtype,
            # An idle scheduler otherwise spins a CPU core per server for the whole training phase
            # (measured: 94-100% of a core on CPU), taking it from the trainer's own processes.
            "--sleep-on-idle",
            # The sharded weight push: each TP worker copies its own shards into place.
            "--custom-weight-loader", PRESHARDED_LOADER,
            # SGLang's warm-up sleeps a second before its first look at the server and then generates
            # 8 tokens (sglang/srt/entrypoints/http_server.py, _execute_server_warmup); the readiness
            # check below generates one token instead (READY_PATH), with no sleep: every start and
            # every restart of a crashed server is ready sooner.
            "--skip-server-warmup",
        ]
        if cfg.skip_tokenizer_init:
            args.append("--skip-tokenizer-init")
        if cfg.context_length is not None:
            args += ["--context-length", str(cfg.context_length)]
        if cfg.max_total_tokens is not None:
            args += ["--max-total-tokens", str(cfg.max_total_tokens)]
        if cfg.random_seed is not None:
            args += ["--random-seed", str(cfg.random_seed)]
        if cfg.trust_remote_code:
            args.append("--trust-remote-code")
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        # Whoever set it (engine.preload sets it only for the length of an import), the server's
        # CUDA must be found by the CUDA runtime: NVML can see GPUs that CUDA cannot use.
        env.pop(NVML_CHECK, None)
        env.setdefault("SGLANG_EXTERNAL_MODEL_PACKAGE", "engine.rollout.sglang_models")  # see that package
        # SGLang's uvicorn closes a connection idle for 5 s (sglang/srt/environ.py); each calling
        # thread keeps its connection between steps, and a request sent as uvicorn closes it fails
        # with RemoteDisconnected or a reset (seen under load when a step outlasted 5 s).
        env.setdefault("SGLANG_TIMEOUT_KEEP_ALIVE", str(KEEP_ALIVE_S))
        if cfg.api_key:
            env[API_KEY_ENV] = cfg.api_key
        if needs_cpu_adaptation():
            args, env = adapt_server_for_cpu(args, env, cfg.rollout.tensor_model_parallel_size)
        else:
            # SGLang's memory saver refuses expandable segments, and a trainer's allocator settings
            # are no business of the server's (slime drops both variables the same way).
            # CUDA_DEVICE_MAX_CONNECTIONS is the trainer's (1, for megatron); SGLang sets its own.
            for variable in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS"):
                env.pop(variable, None)
            if cfg.rollout.mode == "colocated":  # release/resume memory occupation between phases
                args.append("--enable-memory-saver")
                # CUDA graphs are captured into the saver's "cuda_graph" region, and so released
                # with the weights and KV cache, only with this (sglang/srt/environ.py; off by default).
                env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "true"
            if cfg.gpu_ids:
                env["CUDA_VISIBLE_DEVICES"] = visible_devices(cfg.gpu_ids, env.get("CUDA_VISIBLE_DEVICES"))
        args += list(cfg.extra_args)
        return args, env

    def start(self) -> None:
        """Launch the process (returns at once; see ``wait_until_ready``)."""
        if self.attached:
            return
        if not Path(self.config.model_path, "config.json").is_file():
            raise FileNotFoundError(f"SGLang model_path {self.config.model_path} has no config.json")
        args, env = self.command()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._log_offset = log.tell()
            log.write(f"[trident] {' '.join(args)}\n".encode())
            log.flush()
            # Forked from a forkserver that has imported SGLang where one serves, else a process of
            # its own; either way in a session of its own.
            self.process = start_server_process(args, env, log)
            self._env = env
        # Its own session (a job signal does not reach it half-way), so this rank's reaper must know it.
        watch_process_group(self.process.pid)
        _LIVE_SERVERS.add(self)

    def restart(self) -> None:
        """Start a server that died again, on the same GPUs and (while it is free) the same port, so
        that engines attached to it by address find it there, with the KV pool its first start had
        (SGLang sizes the pool from the memory free when it starts, ``kv_cache_configurator``; a
        restart must not size it again, and the caller frees what the first start found free:
        ``engine.trainer.rollout``); returns once it answers."""
        if self.first_pool_tokens is not None:
            self.config = dataclasses.replace(self.config, max_total_tokens=self.first_pool_tokens)
        self.stop()
        self.start()
        self.wait_until_ready()

    def pool_tokens(self) -> int:
        """Tokens the server's KV pool holds (``max_total_num_tokens`` of SGLang's ``/server_info``)."""
        response = self._session().get(self.url + "/server_info", timeout=30)
        response.raise_for_status()
        return int(response.json()["max_total_num_tokens"])

    def wait_until_ready(self) -> None:
        """Poll ``READY_PATH`` until this server's own process answers 200; raise if the process dies or
        time runs out.

        A chosen port can be taken by another process before the server binds it (a rank's ports are
        drawn while other ranks and other jobs start their own servers). A lost ``--nccl-port`` makes
        the server exit; a lost HTTP port makes uvicorn log the bind error and the launcher hang, while
        another server on that port may answer for it. So the answer counts only from a
        port this server's process group listens on, and a server that lost a port starts again on
        fresh ones (``PORT_ATTEMPTS`` in all; a fixed ``port`` that is taken is an error at once)."""
        deadline = time.monotonic() + self.config.rollout.startup_timeout_s
        attempts, refused_since = 1, None
        report = WaitReport()
        while time.monotonic() < deadline:
            report.tick(lambda: f"SGLang server {self.url} to start (at most actor_rollout_ref.rollout.startup_timeout_s="
                                f"{self.config.rollout.startup_timeout_s:.0f}; log {self.log_path})")
            # Polled before the log is read, so that an exit's last lines are in what is read.
            exited = self.process is not None and not self.attached and self.process.poll() is not None
            lost = self._lost_port()
            if lost is not None:
                fixed = lost == self.port and self.config.port is not None
                if fixed or attempts == PORT_ATTEMPTS:
                    self.stop()
                    raise RolloutError(f"SGLang server port {lost} on {self.config.host} is taken by another "
                                       f"process ({attempts} start(s) tried); log {self.log_path}")
                attempts += 1
                self.stop()
                if lost == self.port:
                    self.port = find_free_port(self.config.host)
                self.start()
                continue
            if exited or self.process is None:
                self.raise_if_crashed(grace_s=0.0)
            try:
                if self._session().get(self.url + READY_PATH, timeout=5).status_code == 200 and self._owns_port():
                    self._check_api_key()
                    if not self.attached:
                        prepare_own_forkserver(self._env)  # for restarts, once this one is up
                        if self.first_pool_tokens is None:
                            self.first_pool_tokens = self.pool_tokens()
                    return
                refused_since = None
            except requests.ConnectionError as error:
                refused_since = refused_since or time.monotonic()
                if self.refused_limit_s is not None and time.monotonic() - refused_since > self.refused_limit_s:
                    raise RolloutError(f"nothing answers at SGLang server {self.url} (actor_rollout_ref.rollout."
                                       f"server_addresses): connections failed for {self.refused_limit_s:.0f}s "
                                       f"({type(error).__name__}); is a server running there?") from None
            except requests.RequestException:
                pass
            time.sleep(READY_POLL_S)
        self.stop()
        raise RolloutError(
            f"SGLang server at {self.url} was not ready after {self.config.rollout.startup_timeout_s:.0f}s "
            f"(actor_rollout_ref.rollout.startup_timeout_s); "
            f"log {self.log_path}, last lines:\n{self.log_tail()}"
        )

    def _lost_port(self) -> int | None:
        """The port (HTTP or NCCL) that this start's log says was not free, if any."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                lines = log.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        for line in lines:
            if PORT_TAKEN in line:
                for port in (self.port, self._nccl_port):
                    if re.search(rf"\b{port}\b", line):
                        return port
        return None

    def _owns_port(self) -> bool:
        """Whether the process listening on this server's port is one of its own group."""
        if self.attached:
            return True
        for connection in psutil.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr and connection.laddr.port == self.port:
                try:
                    return connection.pid is not None and os.getpgid(connection.pid) == self.process.pid
                except ProcessLookupError:
                    return False
        return False

    def _check_api_key(self) -> None:
        """Fail at once on a key the server refuses (its /health answers without one)."""
        if not self.config.api_key:
            return
        status = self._session().get(self.url + "/model_info", timeout=30).status_code
        if status in (401, 403):
            raise RolloutError(f"SGLang server {self.url} refuses this job's API key (HTTP {status}): "
                               f"{API_KEY_ENV} must be the key the server was started with")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                return "".join(deque(log, maxlen=lines))
        except OSError as error:
            return f"(log unreadable: {error})"

    def raise_if_crashed(self, grace_s: float = 5.0) -> None:
        """Raise ``SGLangServerCrashed`` if the process has exited (waiting up to ``grace_s`` for it)."""
        if self.attached:
            return  # its owner watches the process
        if self.process is None:
            raise RolloutError(f"SGLang server {self.url} was never started")
        try:
            code = self.process.wait(timeout=grace_s) if grace_s > 0 else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            self._kill_group()
            raise SGLangServerCrashed(
                f"SGLang server {self.url} exited with code {code}; log {self.log_path}, last lines:\n{self.log_tail()}"
            )

    def _session(self) -> requests.Session:
        # One HTTP session (connection pool) per calling thread.
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            if self.config.api_key:
                session.headers["Authorization"] = f"Bearer {self.config.api_key}"
        return session

    def post(self, path: str, payload: dict[str, Any] | None = None, timeout: float | None = None) -> Any:
        """POST JSON and return the decoded body; crashes and HTTP errors raise with context."""
        try:
            response = self._session().post(self.url + path, json=payload or {}, timeout=timeout)
        except requests.Timeout as error:
            self.raise_if_crashed(grace_s=0.0)
            setting = TIMEOUT_SETTINGS.get(path, "actor_rollout_ref.rollout.weight_update_timeout_s")
            raise RolloutError(f"request {path} to SGLang server {self.url} got no answer within {timeout}s "
                               f"({setting}); log {self.log_path}") from error
        except requests.RequestException as error:
            self.raise_if_crashed()
            raise RolloutError(f"request {path} to SGLang server {self.url} failed: {error}; log {self.log_path}") from error
        if response.status_code != 200:
            raise RolloutError(
                f"SGLang server {self.url} answered {path} with HTTP {response.status_code}: {response.text[:2000]}"
            )
        try:
            return response.json()
        except ValueError:
            return response.text

    def is_healthy(self) -> bool:
        self.raise_if_crashed(grace_s=0.0)
        try:
            return self._session().get(self.url + "/health", timeout=30).status_code == 200
        except requests.RequestException:
            return False

    def _group_is_ours(self) -> bool:
        """Whether the server's process group id still names its group. Once the launcher is reaped
        its id is free: with pid_max at 32768 a busy machine hands it to another process within
        minutes, and a session leader (another job's SGLang server) makes it that process's group.
        While any process of ours holds the group id, the kernel gives it to no new process, so a
        live process with that pid, our launcher being reaped, is someone else's."""
        return self.process.poll() is None or not Path(f"/proc/{self.process.pid}").exists()

    def _signal_group(self, signum: int) -> None:
        if self.process is None or not self._group_is_ours():
            return
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_group(self) -> None:
        self._signal_group(signal.SIGKILL)

    def stop(self, grace_s: float = 0.2, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace_s``; returns once nothing of
        it runs (at most ``timeout_s`` more). SGLang's own SIGTERM path never takes less than ~4 s
        (its exit watchdog polls every 5 s; a scheduler that ends first makes the launcher sleep 5 s
        before crash diagnostics: measured 5.2-5.8 s on an idle server), time in which a stopped
        server serves nothing; the process group and its memory go either way. So the grace only
        lets the launcher see the SIGTERM first; a longer one (1 s until 2026-12-07) was a second of
        every job's end and every restart spent waiting."""
        if self.process is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        # Children (scheduler, detokenizer) may outlive the launcher: kill the group regardless,
        # and return only once none of its processes runs any more.
        self._kill_group()
        deadline = time.monotonic() + timeout_s
        while self._group_is_ours() and live_processes_in_group(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if not self._group_is_ours() or not live_processes_in_group(self.process.pid):
            forget_process_group(self.process.pid)
        _LIVE_SERVERS.discard(self)
