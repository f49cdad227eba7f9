"""The HybridEngine on real megatron-core actors under torchrun + gloo (4 and 8 CPU ranks).

Each launch runs several layouts (see tests/dist_workers/reshard_sync.py for what every case
checks: bit-identical tensors for the FULL and SHARDED targets, bytes = plan, staging within the
bucket, fingerprint check, engine generation = HF generation, micro-DP data flow).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.distributed import run_torchrun
from tests.rollout_support import requires_sglang

pytestmark = pytest.mark.dist


SPECIAL_TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def save_random_model(tmp_path_factory, model_class, config, spread=None):
    """A random model (seed 0) saved to a fresh folder; ``spread(name, param)`` moves chosen weights
    away from their initial values, so that a weight the sync fails to deliver shows."""
    directory = tmp_path_factory.mktemp(config.model_type)
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if spread is not None:
                spread(name, param)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A random tiny Llama (GQA 4 heads / 2 groups, vocab 200): TP4 pads query groups, every TP pads vocab."""
    return save_random_model(tmp_path_factory, transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, **SPECIAL_TOKENS))


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory):
    """A random tiny Qwen3: per-head q/k RMSNorm (weights away from 1), head_dim 32 != hidden / heads,
    180 vocab rows, which Megatron pads to 256 and SGLang to 192 (its TP ranks' vocab slices are not
    Megatron's)."""
    def spread(name, param):
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            param.uniform_(0.5, 1.5)

    return save_random_model(tmp_path_factory, transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        vocab_size=180, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128, tie_word_embeddings=False,
        **SPECIAL_TOKENS), spread)


def run_cases(directory, tmp_path, nproc: int, cases: list[str], engine: str = "torch") -> list[dict]:
    out = tmp_path / "records.json"
    run_torchrun("reshard_sync.py", nproc,
                 ["--hf-dir", str(directory), "--cases", *cases, "--out", str(out), "--engine", engine], timeout=900)
    records = json.loads(out.read_text())
    assert [r["case"] for r in records] == cases
    return records


def test_reshard_on_4_ranks(tiny_llama_dir, tmp_path):
    # pp,tp,vpp,tp_gen: (pp2,tp2)->1, (pp2,tp2)->2, (pp2,tp1,dp2,vpp2)->1, tp_gen == tp (pp1,tp2,dp2),
    # padded query groups (pp1,tp4)->2, tp_gen > tp (pp2,tp1)->2.
    records = run_cases(tiny_llama_dir, tmp_path, 4, ["2,2,0,1", "2,2,0,2", "2,1,2,1", "1,2,0,2", "1,4,0,2", "2,1,0,2"])
    by_case = {r["case"]: r for r in records}
    # tp_gen == tp: the sharded target moves nothing, every rank already holds its generation shard.
    assert by_case["1,2,0,2"]["sharded"]["received"] == 0
    # Zero redundancy: a sharded target gets 1/tg of what the full target gets, or less.
    assert by_case["2,2,0,2"]["sharded"]["received"] < by_case["2,2,0,2"]["full"]["received"] / 2
    # What launch.plan reports for the loop's sync (whole tensors, fp32 here) is what rank 0 received.
    for case, record in by_case.items():
        assert planned_received_bytes(tiny_llama_dir, case, world_size=4)[0] == record["full"]["received"], case


def planned_received_bytes(model_dir, case: str, world_size: int) -> dict[int, int]:
    from engine.models.hf_config import architecture_from_hf, load_hf_config
    from launch.plan import weight_sync_received_bytes
    from parallel.layout import ParallelLayout
    from tests.dist_workers.reshard_sync import parse_case

    pp, tp, vpp, tg, ep, etp = parse_case(case)
    layout = ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
                            expert_tensor_parallel_size=etp)
    return weight_sync_received_bytes(architecture_from_hf(load_hf_config(model_dir)), layout, world_size, tg, "float32")


def test_reshard_on_8_ranks(tiny_llama_dir, tmp_path):
    # (pp2,tp2,dp2)->tp_gen2 and (pp1,tp4,dp2)->tp_gen2.
    records = run_cases(tiny_llama_dir, tmp_path, 8, ["2,2,0,2", "1,4,0,2"])
    assert all(r["prompts_checked"] > 0 for r in records)


@pytest.fixture(scope="module")
def tiny_qwen3_moe_dir(tmp_path_factory):
    """A random tiny Qwen3-MoE: 4 experts, top-2, layer 1 dense, per-head q/k norms, head_dim 32 != 64 / 4;
    router and experts away from their init scale."""
    def spread(name, param):
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            param.normal_(0, 0.2)

    return save_random_model(tmp_path_factory, transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[1], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=128, tie_word_embeddings=False, **SPECIAL_TOKENS), spread)


def test_moe_reshard_on_4_ranks(tiny_qwen3_moe_dir, tmp_path):
    # pp,tp,vpp,tp_gen,ep[,etp]: experts split over TP only (pp2,tp2)->1; over EP2 x TP2 -> 1 and -> 2; over
    # EP2 x PP2 -> 1 and -> 2 (generation TP above the training TP); over EP4 -> 1 (each rank holds one
    # expert of each MoE layer); whole experts (expert TP 1) at TP2: EP2 -> 2, EP2 x PP2 -> 1, EP4 over
    # the TP and DP ranks -> 2.
    cases = ["2,2,0,1", "1,2,0,1,2", "1,2,0,2,2", "2,1,0,1,2", "2,1,0,2,2", "1,1,0,1,4", "1,2,0,2,2,1",
             "2,2,0,1,2,1", "1,2,0,2,4,1"]
    records = run_cases(tiny_qwen3_moe_dir, tmp_path, 4, cases)
    assert all(r["prompts_checked"] > 0 for r in records)
    # Experts move point to point wherever expert parallelism splits them (the dense phases broadcast
    # and gather); each worker checked that all of its rank's went out in batch_isend_irecv calls.
    assert all((record["full"]["batched_p2p_world"] > 0) == (len(record["case"].split(",")) > 4) for record in records)
    for record in records:  # vocab 256 needs no padding: every byte moved is one the rank lacked
        for target in ("full", "sharded"):
            assert record[target]["received"] <= 1.05 * record[target]["lower_bound"], (record["case"], target)


@pytest.fixture(scope="module")
def sglang_qwen3_moe_dir(tmp_path_factory):
    """A random tiny Qwen3-MoE that SGLang's CPU engine serves (every layer MoE, head_dim 16 = 64 / 4;
    with ``tiny_qwen3_moe_dir``'s dense layer 1 and head_dim 32 it returns NaN log-probs)."""
    def spread(name, param):
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            param.normal_(0, 0.1)

    return save_random_model(tmp_path_factory, transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=128, tie_word_embeddings=False, **SPECIAL_TOKENS), spread)


@pytest.mark.sglang
@pytest.mark.slow
@requires_sglang
def test_moe_shards_into_real_sglang_workers(sglang_qwen3_moe_dir, tmp_path):
    # (pp1,tp2,ep2,etp1)->tp_gen2: each rank holds two whole experts of each MoE layer and needs its
    # TP half of all four; the sharded push delivers each rank its slices of every expert into SGLang's
    # fused-MoE weights (w13 / w2, placed by their own presharded loader), and the full push after it
    # must leave every TP worker's parameters bit for bit as they were (tests/dist_workers/reshard_sync.py).
    #
    # Every parameter is bit for bit SGLang's own load except the fused-expert tensors: on CPU SGLang
    # pads intermediate sizes to a multiple of 32 x TP (``adjust_config_with_unaligned_cpu_tp``), so its
    # own loader puts all 32 real rows of each expert on TP rank 0 and zeros on rank 1, where the shards
    # split them 16 + 16 (each zero-padded to 32): another split of the same sum over the TP ranks, so the
    # served model is the same (greedy tokens equal, log-probs within 1e-6 of each other and of
    # transformers'). On a GPU SGLang does not pad, and the two layouts are one.
    (record,) = run_cases(sglang_qwen3_moe_dir, tmp_path, 2, ["1,2,0,2,2,1"], engine="sglang")
    assert record["prompts_checked"] > 0 and record["max_log_prob_difference"] < 1e-4
    assert record["sharded_push"]["tensors_compared"] > 0
    assert all(name.endswith(("experts.w13_weight", "experts.w2_weight")) for name in record["sharded_push"]["differing"])
    assert 0 < record["sharded_push"]["max_received"] < record["full"]["received"]


@pytest.mark.sglang
@pytest.mark.slow
@requires_sglang
def test_reshard_into_real_sglang_servers(tiny_qwen3_dir, tmp_path):
    # (pp1,tp2)->tp_gen1: each rank all-gathers the other's TP shards and pushes them bucket by bucket
    # into its own SGLang server (2 servers). (pp1,tp2)->tp_gen2: one server at TP2, whose TP rank g
    # gets the payload that training rank g serialized itself (its pid is in the payload's
    # shared-memory file name), one request per bucket from the leader. Both: greedy generation
    # equals HF with the exported weights. Qwen3: its per-head q/k norms (replicated tensors) and
    # decoupled head_dim reach the server too (the Llama push into SGLang: tests/test_rollout_sglang.py).
    #
    # Each case first pushes the sharded way (each rank's own generation shard to its own SGLang TP
    # worker, placed there by engine.rollout.sglang_presharded), then the full way; the worker checks
    # every rank received exactly the plan's lower bound, and that every TP worker's parameter
    # checksums (SGLang's /weights_checker) and the greedy tokens and log-probs of probe prompts are
    # the same after both pushes. (pp2,tp1)->tp_gen2: the stages send the generation ranks their slices.
    by_rank, per_rank, stages = run_cases(tiny_qwen3_dir, tmp_path, 2, ["1,2,0,1", "1,2,0,2", "2,1,0,2"], engine="sglang")
    for record in (by_rank, per_rank, stages):
        assert record["prompts_checked"] > 0 and record["max_log_prob_difference"] < 1e-4
        assert record["sharded_push"]["tensors_compared"] > 0 and record["sharded_push"]["differing"] == []
    assert "per_rank_payloads_checked" not in by_rank and per_rank["per_rank_payloads_checked"] > 1
    # Training TP2 -> generation TP2: each worker opens its own rank's handle, and the only bytes that
    # cross ranks are the vocab rows SGLang gives another rank than Megatron does: it pads 180 rows
    # to 192 (rows 96.. on rank 1), Megatron to 256 (rows 128.. on rank 1), so rows 96..127 of the
    # embedding and the LM head (64 wide, fp32) go from rank 0 to rank 1. Where the paddings agree
    # (Qwen3's 151936 and Llama 3's 128256 rows at TP 1..8) nothing moves: tests/test_plan.py.
    assert per_rank["sharded_push"]["max_received"] == 2 * 32 * 64 * 4 and per_rank["sharded_push"]["output"] > 0
    # TP2 -> TP1 and PP2 -> TP2 move what the ranks lack, and less than the full push.
    for record in (by_rank, stages):
        assert 0 < record["sharded_push"]["max_received"] <= record["full"]["received"]
    assert stages["sharded_push"]["max_received"] < stages["full"]["received"]
