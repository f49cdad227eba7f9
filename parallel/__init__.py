"""Process groups, layouts, the 3D-HybridEngine, offload, and the CPU adaptation of megatron-core.

Importing the package installs ``cpu_compat``'s import hook (item 10 there) before megatron-core is
imported: without CUDA megatron's jit fuser is switched off as its module loads.
"""
from parallel import cpu_compat

cpu_compat.install_import_hook()
