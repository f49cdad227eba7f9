"""What every rank imports, imported once in the forkserver that ``launch.torchrun`` forks ranks from.

Nothing here may initialise CUDA (a process forked after that cannot use the GPU), hence:
- the import runs under ``engine.preload.watched_import``: ``torch.cuda.is_available()`` asks NVML
  meanwhile, not the CUDA runtime, whose ``cudaGetDeviceCount`` initialises the driver, and every
  way into the CUDA runtime is recorded; the variable is unset again after the import, so a rank
  finds its GPUs as under plain torchrun;
- megatron-core, and the trainer that imports it, only where no GPU is present: with CUDA,
  megatron imports transformer-engine, whose import may initialise it. There, ranks import them
  after the fork, as under plain torchrun;
- ``engine.preload.fork_safety_problem`` is checked when the import is done: a forkserver that
  initialised CUDA, or left a thread running, stops with the reason.
Importing a module here changes nothing a rank computes: it is the same code a rank would import
first thing, run once. What the imports print (megatron's warnings about missing TE and Apex) is
kept in ``import_output``: a rank writes it into its own log (``launch.main``), where it went
before, instead of the job's terminal.

What ``launch.torchrun.run_rank`` needs to make a forked rank its agent's child is kept here too:
``record`` (the environment the import depends on, and what it set), ``environment_after_import``
and ``stdio_identity`` (this process's own output, to tell torch's redirection of a rank's output
from the forkserver's). ``RECORD_ENV`` names a file to write the record to, for the agents of
other jobs that share this forkserver (``launch.torchrun.start_shared_rank_forkserver``).
"""
import dataclasses
import json
import os
import sys
import tempfile

from engine.preload import fork_safety_problem, watched_import
from engine.process_view import ROOM_ENV

RECORD_ENV = "TRIDENT_RANK_IMPORT_RECORD"


def _import_what_ranks_import() -> None:
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


def _imported_with_output_kept():
    with tempfile.TemporaryFile() as output:
        terminal = os.dup(2)
        os.dup2(output.fileno(), 2)
        try:
            imported = watched_import(_import_what_ranks_import)
        finally:
            sys.stderr.flush()
            os.dup2(terminal, 2)
            os.close(terminal)
        output.seek(0)
        return imported, output.read().decode(errors="replace")


def _identity(fd: int) -> tuple[int, int]:
    status = os.fstat(fd)
    return status.st_dev, status.st_ino


os.environ.pop(ROOM_ENV, None)  # the room stays in this process's memory, for its ranks' environments
_record_path = os.environ.pop(RECORD_ENV, None)
record, import_output = _imported_with_output_kept()
_problem = fork_safety_problem(record)
if _problem is not None:
    raise RuntimeError(f"launch.rank_imports: {_problem}; no rank can be forked from this process")
environment_after_import = dict(os.environ)
stdio_identity = {fd: _identity(fd) for fd in (1, 2)}
if _record_path:
    try:
        with open(_record_path + ".part", "w") as part:
            json.dump(dataclasses.asdict(record), part)
        os.replace(_record_path + ".part", _record_path)  # whole, or not there
    except FileNotFoundError:
        pass  # its folder is gone: the process that shares this forkserver has ended
