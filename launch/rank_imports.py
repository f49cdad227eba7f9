"""What every rank imports, imported once in the forkserver that ``launch.torchrun`` forks ranks from.

Nothing here may initialise CUDA (a process forked after that cannot use the GPU), hence:
- ``torch.cuda.is_available()`` asks NVML, as ``PYTORCH_NVML_BASED_CUDA_CHECK`` makes it, not the
  CUDA runtime, whose ``cudaGetDeviceCount`` initialises the driver (torch 2.14.1,
  ``torch/cuda/__init__.py``, ``is_available``: "will NOT poison fork if ... set");
- megatron-core, and the trainer that imports it, only where no GPU is present: with CUDA,
  megatron imports transformer-engine, whose import may initialise it. There, ranks import them
  after the fork, as under plain torchrun;
- the end of the import checks that torch has not initialised CUDA (``torch.cuda.is_initialized``).
Importing a module here changes nothing a rank computes: it is the same code a rank would import
first thing, run once. What the imports print (megatron's warnings about missing TE and Apex) is
kept in ``import_output``: a rank writes it into its own log (``launch.main``), where it went
before, instead of the job's terminal.
"""
import os
import sys
import tempfile


def _import_what_ranks_import() -> None:
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import reasoning_gym  # noqa: F401  (the demo's and the SmolLM2 example's rewards)
    import torch
    import torch._dynamo  # noqa: F401  (transformers' tokenizers import it through torchvision)
    import transformers.modeling_layers  # noqa: F401  (HF models: the embedded engine, conversions)
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401
    from transformers.models.llama import configuration_llama  # noqa: F401
    from transformers.models.qwen2 import configuration_qwen2  # noqa: F401

    import engine.config  # noqa: F401

    if not torch.cuda.is_available():
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401

        import engine.trainer.ppo_trainer  # noqa: F401
    if torch.cuda.is_initialized():
        raise RuntimeError("launch.rank_imports initialised CUDA: ranks forked from it could not use the GPU")


def _imported_with_output_kept() -> str:
    with tempfile.TemporaryFile() as output:
        terminal = os.dup(2)
        os.dup2(output.fileno(), 2)
        try:
            _import_what_ranks_import()
        finally:
            sys.stderr.flush()
            os.dup2(terminal, 2)
            os.close(terminal)
        output.seek(0)
        return output.read().decode(errors="replace")


import_output = _imported_with_output_kept()
