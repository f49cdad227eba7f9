"""Router replay (R3) in PPO steps: a tiny Qwen3-MoE whose embedded rollout engine routes every third
token to another expert than the trainer would (``tests/dist_workers/router_replay_steps.py``).
Without replay the trainer's routing differs from the rollout's and so do its log-probs; with
``actor.megatron.moe_router_replay`` the trainer routes as the engine did: no differing pairs, and
the log-prob gap of a dense model (fp32 trainer and engine). The replay itself is checked against
a float64 transformers forward forced to a routing, at four layouts, in ``tests/test_roles.py``."""
from __future__ import annotations

import json

import pytest

from tests.distributed import run_torchrun
from tests.rollout_support import requires_sglang, start_cpu_sglang

pytestmark = [pytest.mark.slow]


@pytest.mark.dist
def test_replayed_routing_matches_the_engine_where_its_own_does_not(demo_model, tmp_path):
    from engine.models.char_tokenizer import build_char_tokenizer
    from launch.rehearse import write_tiny_model

    model = write_tiny_model(dict(
        model_type="qwen3_moe", vocab_size=len(build_char_tokenizer()), hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False), tmp_path / "moe")
    out = tmp_path / "steps.json"
    run_torchrun("router_replay_steps.py", 1, [str(out), str(tmp_path / "run"), str(model)], timeout=900)
    rows = json.loads(out.read_text())
    assert [row["replay"] for row in rows] == [False, False, True, True]
    for row in rows[:2]:  # the engine's swaps show: a share of (token, layer) pairs, and a log-prob gap
        assert 0.05 < row["rollout/routed_experts_mismatch"] < 0.5, row
        assert row["rollout/log_prob_abs_diff"] > 1e-3, row
    for row in rows[2:]:  # replayed: the trainer routes as the engine did
        assert row["rollout/routed_experts_mismatch"] == 0.0, row
        assert row["rollout/log_prob_abs_diff"] < 1e-5, row


@pytest.mark.sglang
@requires_sglang
def test_sglang_reports_the_experts_it_routed_each_token_to(tmp_path):
    """A real CPU SGLang server started with --enable-return-routed-experts (its host buffer
    unpinned, ``engine.rollout.sglang_launch``): the experts it reports for every prompt and
    response token but the last are transformers' own top-k (float64) of that sequence."""
    import torch
    import transformers

    from engine.rollout import SamplingParams

    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        max_position_embeddings=256, eos_token_id=127)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(config).float().save_pretrained(tmp_path / "moe")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float64,
                                                            experts_implementation="eager").eval()
    engine = start_cpu_sglang(tmp_path / "moe", tmp_path / "run", return_routed_experts=True)
    try:
        prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
        samples = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.0, n=1))
    finally:
        engine.shutdown()
    for prompt, (sample,) in zip(prompts, samples):
        tokens = prompt + sample.token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokens]), output_router_logits=True).router_logits
        expected = torch.stack([layer.softmax(-1).topk(2).indices for layer in logits], dim=1)[:-1]  # every layer is MoE
        assert sample.routed_experts.shape == (len(tokens) - 1, 2, 2) and sample.routed_experts.dtype == torch.int16
        assert (sample.routed_experts.long().sort(dim=-1).values == expected.sort(dim=-1).values).all()
