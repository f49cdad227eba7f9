"""Process groups, layouts, the 3D-HybridEngine, offload, and the CPU adaptation of megatron-core.

Importing the package installs ``cpu_compat``'s import hook (item 10 there, in ``jit_import_hook``)
before megatron-core is imported: without CUDA megatron's jit fuser is switched off as its module loads.
The hook imports nothing heavy, so ``import engine.config`` stays free of torch.
"""
from parallel import jit_import_hook

jit_import_hook.install()
