"""The embedded engine gives its memory back for real in colocated mode, measured in process RSS."""
from __future__ import annotations

import gc

import pytest
import torch
import transformers

from engine.rollout import RolloutError, SamplingParams, WeightUpdateError, create_rollout_engine
from engine.rollout.base import KV_CACHE, WEIGHTS

MIB = 1024**2


def resident_set_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def large_model(tmp_path_factory):
    """A random Llama of ~260 MB in fp32: large against the RSS noise of a test process."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).float().eval()
    path = tmp_path_factory.mktemp("large_llama")
    model.save_pretrained(path)
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    del model
    gc.collect()
    return path, weights


def test_release_frees_the_weights_and_resume_takes_them_back(large_model):
    path, weights = large_model
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert weight_bytes > 200 * MIB
    engine = create_rollout_engine("torch", model_path=str(path), dtype="float32")
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    expected = engine.generate([[5, 6, 7]], params)
    assert engine.resident_weight_bytes() == weight_bytes

    loaded = resident_set_bytes()
    engine.release_memory()
    released = resident_set_bytes()
    assert engine.resident_weight_bytes() == 0
    # Freed for real: the process gives back (nearly) all of the weights' bytes.
    assert loaded - released > 0.9 * weight_bytes, (loaded / MIB, released / MIB, weight_bytes / MIB)
    with pytest.raises(RolloutError, match="released"):
        engine.generate([[5, 6, 7]], params)
    with pytest.raises(WeightUpdateError, match="released"):
        engine.update_weights(weights.items())

    engine.resume_memory([WEIGHTS])
    resumed = resident_set_bytes()
    assert resumed - released > 0.9 * weight_bytes, (released / MIB, resumed / MIB)
    engine.update_weights(weights.items(), bucket_megabytes=64)
    engine.resume_memory([KV_CACHE])
    assert engine.generate([[5, 6, 7]], params)[0][0].token_ids == expected[0][0].token_ids
    engine.shutdown()


def test_memory_tags_are_checked(large_model):
    engine = create_rollout_engine("torch", model_path=str(large_model[0]), dtype="float32")
    with pytest.raises(ValueError, match="memory tags"):
        engine.release_memory(["optimizer"])
    engine.release_memory([KV_CACHE])  # the cache alone: the weights stay
    assert engine.resident_weight_bytes() > 0
    engine.resume_memory([KV_CACHE])
    engine.shutdown()
