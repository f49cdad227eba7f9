"""CPU STAND-IN for ``sgl_kernel`` -- NOT the real package; it contains no kernels.

``sglang-kernel`` ships CUDA-only wheels. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports
``sgl_kernel`` (``import sgl_kernel`` and ``from sgl_kernel import <op>_cpu`` at module level)
and fails when the package is missing. This module makes those imports succeed while offering
nothing: it registers no ``torch.ops.sgl_kernel`` operators, so SGLang's capability check
(``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``) reports "no AMX kernel" and it uses
its plain-torch layers; any name imported from here is a function that raises when called.
It is put on ``PYTHONPATH`` only for SGLang server processes on machines without a GPU
(``engine/rollout/sglang_cpu.py``).
"""

IS_TRIDENT_CPU_STANDIN = True


def __getattr__(name: str):
    if name.startswith("__"):
        # importlib / pickle probe dunders: behave like an ordinary attribute miss.
        raise AttributeError(name)

    def _unavailable_kernel(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} was called, but this is Trident's CPU stand-in for sgl_kernel "
            "(launch/install/cpu_standins/sgl_kernel), which provides no kernels"
        )

    _unavailable_kernel.__name__ = name
    return _unavailable_kernel
