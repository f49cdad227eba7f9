"""Actor / critic / reference on the Megatron mesh (torchrun + gloo), against TP1/PP1/DP1.

Two launches of tests/dist_workers/roles_parity.py on the same tiny HF Llama and batch:
1 rank (the TP1/PP1/DP1 reference, packed and dynamic variants, transformers float64 log-probs,
first-update ppo_kl) and 4 ranks (TP2, TP2+SP, PP2, TP2xPP2, PP2xVPP2, DP4; each layout with the
DP size the world leaves), and a third: context parallelism (CP2 alone, packed with a2a, x TP2 + SP, x PP2,
x PP2 x VPP2). One full PPO update of actor and critic (2 mini-batches x 2
micro-batches) must give the same losses, gradient norms and updated weights (fp32, rel. 1e-5).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.distributed import run_torchrun

REFERENCE = "1,1,0,0,0,0"  # tp,pp,vpp,sp,packing,dynamic
SINGLE_RANK_VARIANTS = ["1,1,0,0,1,0", "1,1,0,0,0,1", "1,1,0,0,1,1"]
FOUR_RANK_LAYOUTS = ["2,1,0,0,0,0", "2,1,0,1,1,0", "1,2,0,0,0,1", "2,2,0,0,1,0", "1,2,2,0,1,0", "1,1,0,0,1,1"]
TOLERANCE = 1e-5
# Differences of log-probs (|log p| ~ 5 here) and clipped fractions: compared absolutely, since a
# relative bound on a near-cancelling difference would demand more than fp32 has.
ABSOLUTE_METRICS = ("ppo_kl", "pg_clipfrac", "pg_clipfrac_lower", "vf_clipfrac")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _launch(tiny_llama, tmp_path_factory, nproc, layouts, extra):
    out_dir = tmp_path_factory.mktemp(f"roles_{nproc}")
    run_torchrun(
        "roles_parity.py", nproc,
        ["--hf-dir", str(tiny_llama), "--out", str(out_dir / "r.json"), "--out-dir", str(out_dir),
         "--layouts", *layouts, *extra],
        timeout=600,
    )
    results = json.loads((out_dir / "r.json").read_text())
    weights = {name: torch.load(out_dir / f"{name.replace(',', '_')}.pt") for name in layouts}
    return results, weights


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    """4 experts, top-2 renormalised, layer 1 dense; router and experts away from their init scale."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".experts." in name or name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def single_rank(tiny_llama, tmp_path_factory):
    return _launch(tiny_llama, tmp_path_factory, 1, [REFERENCE, *SINGLE_RANK_VARIANTS], ["--check-reference"])


@pytest.fixture(scope="module")
def four_ranks(tiny_llama, tmp_path_factory):
    return _launch(tiny_llama, tmp_path_factory, 4, FOUR_RANK_LAYOUTS, ["--check-vocab-parallel"])


# tp,pp,vpp,sp,packing,dynamic,ep: the MoE actor and critic with experts split 2 and 4 ways, with TP2 (+ SP,
# which megatron requires for MoE training with TP) and with PP2, against the same world without EP; and
# TP2+SP x PP2 (the later stage's padding mask split over the SP ranks by the worker); whole experts
# (expert TP 1, the 8th field) at TP2 + SP with EP2, and with EP4 over the TP and data-parallel ranks.
MOE_REFERENCE = "1,1,0,0,0,0,1"
# With context parallelism 2 (the 9th and 10th fields): EP2 (DP2), EP2 with whole experts at TP2 + SP (padded
# rows: all_gather takes no packed ones, as in Transformer Engine), EP4 packed with the a2a exchange.
MOE_LAYOUTS = ["1,1,0,0,0,0,2", "1,1,0,0,1,0,4", "2,1,0,1,0,0,2", "1,2,0,0,0,1,2", "2,2,0,1,0,0,1",
               "2,1,0,1,0,0,2,1", "2,1,0,1,1,0,4,1", "1,1,0,0,0,0,2,0,2,all_gather",
               "2,1,0,1,0,0,2,1,2,all_gather", "1,1,0,0,1,0,4,0,2,a2a"]
# Layouts that cut the mini-batches into other micro-batches than the reference (dynamic batching; DP1
# with 2 sequences per micro-batch): the per-micro-batch load-balancing loss differs there.
MOE_OTHER_MICRO_BATCHES = {"1,2,0,0,0,1,2", "2,2,0,1,0,0,1", "2,1,0,1,0,0,2,1,2,all_gather"}


def _relative_error(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


def _assert_same_update(name, results, weights, reference_results, reference_weights, weight_tolerance=TOLERANCE,
                        same_micro_batches=True):
    mask = torch.tensor(reference_results["response_mask"], dtype=torch.bool)
    for key in ("old_log_probs", "entropy", "values"):
        actual, expected = torch.tensor(results[key])[mask], torch.tensor(reference_results[key])[mask]
        assert _relative_error(actual, expected) <= TOLERANCE, (name, key)
    for role in ("actor", "critic"):
        assert results[role].keys() == reference_results[role].keys(), (name, role)
        for metric, value in results[role].items():
            if metric.endswith("moe_load_balancing_loss") and not same_micro_batches:
                continue  # a loss per micro-batch: other micro-batches, another (equally valid) value
            expected = reference_results[role][metric]
            bound = TOLERANCE if metric.split("/")[-1] in ABSOLUTE_METRICS else TOLERANCE * abs(expected)
            assert abs(value - expected) <= bound, (name, metric, value, expected)
    assert weights.keys() == reference_weights.keys()
    worst = max(weights, key=lambda k: _relative_error(weights[k], reference_weights[k]))
    assert _relative_error(weights[worst], reference_weights[worst]) <= weight_tolerance, (name, worst)


@pytest.mark.dist
def test_single_rank_reference_packing_dynamic_and_first_step(single_rank):
    results, weights = single_rank
    reference = results["layouts"][REFERENCE]
    # The update really moved the weights (else "same weights" would be vacuous).
    assert reference["actor"]["actor/grad_norm"] > 0.1 and reference["critic"]["critic/grad_norm"] > 0.1
    # Packed (THD) vs padded, dynamic vs fixed micro-batches: the same log-probs, values, update.
    for name in SINGLE_RANK_VARIANTS:
        _assert_same_update(name, results["layouts"][name], weights[name], reference, weights[REFERENCE])
    # Recomputed old log-probs equal an independent forward (transformers, float64) on the same
    # weights, and the first update starts on-policy: ppo_kl == 0.
    for path, check in results["reference"].items():
        assert check["max_abs_error_vs_hf"] < 1e-5, path
        assert check["first_update_ppo_kl"] == 0.0, path


@pytest.mark.dist
@pytest.mark.slow
def test_layouts_match_single_rank(single_rank, four_ranks):
    reference_results, reference_weights = single_rank
    results, weights = four_ranks
    reference = reference_results["layouts"][REFERENCE]
    for name in FOUR_RANK_LAYOUTS:
        _assert_same_update(name, results["layouts"][name], weights[name], reference, reference_weights[REFERENCE])
    assert {results["layouts"][name]["dp"] for name in FOUR_RANK_LAYOUTS} == {1, 2, 4}
    # ... with megatron DDP's overlapped gradient reduce and weight gather, as experiments run.
    assert all(flags == [True, True] for name in FOUR_RANK_LAYOUTS for flags in results["layouts"][name]["overlap"])


# tp,pp,vpp,sp,packing,dynamic,ep,etp,cp,cp_comm_type: context parallelism over 2 ranks (DP2), packed
# with the a2a exchange, x TP2 + SP, x PP2 packed with dynamic micro-batches, x PP2 x VPP2 packed. all_gather
# runs padded rows only (Transformer Engine's takes no packed ones: parallel.layout.PACKED_ROW_COMM_TYPES).
CONTEXT_PARALLEL_LAYOUTS = ["1,1,0,0,0,0,1,0,2,all_gather", "1,1,0,0,1,0,1,0,2,a2a", "2,1,0,1,0,0,1,0,2,all_gather",
                            "1,2,0,0,1,1,1,0,2,a2a", "1,2,2,0,1,0,1,0,2,a2a"]


@pytest.mark.dist
def test_context_parallel_update_matches_single_rank(tiny_llama, tmp_path_factory, single_rank):
    """Each CP rank runs its chunks of every sequence; log-probs, entropy and values come back whole,
    and one actor + critic update equals the single rank's: losses, grad norms, every weight."""
    reference_results, reference_weights = single_rank
    results, weights = _launch(tiny_llama, tmp_path_factory, 4, CONTEXT_PARALLEL_LAYOUTS, [])
    reference = reference_results["layouts"][REFERENCE]
    for name in CONTEXT_PARALLEL_LAYOUTS:
        _assert_same_update(name, results["layouts"][name], weights[name], reference, reference_weights[REFERENCE])


@pytest.mark.dist
@pytest.mark.slow
def test_vocab_parallel_tp4_matches_float64(four_ranks):
    check = four_ranks[0]["vocab_parallel"]
    assert check["tp"] == 4
    assert max(check["log_prob"], check["entropy"], check["grad"]) <= 1e-5


@pytest.mark.dist
def test_moe_update_with_expert_parallelism_matches_ep1(tiny_qwen3_moe, tmp_path_factory):
    results, weights = _launch(tiny_qwen3_moe, tmp_path_factory, 4, [MOE_REFERENCE, *MOE_LAYOUTS],
                               ["--check-load-balancing", "--check-routing"])
    reference = results["layouts"][MOE_REFERENCE]
    # The load-balancing loss (engine.roles.load_balancing) is reported for actor and critic; below 1
    # is impossible (1 = uniform load), at most E / k = 2.
    for role in ("actor", "critic"):
        assert 1.0 <= reference[role][f"{role}/moe_load_balancing_loss"] <= 2.0, reference[role]
    balancing = results["load_balancing"]
    # Reported without being added: transformers' router logits (float64), the mean over micro-batches
    # (one sequence each) and MoE layers.
    assert abs(balancing["ep1"]["loss"] - balancing["reference"]) <= 1e-6 * balancing["reference"], balancing
    # Added with coefficient 0.5: megatron's own record of it is the same number (same weights at the
    # one optimizer step), the update changes, and it is the same update at EP2 x TP2 + SP with half
    # the data-parallel ranks (the added gradient is averaged like the PPO loss's).
    added, layout = balancing["ep1_added"], balancing["ep2_tp2_added"]
    assert abs(added["loss"] - balancing["ep1"]["loss"]) <= 1e-6 * added["loss"]
    assert abs(added["grad_norm"] - balancing["ep1"]["grad_norm"]) > 1e-3 * added["grad_norm"]
    assert abs(layout["loss"] - added["loss"]) <= TOLERANCE * added["loss"]
    assert abs(layout["grad_norm"] - added["grad_norm"]) <= TOLERANCE * added["grad_norm"]
    for key, router in added["routers"].items():
        assert _relative_error(layout["routers"][key], router) <= TOLERANCE, key
        assert _relative_error(balancing["ep1"]["routers"][key], router) > 1e-4, key
    # The routing-mismatch metric (engine.roles.routing) against transformers' routing of every token but
    # each row's last: none differ at EP2, EP2 x TP2 + SP packed, PP2 dynamic, TP2 + SP x PP2; with a
    # quarter of layer 0's expert sets replaced, exactly that share of the compared pairs.
    routing = results["routing"]
    assert routing["compared"] > 100 and routing["corrupted"] > 10
    # Router replay (R3) of the corrupted routing: the trainer routes as told (0 differing pairs), and its
    # log-probs are transformers' (float64) with every token forced to those experts, within the dense
    # models' tolerance, where without replay they are the natural routing's, far from the forced ones.
    assert routing["forced_vs_natural"] > 1e-3, routing
    for layout_name in ("1,1,0,0,0,0,2", "2,1,0,1,1,0,2", "1,2,0,0,0,1,2", "2,2,0,1,1,0,1"):
        measured = routing[layout_name]
        assert measured["same"] == 0.0, layout_name
        assert measured["corrupted"] == pytest.approx(routing["corrupted"] / routing["compared"]), layout_name
        assert measured["replayed_same"] == measured["replayed_corrupted"] == 0.0, (layout_name, measured)
        assert measured["same_vs_natural"] <= TOLERANCE and measured["corrupted_vs_natural"] <= TOLERANCE, measured
        assert measured["replayed_same_vs_natural"] <= TOLERANCE, (layout_name, measured)
        assert measured["replayed_corrupted_vs_forced"] <= TOLERANCE, (layout_name, measured)
        assert measured["corrupted_vs_forced"] > 1e-3, (layout_name, measured)
    update = routing["2,1,0,1,1,0,2"]
    assert update["update_grad_norm"] > 0 and update["routers_changed"] and all(update["routers_changed"]), update
    everything = lambda w: torch.cat([t.flatten().double() for _, t in sorted(w.items())])  # noqa: E731
    for name in MOE_LAYOUTS:
        # Per tensor 1e-4: Adam's m / sqrt(v) amplifies fp32 round-off where a weight's gradients nearly
        # cancel over the two steps (measured: 1 element of layer 0's o_proj, 1.9e-5 apart, 1.5e-5
        # relative to the tensor, in every EP layout alike); all weights together within 1e-5.
        _assert_same_update(name, results["layouts"][name], weights[name], reference, weights[MOE_REFERENCE],
                            weight_tolerance=10 * TOLERANCE, same_micro_batches=name not in MOE_OTHER_MICRO_BATCHES)
        assert _relative_error(everything(weights[name]), everything(weights[MOE_REFERENCE])) <= TOLERANCE, name
    assert any(weights[MOE_REFERENCE][k].ne(0).any() for k in weights[MOE_REFERENCE] if ".experts." in k)
