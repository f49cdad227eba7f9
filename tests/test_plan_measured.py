"""The memory model's parameter / gradient / optimizer bytes against real megatron models on gloo.

tests/dist_workers/plan_memory_probe.py builds the project's models (engine.models.gpt) wrapped as
training wraps them (engine.roles.optim: DDP with fp32 grads, distributed or plain Adam) at three
layouts on 4 ranks and sums every tensor's storage after one optimizer step.
"""
import json
from types import SimpleNamespace

import pytest

from engine.models.hf_config import architecture_from_hf
from launch.memory_model import ModelMemoryConfig
from parallel.layout import ParallelLayout
from tests.distributed import run_torchrun

# name -> (model_type, tied, tp, pp, param bytes, distributed optimizer, value head, EP, expert TP); as in
# the worker
CASES = {
    "llama_tp2_dp2_bf16_distopt": ("llama", False, 2, 1, 2, True, False, 1, None),
    "qwen2_pp2_dp2_bf16_distopt_critic": ("qwen2", False, 1, 2, 2, True, True, 1, None),
    "llama_tied_tp2_pp2_fp32_adam": ("llama", True, 2, 2, 4, False, False, 1, None),
    "qwen3moe_tp2_ep2_bf16_distopt": ("qwen3_moe", False, 2, 1, 2, True, False, 2, None),
    "qwen3moe_ep2_dp4_bf16_distopt": ("qwen3_moe", False, 1, 1, 2, True, False, 2, None),
    "qwen3moe_tp2_ep2_etp1_bf16_distopt": ("qwen3_moe", False, 2, 1, 2, True, False, 2, 1),
}
# DDP pads each gradient bucket (and so the optimizer shards) to a multiple of the DP size x 128
# elements; on this ~60k-parameter model that is < 0.2%. Parameters are counted exactly.
PADDING_TOLERANCE = 0.01


def architecture(model_type, tied):
    from tests.dist_workers.plan_memory_probe import MOE_FIELDS

    return architecture_from_hf(SimpleNamespace(
        model_type=model_type, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=tied,
        rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", **(MOE_FIELDS if model_type == "qwen3_moe" else {})))


@pytest.mark.dist
@pytest.mark.slow
def test_estimates_match_measured_megatron_storage(tmp_path):
    run_torchrun("plan_memory_probe.py", 4, [str(tmp_path)])
    results = [r for rank in range(4) for r in json.loads((tmp_path / f"rank{rank}.json").read_text())]
    assert {r["case"] for r in results} == set(CASES)
    for measured in results:
        model_type, tied, tp, pp, param_bytes, distributed, value_head, ep, etp = CASES[measured["case"]]
        assert measured["param_element_bytes"] == param_bytes
        model = ModelMemoryConfig(
            role="actor", architecture=architecture(model_type, tied),
            layout=ParallelLayout(tp, pp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
                                  sequence_parallel=tp > 1),
            data_parallel_size=measured["data_parallel_size"], trainable=True, value_head=value_head,
            params_dtype_bytes=param_bytes, grad_dtype_bytes=4, use_distributed_optimizer=distributed)
        stage = measured["pipeline_rank"]
        where = f"{measured['case']} rank {measured['rank']}"
        assert measured["params_bytes"] == model.params_bytes(stage), where
        assert measured["grads_bytes"] == pytest.approx(model.grad_bytes(stage), rel=PADDING_TOLERANCE), where
        assert measured["optimizer_bytes"] == pytest.approx(model.optimizer_bytes(stage), rel=PADDING_TOLERANCE), where
