"""What a preloaded process's imports depend on, so that a process forked from it can be trusted.

Trident forks ranks (``launch.torchrun``) and SGLang servers (``engine.rollout.sglang_forkserver``)
from processes that have already imported what those import: a rank or a server then starts in a
fraction of a second instead of importing torch, transformers, megatron-core or SGLang again.
A forked process is the program it would have been, provided that

- nothing the import did has to happen again in the child. CUDA is the case that matters: a
  process forked after CUDA was initialised cannot use the GPU. ``watched_import`` has
  ``torch.cuda.is_available()`` ask NVML (``PYTORCH_NVML_BASED_CUDA_CHECK=1``: torch 2.14.1,
  ``torch/cuda/__init__.py``, ``is_available``: "This function will NOT poison fork if the
  environment variable PYTORCH_NVML_BASED_CUDA_CHECK=1 is set") and records every way into the
  CUDA runtime taken meanwhile (``torch.cuda._lazy_init``; ``torch._C._cuda_getDeviceCount``
  finding a device, which has called ``cuInit``); ``fork_safety_problem`` names them, and a thread
  left running (a fork copies only the calling one);
- the child's environment would have led to the same imports. The variables the import read through
  ``os.environ`` are recorded with their values, and those native libraries read when they load
  (``NATIVE_PREFIXES``: OpenMP, MKL, the dynamic loader, the interpreter) are added;
  ``environment_difference`` names those another environment changes. A process whose environment
  differs there is not forked from this one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from typing import Callable, Iterator, Mapping, Sequence

from parallel.device import NVML_CHECK
# Read by native libraries when they load (OpenMP, MKL, OpenBLAS, the dynamic loader, malloc) and
# by the interpreter when it starts; no watch on ``os.environ`` sees those reads.
NATIVE_PREFIXES = ("OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "LD_", "MALLOC_", "PYTHON")
# Read while importing, but only as shell bookkeeping or a terminal's size (what width a progress
# bar takes, asked again when one is drawn): they change no module's state.
SHELL_VARIABLES = frozenset({"_", "PWD", "OLDPWD", "SHLVL", "COLUMNS", "LINES"})
# Interpreter settings a forked process applies itself, as a fresh interpreter would: the search
# path (it must keep every entry the import may have used) and unbuffered output; and one read only
# when used, from the process's own environment (``breakpoint()``; Ray's driver sets it).
APPLIED_AFTER_FORK = frozenset({"PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONBREAKPOINT"})


@dataclasses.dataclass
class ImportRecord:
    """What ``watched_import`` saw: the environment the import depends on (name -> value before the
    import, None where unset), the variables the import itself set (a forked process sets them
    again, as its own import would have), the entries into the CUDA runtime, and the threads the
    import started and left running."""

    environment: dict[str, str | None]
    set_by_import: dict[str, str]
    cuda_entries: list[str]
    threads: list[str]


@contextlib.contextmanager
def _watching(variables: set[str], cuda_entries: list[str]) -> Iterator[None]:
    environ_type = type(os.environ)
    getitem, contains = environ_type.__getitem__, environ_type.__contains__

    def read(self, key):
        variables.add(key)
        return getitem(self, key)

    def has(self, key):
        variables.add(key)
        return contains(self, key)

    environ_type.__getitem__, environ_type.__contains__ = read, has
    try:
        import torch  # its own import reads variables too

        lazy_init, device_count = torch.cuda._lazy_init, torch._C._cuda_getDeviceCount

        def entered_lazy_init():
            cuda_entries.append("torch.cuda._lazy_init")
            return lazy_init()

        def counted_devices():
            count = device_count()
            if count > 0:  # the driver answered with devices: cuInit has run in this process
                cuda_entries.append(f"torch._C._cuda_getDeviceCount (found {count})")
            return count

        torch.cuda._lazy_init, torch._C._cuda_getDeviceCount = entered_lazy_init, counted_devices
        try:
            yield
        finally:
            torch.cuda._lazy_init, torch._C._cuda_getDeviceCount = lazy_init, device_count
    finally:
        environ_type.__getitem__, environ_type.__contains__ = getitem, contains


def watched_import(load: Callable[[], None]) -> ImportRecord:
    """Run ``load`` (the imports) with ``torch.cuda.is_available()`` asking NVML, and record what the
    import depends on and whether it touched CUDA."""
    variables: set[str] = set()
    cuda_entries: list[str] = []
    before = dict(os.environ)
    threads_before = set(threading.enumerate())
    os.environ.setdefault(NVML_CHECK, "1")
    try:
        with _watching(variables, cuda_entries):
            load()
    finally:
        if NVML_CHECK not in before:  # a forked process finds its GPUs as a fresh one would
            del os.environ[NVML_CHECK]
    import torch

    if torch.cuda.is_initialized() and "torch.cuda._lazy_init" not in cuda_entries:
        cuda_entries.append("torch.cuda (initialised)")
    # SGLang, for one, points the JIT caches it does not own at its own (sglang/srt/environ.py,
    # ``redirect_third_party_caches``) where they are unset.
    set_by_import = {name: value for name, value in os.environ.items() if before.get(name) != value}
    names = (variables | {name for name in before if name.startswith(NATIVE_PREFIXES)}) - SHELL_VARIABLES
    threads = [thread.name for thread in threading.enumerate() if thread not in threads_before]
    return ImportRecord({name: before.get(name) for name in sorted(names - {NVML_CHECK})}, set_by_import,
                        cuda_entries, threads)


def import_modules(modules: Sequence[str]) -> Callable[[], None]:
    """A ``load`` for ``watched_import`` that imports ``modules`` in order."""
    import importlib

    return lambda: [importlib.import_module(module) for module in modules] and None


def fork_safety_problem(record: ImportRecord) -> str | None:
    """Why a process forked after this import could not run as a fresh one would, or None."""
    if record.cuda_entries:
        return (f"the import initialised CUDA ({', '.join(record.cuda_entries)}): a process forked after that "
                "could not use the GPU")
    if record.threads:
        return f"the import left threads running ({', '.join(record.threads)}), which a fork would not copy"
    return None


def search_path_entries(search_path: str | None) -> list[str]:
    return [os.path.abspath(entry) for entry in (search_path or "").split(os.pathsep) if entry]


def environment_difference(imported: Mapping[str, str | None], environment: Mapping[str, str],
                           set_by_import: Mapping[str, str] | None = None) -> list[str]:
    """The variables the import read whose value ``environment`` changes, and the native ones it
    adds; ``APPLIED_AFTER_FORK`` are exempt, but for a PYTHONPATH that drops an entry of the import's.
    A variable holding the value the import itself set it to (``set_by_import``: a process that has
    run the same import has it) is no change."""
    set_by_import = set_by_import or {}
    changed = [name for name, value in imported.items()
               if name not in APPLIED_AFTER_FORK and environment.get(name) not in (value, set_by_import.get(name, value))]
    added = [name for name in environment
             if name.startswith(NATIVE_PREFIXES) and name not in imported and name not in APPLIED_AFTER_FORK
             and environment[name] != set_by_import.get(name)]
    dropped = set(search_path_entries(imported.get("PYTHONPATH"))) - set(search_path_entries(environment.get("PYTHONPATH")))
    return changed + added + (["PYTHONPATH"] if dropped else [])


def describe_difference(imported: Mapping[str, str | None], environment: Mapping[str, str], names: Sequence[str]) -> str:
    """``NAME ('preloaded' there, 'wanted' here), ...`` for the first few of ``names``."""
    shown = ", ".join(f"{name} ({imported.get(name)!r} there, {environment.get(name)!r} here)" for name in names[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def search_path_after_fork(current: Sequence[str], cwd: str, imported_pythonpath: str | None,
                           pythonpath: str | None) -> list[str]:
    """The ``sys.path`` a fresh ``python -m`` in ``cwd`` with ``pythonpath`` would have, from the
    preloaded process's ``current`` one (its first entry its working directory, then its own
    PYTHONPATH ``imported_pythonpath``, then the installation's entries)."""
    own = set(search_path_entries(imported_pythonpath))
    installed = [entry for entry in current[1:] if os.path.abspath(entry) not in own]
    return [cwd, *search_path_entries(pythonpath), *installed]
