"""The embedded engine gives its memory back for real in colocated mode, measured in process RSS.

The RSS measurement runs in a fresh process: a pytest process that has run hundreds of tests holds
a fragmented heap whose RSS moves for reasons unrelated to the engine.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
import transformers

from engine.config import RolloutConfig
from engine.rollout import RolloutError, SamplingParams, WeightUpdateError, create_rollout_engine
from engine.rollout.base import CUDA_GRAPH, KV_CACHE, WEIGHTS
from tests.distributed import REPO_ROOT

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


def test_release_frees_the_weights_and_resume_takes_them_back(large_model, tmp_path):
    torch.save(large_model[1], tmp_path / "weights.pt")
    probe = f"""
import sys
sys.path.insert(0, {str(REPO_ROOT)!r})
import torch
from tests.test_rollout_memory import check_release_and_resume
check_release_and_resume({str(large_model[0])!r}, torch.load({str(tmp_path / "weights.pt")!r}))
print("RELEASE-RESUME-OK")
"""
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and "RELEASE-RESUME-OK" in result.stdout, result.stderr[-4000:]


def check_release_and_resume(path, weights) -> None:
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    assert weight_bytes > 200 * MIB
    engine = create_rollout_engine(RolloutConfig(name="torch", dtype="float32"), str(path))
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
    engine.resume_memory([KV_CACHE, CUDA_GRAPH])
    assert engine.generate([[5, 6, 7]], params)[0][0].token_ids == expected[0][0].token_ids
    engine.shutdown()


def test_memory_tags_are_checked(large_model):
    engine = create_rollout_engine(RolloutConfig(name="torch", dtype="float32"), str(large_model[0]))
    with pytest.raises(ValueError, match="memory tags"):
        engine.release_memory(["optimizer"])
    engine.release_memory([KV_CACHE])  # the cache alone: the weights stay
    assert engine.resident_weight_bytes() > 0
    engine.resume_memory([KV_CACHE])
    engine.shutdown()
