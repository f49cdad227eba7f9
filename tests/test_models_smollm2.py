"""SmolLM2-135M-Instruct: GGUF -> HF folder, then Megatron TP2 against transformers (fp32).

Tolerance of the logits: 5e-4 absolute. The logits reach ~33; fp32 carries ~7 significant digits
and TP2 sums each row-parallel matmul in a different order over 30 layers, so differences of a
few 1e-5 are rounding (measured 5.1e-5); 5e-4 still catches any real mapping error, which moves
logits by O(1).
"""

from __future__ import annotations

import json

import pytest

from engine.models import smollm2
from tests.distributed import run_torchrun


@pytest.fixture(scope="module")
def smollm2_dir():
    return smollm2.convert()  # reused from .cache/models when already converted


def test_conversion_gives_a_normal_hf_folder(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    assert smollm2.is_converted(smollm2_dir)
    assert smollm2.convert(smollm2_dir) == smollm2_dir  # reused, not redone
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size) == ("llama", 30, 576, 49152)
    assert config.eos_token_id == 2 and config.pad_token_id == 2
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 2
    ids = tokenizer("2 plus 3")["input_ids"]
    assert ids and ids[0] != tokenizer.bos_token_id  # no added BOS
    from safetensors import safe_open

    with safe_open(smollm2_dir / "model.safetensors", "pt") as handle:
        assert handle.get_slice("model.embed_tokens.weight").get_dtype() == "F32"


@pytest.mark.dist
@pytest.mark.slow
def test_megatron_tp2_matches_hf_next_token_logits(smollm2_dir, tmp_path):
    out = tmp_path / "smollm2.json"
    run_torchrun("models_smollm2.py", 2, ["--hf-dir", str(smollm2_dir), "--tp", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["max_abs_logit_diff"] <= 5e-4, result
    assert result["greedy_tokens_equal"], result
    assert result["round_trip_bit_exact"] and result["tensors"] == 272
