"""``cpu_compat`` item 10, the part that runs before megatron-core is imported: an import hook that,
without CUDA, switches megatron's jit fuser off right after ``megatron.core.jit`` runs.

Kept apart from ``cpu_compat`` because ``parallel/__init__.py`` installs it and must not import torch
(``engine.config`` is imported by launchers and config tools that never touch torch).
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class JitFuserOffOnCpu(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as usual; without CUDA, calls its ``disable_jit_fuser()`` once the
    module has run, before any fusion is decorated with it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core.jit":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_switch_off(module):
            exec_module(module)
            import torch  # megatron.core.jit has imported it already

            if not torch.cuda.is_available():
                module.disable_jit_fuser()

        spec.loader.exec_module = exec_then_switch_off
        return spec


def install() -> None:
    """Idempotent, and a no-op once megatron is imported."""
    if "megatron.core.jit" not in sys.modules and not any(isinstance(f, JitFuserOffOnCpu) for f in sys.meta_path):
        sys.meta_path.insert(0, JitFuserOffOnCpu())
