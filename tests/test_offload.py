"""Offload (parallel.offload, ``...megatron.param_offload / grad_offload / optimizer_offload``):
tests/dist_workers/offload_roundtrip.py on 2 gloo ranks, bf16 with the distributed optimizer.

Measured there: every part's storages really shrink to 0 bytes on the device (CPU here), by exactly
what megatron holds for a 164,480-parameter model on one of 2 data-parallel ranks, and come back
bit-identical; an actor that offloads everything between its phases trains exactly like one that
does not. The whole PPO loop with every offload switch on logs the same metrics as without
(tests/test_ppo_end_to_end.py)."""

from __future__ import annotations

import json

import pytest

from tests.distributed import run_torchrun
from tests.test_roles import tiny_llama  # noqa: F401 (fixture)

pytestmark = [pytest.mark.dist]


@pytest.fixture(scope="module")
def roundtrip(tiny_llama, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("offload") / "r.json"
    run_torchrun("offload_roundtrip.py", 2, ["--hf-dir", str(tiny_llama), "--out", str(out)], timeout=600)
    return json.loads(out.read_text())


def test_each_part_leaves_the_device_and_comes_back_bit_identical(roundtrip):
    parameters = 164_480  # the tiny Llama: embeddings 2 x 6,400 + 4 layers x 36,992 + final norm 64
    expected = {
        "params": parameters * 2,  # bf16 weights (megatron's flat parameter buffer)
        "grads": parameters * 4,  # fp32 gradient buffer
        "optimizer": parameters * 12 // 2,  # fp32 main weights + 2 Adam moments, sharded over DP 2
    }
    for part, size in expected.items():
        assert roundtrip["bytes"][part] == {"offloaded": size, "on_device": 0}, part
        assert roundtrip["resident_again"][part] == size, part
    assert roundtrip["bit_identical"] and roundtrip["compared_tensors"] > 40
    assert roundtrip["grads_zero"]


def test_offloading_actor_trains_exactly_like_a_resident_one(roundtrip):
    assert roundtrip["updates"]["offloading"] == roundtrip["updates"]["resident"]
