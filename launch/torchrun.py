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
  SGLang servers a rank started), and its exit status is the program's own.

The forkserver must not initialise CUDA, or no rank forked from it could use the GPU:
``launch.rank_imports`` says what it imports and why that is safe, and checks it when done.
"""
from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import runpy
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

PRELOAD_MODULE = "launch.rank_imports"
PR_SET_NAME = 15  # prctl(2)


def run_rank(*command: str) -> None:
    """One rank, in a process forked from the preloaded server: ``python -u [-m] target args``'s work.

    ``command`` is torchrun's interpreter arguments (``-u``, ``-m module`` or a script path, the
    program's arguments); torch's ``_wrap`` has set this rank's environment already."""
    os.setsid()
    _set_title(f"rank {os.environ.get('RANK', '?')}/{os.environ.get('WORLD_SIZE', '?')}: "
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


def _set_title(title: str) -> None:
    """``ps``/``top`` show the rank instead of the forkserver's command line.

    ``/proc/<pid>/cmdline`` is the memory the kernel recorded as the process's arguments
    (``arg_start``..``arg_end``, fields 48-49 of ``/proc/self/stat``); the title overwrites it, cut
    to its length and padded with NULs, and the first 15 bytes become the thread name (``comm``).
    That is what setproctitle does, but its search for that memory walks back from the
    environment, which torch's worker wrapper has moved by now. Python keeps its own copy of argv."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])
    text = title.encode()[: end - start - 1]
    ctypes.memmove(start, text + b"\0" * (end - start - len(text)), end - start)
    ctypes.CDLL(None).prctl(PR_SET_NAME, text[:15], 0, 0, 0)


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
    multiprocessing.set_forkserver_preload([PRELOAD_MODULE])
    elastic_launch(config, run_rank)(*command)


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    record(run)(sys.argv[1:])


if __name__ == "__main__":
    main()
