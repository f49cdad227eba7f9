"""torchrun whose ranks are forked from one process that has already imported what every rank imports.

    python -m launch.torchrun [torchrun's options] -m launch.main yaml/X.yaml [key=value ...]

Takes torchrun's own arguments (``torch.distributed.run``'s parser and config) and runs its
elastic agent unchanged: rendezvous, ``--max-restarts``, monitoring, the per-rank environment,
failures reported as ``ChildFailedError``. What differs is how a rank starts. torchrun starts
``python -u -m launch.main ...`` per rank, and each fresh interpreter imports torch, transformers
(with torchvision and torch._dynamo behind it) and megatron-core again: ~4.5 s of CPU per rank here,
most of a small job's start and ~30% of a CPU rehearsal's CPU. Here the agent starts its ranks with
multiprocessing's ``forkserver``: one server process imports ``launch.rank_imports`` once, and each
rank is forked from it and runs the same module or script, with the same arguments, as ``-m``
would.

A forked rank is made to look and behave like torchrun's:
- it leads a session of its own (torchrun's ``Popen(start_new_session=True)``), so its reaper can
  kill its process group (``engine.lifecycle``);
- its title in ``ps``/``top`` is ``rank R/W: <the command torchrun would have run>`` (its
  ``/proc/<pid>/environ`` stays as it was);
- its ``atexit`` hooks run when it ends (a multiprocessing child would skip them: they stop the
  SGLang servers a rank started), and its exit status is the program's own;
- its environment is the agent's with torch's per-rank variables, and its output goes where the
  agent's goes (unless torch redirects it: ``--log-dir``/``--tee``), whichever process started the
  forkserver; ``/proc/<pid>/environ`` shows that environment (``engine.process_view``).

Every agent on a node may share one forkserver (``start_shared_rank_forkserver``; a test session
starts one per pytest worker): ``TRIDENT_RANK_FORKSERVER`` names it, and an agent whose environment
differs from the forkserver's in a variable the import read starts its own, saying why.

The forkserver must not initialise CUDA, or no rank forked from it could use the GPU:
``launch.rank_imports`` says what it imports and why that is safe, and checks it when done.
"""
from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import runpy
import shlex
import sys
import time
from collections.abc import Sequence
from multiprocessing import forkserver, reduction, resource_tracker

from engine.preload import describe_difference, environment_difference
from engine.process_view import ROOM_BYTES, ROOM_ENV, set_title, show_environment

PRELOAD_MODULE = "launch.rank_imports"
# {"address": the forkserver's socket, "record": the file its import record is written to}
SHARED_FORKSERVER_ENV = "TRIDENT_RANK_FORKSERVER"
RECORD_WAIT_S = 300.0  # a shared forkserver still importing is waited for, not imported beside


class AgentSide:
    """The agent's environment, standard output and error, taken when a rank is started (pickled
    into the forkserver's request) and given to the rank (``take_the_agents_side``)."""

    def __init__(self, environment: dict[str, str] | None = None, stdout=None, stderr=None) -> None:
        self.environment, self.stdout, self.stderr = environment, stdout, stderr

    def __reduce__(self):
        # Pickled while multiprocessing starts the rank: DupFd sends the descriptors with the request.
        return (_agent_side_in_rank, (dict(os.environ), reduction.DupFd(1), reduction.DupFd(2)))


def _agent_side_in_rank(environment: dict[str, str], stdout, stderr) -> AgentSide:
    return AgentSide(environment, stdout.detach(), stderr.detach())


def take_the_agents_side(agent: AgentSide) -> None:
    """In a forked rank: the environment torch's ``_wrap`` set on top of the forkserver's becomes
    that on top of the agent's (and what the import set where the agent has nothing), and the
    output the agent's, where torch did not redirect it."""
    from launch import rank_imports

    rank_variables = {name: value for name, value in os.environ.items()
                      if rank_imports.environment_after_import.get(name) != value}
    os.environ.clear()
    os.environ.update({**rank_imports.record.set_by_import, **agent.environment, **rank_variables})
    for fd, inherited in ((1, agent.stdout), (2, agent.stderr)):
        if rank_imports.stdio_identity[fd] == (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
            (sys.stdout if fd == 1 else sys.stderr).flush()
            os.dup2(inherited, fd)
        os.close(inherited)
    show_environment(os.environ)


def run_rank(agent: AgentSide, *command: str) -> None:
    """One rank, in a process forked from the preloaded server: ``python -u [-m] target args``'s work.

    ``command`` is torchrun's interpreter arguments (``-u``, ``-m module`` or a script path, the
    program's arguments); torch's ``_wrap`` has set this rank's variables already."""
    os.setsid()
    take_the_agents_side(agent)
    set_title(f"rank {os.environ.get('RANK', '?')}/{os.environ.get('WORLD_SIZE', '?')}: "
               f"{shlex.join([sys.executable, *command])}")
    arguments = list(command)
    if arguments and arguments[0] == "-u":  # unbuffered, as torchrun asks of the interpreter
        arguments.pop(0)
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    try:
        if arguments[0] == "-m":
            # multiprocessing has imported the agent's main module here (the trident command's imports
            # launch.main): the program runs as a fresh __main__, as under ``python -m``.
            sys.modules.pop(arguments[1], None)
            sys.argv = [arguments[1], *arguments[2:]]  # run_module puts the module's file first
            runpy.run_module(arguments[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(arguments[0])
            sys.argv = [script, *arguments[1:]]
            sys.path.insert(0, os.path.dirname(script))  # what ``python script.py`` puts first
            runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        if end.code not in (0, None):
            raise  # the exit status torchrun's agent reports; the hooks run below either way
    finally:
        atexit._run_exitfuncs()


def run(argv: Sequence[str]) -> None:
    """torchrun with ``argv`` (its own options, then ``-m module`` or a script, then the program's
    arguments); raises torch's ``ChildFailedError`` when a rank fails, as torchrun does."""
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

    args = get_args_parser().parse_args(list(argv))
    if args.no_python or args.run_path:
        raise ValueError("launch.torchrun starts Python ranks: --no-python and --run-path are not supported")
    # torch.distributed.run.run's own defaults for a single node.
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", os.urandom(16).hex()
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", os.urandom(16).hex()
    if args.master_port is None:
        args.master_port = 29500
    # A restarted job (--max-restarts) must not meet the last attempt's keys: with the c10d
    # rendezvous the agent otherwise shares one TCPStore server across rounds, and torch 2.14 no
    # longer puts each attempt under a prefix of its own (torch/distributed/rendezvous.py,
    # _create_c10d_store), so a restarted rank 0 read its peer's gloo address from the failed
    # attempt and was refused. Off, every round's rank 0 hosts a fresh store on a fresh port.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    config, _python, command = config_from_args(args)
    config.start_method = "forkserver"
    if SHARED_FORKSERVER_ENV in os.environ:
        why_not = _use_shared_forkserver(json.loads(os.environ[SHARED_FORKSERVER_ENV]))
        if why_not is not None:
            print(f"[trident] this job's ranks are forked from a forkserver of its own: {why_not}",
                  file=sys.stderr, flush=True)
            _start_forkserver()
    else:
        _start_forkserver()
    elastic_launch(config, run_rank)(AgentSide(), *command)


def _start_forkserver(record_path: str | None = None) -> None:
    """Start this process's forkserver now (it imports while the rendezvous runs), with room in its
    environment for its ranks' (``engine.process_view``)."""
    from launch.rank_imports import RECORD_ENV

    added = {ROOM_ENV: " " * ROOM_BYTES, **({RECORD_ENV: record_path} if record_path else {})}
    os.environ.update(added)
    try:
        multiprocessing.set_forkserver_preload([PRELOAD_MODULE])
        forkserver.ensure_running()
    finally:
        for name in added:
            del os.environ[name]


def start_shared_rank_forkserver(folder: str) -> None:
    """Start a forkserver in this process (which it lives as long as) that every ``launch.torchrun``
    agent started from here with ``SHARED_FORKSERVER_ENV`` (set here) forks its ranks from."""
    record_path = os.path.join(folder, "rank-forkserver-import.json")
    _start_forkserver(record_path)
    os.environ[SHARED_FORKSERVER_ENV] = json.dumps(
        {"address": forkserver._forkserver._forkserver_address, "record": record_path})


def _use_shared_forkserver(shared: dict[str, str]) -> str | None:
    """Point multiprocessing at the ``shared`` forkserver (``SHARED_FORKSERVER_ENV``); None where it
    serves this agent, otherwise why not."""
    deadline = time.monotonic() + RECORD_WAIT_S
    while not os.path.exists(shared["record"]):
        if time.monotonic() > deadline or not os.path.exists(shared["address"]):
            return f"the shared forkserver at {shared['address']} has not finished its import"
        time.sleep(0.1)
    with open(shared["record"]) as record_file:
        record = json.load(record_file)
    imported = record["environment"]
    differing = environment_difference(imported, os.environ, record["set_by_import"])
    if differing:
        return ("this job's environment differs from the shared forkserver's in "
                + describe_difference(imported, os.environ, differing))
    # multiprocessing's client keeps these three (Python 3.11, multiprocessing/forkserver.py,
    # ForkServer.connect_to_new_process): the address, a descriptor handed on to each child as its own
    # "alive" pipe, and ensure_running, which would wait on a forkserver that is not our child.
    shared_server = forkserver._forkserver
    shared_server._forkserver_address = shared["address"]
    shared_server._forkserver_alive_fd = os.pipe()[1]
    shared_server.ensure_running = resource_tracker.ensure_running
    return None


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    record(run)(sys.argv[1:])


if __name__ == "__main__":
    from engine.lifecycle import exit_now

    main()  # a failed job raises (torch's ChildFailedError): exit status 1 and its report, as torchrun's
    exit_now(0)
