"""HybridEngine layouts, reshard plan and integrity fingerprints, in one process (no torch.distributed).

The plan is checked by simulating it: every rank starts with a boolean mask of the elements it
holds, the plan's phase-1 and phase-2 transfers are replayed (a source must hold what it sends),
and at the end every rank must hold what it needs, having received each missing element exactly
once. The lower bound is recomputed from the masks (a different formula from the plan's ranges).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from parallel.hybrid_engine import (
    FusedKind,
    GenerationLayout,
    HFTensorLayout,
    HybridLayout,
    ParameterSpec,
    ReshardPlan,
    ReshardTarget,
    TrainingLayout,
    check_fingerprints,
    compare_fingerprints,
    hf_chunks_of_shard,
    replica_slice,
    split_for_generation,
    tensor_fingerprint,
)
from parallel.hybrid_engine.spec import SliceRange, chunk_range
from parallel.layout import LayoutError


def tiny_specs(pp: int, tp: int, vpp: int = 1, *, layers: int = 4, hidden: int = 16, heads: int = 8,
               groups: int = 4, ffn: int = 32, vocab: int = 64, vocab_multiple: int = 8, experts: int = 0,
               ep: int = 1) -> list[ParameterSpec]:
    """A Llama-shaped model: embedding, per layer norm/qkv/o/fc1/fc2, final norm, LM head; with
    ``experts``, each layer's MLP is a router and that many experts split over ``ep`` expert ranks.

    Query groups and vocab rows are padded like megatron when ``tp`` does not divide them.
    """
    head_dim, per_group = hidden // heads, heads // groups
    padded_groups = math.ceil(groups / tp) * tp
    padded_vocab = math.ceil(vocab / (vocab_multiple * tp)) * vocab_multiple * tp
    per_chunk = layers // (pp * vpp)
    specs = [ParameterSpec("embedding", (HFTensorLayout("embed", (vocab, hidden), padded_vocab),), 0, 0, 0)]
    for layer in range(layers):
        chunk = layer // per_chunk
        stage, vp = chunk % pp, chunk // pp
        q_unit = per_group * head_dim
        specs += [
            ParameterSpec(f"{layer}.norm", (HFTensorLayout(f"{layer}.norm", (hidden,)),), stage, vp, None),
            ParameterSpec(f"{layer}.qkv", (
                HFTensorLayout(f"{layer}.q", (heads * head_dim, hidden), padded_groups * q_unit, q_unit),
                HFTensorLayout(f"{layer}.k", (groups * head_dim, hidden), padded_groups * head_dim, head_dim),
                HFTensorLayout(f"{layer}.v", (groups * head_dim, hidden), padded_groups * head_dim, head_dim),
            ), stage, vp, 0, FusedKind.QKV),
            ParameterSpec(f"{layer}.o", (HFTensorLayout(f"{layer}.o", (hidden, heads * head_dim),
                                                        padded_groups * q_unit, q_unit),), stage, vp, 1),
        ]
        if experts:
            specs.append(ParameterSpec(f"{layer}.router", (HFTensorLayout(f"{layer}.router", (experts, hidden)),),
                                       stage, vp, None))
        for expert in range(experts or 1):
            name, owner = (f"{layer}.{expert}", expert // (experts // ep)) if experts else (f"{layer}", None)
            specs += [
                ParameterSpec(f"{name}.fc1", (HFTensorLayout(f"{name}.gate", (ffn, hidden)),
                                              HFTensorLayout(f"{name}.up", (ffn, hidden))), stage, vp, 0,
                              FusedKind.GATE_UP, expert_owner=owner),
                ParameterSpec(f"{name}.fc2", (HFTensorLayout(f"{name}.down", (hidden, ffn)),), stage, vp, 1,
                              expert_owner=owner),
            ]
    specs += [ParameterSpec("final_norm", (HFTensorLayout("final_norm", (hidden,)),), pp - 1, vpp - 1, None),
              ParameterSpec("lm_head", (HFTensorLayout("lm_head", (vocab, hidden), padded_vocab),), pp - 1, vpp - 1, 0)]
    return specs


# (pp, tp, dp, vpp, tp_gen): the brief's layouts plus tg > tp, cp-free corner cases.
LAYOUTS = [
    (2, 2, 1, 1, 1), (2, 2, 2, 1, 2), (1, 4, 2, 1, 2), (2, 1, 2, 2, 1), (1, 2, 2, 1, 2), (1, 4, 1, 1, 4),
    (2, 1, 1, 1, 2), (4, 2, 1, 1, 4), (4, 1, 1, 2, 2), (2, 4, 1, 1, 1), (1, 1, 4, 1, 1), (2, 4, 1, 1, 8),
]


def hybrid(pp, tp, dp, vpp, tg, cp=1, ep=1, etp=None) -> HybridLayout:
    training = TrainingLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                              virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, context_parallel_size=cp,
                              expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    return HybridLayout(training, GenerationLayout(tg))


# ---------------------------------------------------------------------------- layouts


def test_rank_order_is_megatrons():
    from megatron.core.parallel_state import RankGenerator

    training = TrainingLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=2,
                              context_parallel_size=2)
    generator = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    for token, field in (("tp", "tensor"), ("cp", "context"), ("dp", "data"), ("pp", "pipeline")):
        for group in generator.get_ranks(token):
            coordinates = [training.coordinates(rank) for rank in group]
            assert [getattr(c, field) for c in coordinates] == list(range(len(group)))
            # every other coordinate is constant inside megatron's group
            others = [f for f in ("tensor", "context", "data", "pipeline") if f != field]
            assert len({tuple(getattr(c, f) for f in others) for c in coordinates}) == 1
    assert all(training.rank(c.tensor, c.context, c.data, c.pipeline) == r
               for r, c in ((r, training.coordinates(r)) for r in range(training.world_size)))


@pytest.mark.parametrize("dp, cp, etp", [(4, 1, 2), (2, 2, 2), (2, 1, 1), (1, 2, 1)])
def test_expert_rank_order_is_megatrons(dp, cp, etp):
    from megatron.core.parallel_state import RankGenerator

    training = TrainingLayout(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, data_parallel_size=dp,
                              context_parallel_size=cp, expert_model_parallel_size=2, expert_tensor_parallel_size=etp)
    # megatron's expert layout: expert-data-parallel = world / (expert TP x EP x PP), no CP
    generator = RankGenerator(tp=etp, ep=2, dp=2 * dp * cp // (2 * etp), pp=2, cp=1, order="tp-ep-dp-pp")
    for token, field in (("tp", "expert_tensor"), ("ep", "expert"), ("dp", "expert_data")):
        for group in generator.get_ranks(token):
            assert [getattr(training.coordinates(rank), field) for rank in group] == list(range(len(group)))
    for rank in range(training.world_size):
        c = training.coordinates(rank)
        peers = [training.expert_peer(rank, e) for e in range(2)]
        assert peers[c.expert] == rank and all(training.coordinates(p).expert == e for e, p in enumerate(peers))


@pytest.mark.parametrize("pp, tp, dp, vpp, tg", LAYOUTS)
def test_generation_shards_overlap_training_shards(pp, tp, dp, vpp, tg):
    layout = hybrid(pp, tp, dp, vpp, tg)
    groups = layout.generation_tensor_groups()
    assert len(groups) == layout.num_replicas == pp * tp * dp // tg
    assert sorted(r for g in groups for r in g) == list(range(layout.world_size))
    for rank in range(layout.world_size):
        t, g = layout.training.coordinates(rank), layout.generation_coordinates(rank)
        # the generation slice (1/tg) and the training slice (1/tp) of a split tensor nest
        gen = (g.tensor / tg, (g.tensor + 1) / tg)
        train = (t.tensor / tp, (t.tensor + 1) / tp)
        assert (gen[0] <= train[0] and train[1] <= gen[1]) or (train[0] <= gen[0] and gen[1] <= train[1])
        assert g.data == t.data
    for members in layout.micro_data_parallel_groups():
        micro = {layout.generation_coordinates(r).micro_data_parallel for r in members}
        assert micro == set(range(layout.replicas_per_data_parallel_rank))


@pytest.mark.parametrize("pp, tp, tg, words", [
    (2, 2, 3, ["rollout.tensor_model_parallel_size=3", "4 ranks", "pipeline_model_parallel_size=2"]),
    (3, 2, 3, ["rollout.tensor_model_parallel_size=3", "tensor_model_parallel_size=2", "divide one another"]),
    (1, 2, 4, ["rollout.tensor_model_parallel_size=4", "2 ranks of one training model replica"]),
])
def test_impossible_generation_layouts_name_the_numbers(pp, tp, tg, words):
    with pytest.raises(LayoutError) as error:
        hybrid(pp, tp, 1, 1, tg)
    for word in words:
        assert word in str(error.value)


def test_plan_rejects_shards_that_cut_a_query_group():
    with pytest.raises(ValueError, match=r"0\.q: 2 query groups along dim 0 cannot be split into 4 equal slices"):
        ReshardPlan(hybrid(2, 2, 1, 1, 4), tiny_specs(2, 2, groups=2), ReshardTarget.SHARDED)


# ---------------------------------------------------------------------------- plan, simulated


def element_mask(tensor, span, dim) -> torch.Tensor:
    """Boolean mask over the padded tensor of the rows of ``span`` along ``dim``."""
    length = tensor.padded_length if (dim is not None and tensor.padded_length) else (tensor.shape[dim] if dim is not None else 1)
    mask = torch.zeros(length, dtype=torch.bool)
    mask[span.start:span.stop] = True
    return mask


def simulate(plan: ReshardPlan) -> dict[int, int]:
    """Replay the plan on masks; return received real elements per rank (and check everything)."""
    world = plan.layout.world_size
    received = {rank: 0 for rank in range(world)}
    for tensor in plan.tensors:
        dim = tensor.dim
        real = torch.zeros_like(element_mask(tensor.layout, chunk_range(tensor.layout, dim, 0, 1), dim))
        real[: tensor.real_length] = True
        rows = tensor.row_elements()
        steps = {rank: plan.steps(rank)[tensor.index] for rank in range(world)}
        have = {}
        for rank, s in steps.items():
            hold = plan.hold(tensor, rank)
            have[rank] = element_mask(tensor.layout, hold, dim) if hold else torch.zeros_like(real)
            assert (s.held is None) == (hold is None)
        held = {rank: mask.clone() for rank, mask in have.items()}
        moved = {rank: torch.zeros_like(real, dtype=torch.long) for rank in range(world)}

        def deliver(source, destination, span):
            piece = element_mask(tensor.layout, span, dim)
            assert bool((have[source] | ~piece).all()), f"{tensor.name}: rank {source} sends rows it lacks"
            have[destination] = have[destination] | piece
            moved[destination] += piece.long()

        for rank, s in steps.items():  # the expert phase
            if s.expert_receive is not None:
                deliver(s.expert_receive[0], rank, s.expert_receive[1])
                assert (rank, s.expert_receive[1]) in steps[s.expert_receive[0]].expert_sends
            assert all(steps[peer].expert_receive == (rank, span) for peer, span in s.expert_sends)
            for source, span in s.direct_receives:  # experts at expert TP < TP: straight from the owners
                deliver(source, rank, span)
                assert (rank, span) in steps[source].direct_sends
            assert all((rank, span) in steps[peer].direct_receives for peer, span in s.direct_sends)

        for rank, s in steps.items():  # phase 1
            if s.broadcast is not None and s.broadcast[0] != rank:
                deliver(s.broadcast[0], rank, s.broadcast[1])
            if s.receive is not None:
                deliver(s.receive[0], rank, s.receive[1])
                assert (rank, s.receive[1]) in steps[s.receive[0]].sends
        before_gather = {rank: mask.clone() for rank, mask in have.items()}
        for rank, s in steps.items():  # phase 2: every member contributes its training slice
            if s.gather:
                coords = plan.layout.training.coordinates(rank)
                first = coords.tensor - s.gather_position
                for position, span in enumerate(s.gather):
                    if position == s.gather_position:
                        continue
                    member = plan.layout.training.rank(first + position, coords.context, coords.data, coords.pipeline)
                    piece = element_mask(tensor.layout, span, dim)
                    assert bool((before_gather[member] | ~piece).all())
                    have[rank] = have[rank] | piece
                    moved[rank] += piece.long()
        for rank, s in steps.items():
            need = element_mask(tensor.layout, plan.need(tensor, rank), dim)
            assert bool((have[rank] | ~need).all()), f"{tensor.name}: rank {rank} misses rows it needs"
            assert int(moved[rank].max()) <= 1, f"{tensor.name}: rank {rank} got a row twice"
            assert not bool((moved[rank].bool() & held[rank]).any()), f"{tensor.name}: rank {rank} got rows it held"
            # real rows the rank needed and did not hold: exactly the ones it received
            missing = need & ~held[rank] & real
            assert torch.equal(moved[rank].bool() & real, missing)
            received[rank] += int((moved[rank].bool() & real).sum()) * rows
    return received


@pytest.mark.parametrize("pp, tp, dp, vpp, tg", LAYOUTS)
@pytest.mark.parametrize("target", list(ReshardTarget))
def test_plan_moves_exactly_the_missing_slices(pp, tp, dp, vpp, tg, target):
    # Unpadded model (groups and vocab divisible): bytes equal the lower bound exactly.
    specs = tiny_specs(pp, tp, vpp, groups=8, layers=max(4, pp * vpp))
    plan = ReshardPlan(hybrid(pp, tp, dp, vpp, tg), specs, target, torch.float32)
    received = simulate(plan)
    for rank in range(plan.layout.world_size):
        traffic = plan.traffic(rank)
        assert traffic.received == traffic.lower_bound == received[rank] * 4
    report = plan.report()
    assert report["received_over_lower_bound"] == 1.0
    model = plan.model_bytes()
    if target is ReshardTarget.FULL:
        assert all(plan.traffic(r).output == model for r in range(plan.layout.world_size))


# (pp, tp, dp, vpp, tp_gen) with context parallelism 2: CP ranks hold the same weights (megatron
# replicates the model over CP as over DP).
CONTEXT_PARALLEL_LAYOUTS = [(1, 2, 1, 1, 2), (2, 2, 1, 1, 1), (1, 2, 2, 1, 1), (2, 1, 1, 1, 2), (1, 1, 2, 1, 1),
                            (2, 2, 1, 2, 4)]


@pytest.mark.parametrize("pp, tp, dp, vpp, tg", CONTEXT_PARALLEL_LAYOUTS)
@pytest.mark.parametrize("target", list(ReshardTarget))
def test_context_parallel_ranks_receive_each_missing_slice_once(pp, tp, dp, vpp, tg, target):
    """At CP2 every rank receives exactly its lower bound, no row twice (the replay checks it), and the
    ranks receive what the same world at CP1 (twice the data-parallel ranks) receives: CP adds no bytes."""
    specs = tiny_specs(pp, tp, vpp, groups=8, layers=max(4, pp * vpp))
    plan = ReshardPlan(hybrid(pp, tp, dp, vpp, tg, cp=2), specs, target, torch.float32)
    received = simulate(plan)
    for rank in range(plan.layout.world_size):
        assert plan.traffic(rank).received == plan.traffic(rank).lower_bound == received[rank] * 4
    without_cp = ReshardPlan(hybrid(pp, tp, 2 * dp, vpp, tg), specs, target, torch.float32)
    world = plan.layout.world_size
    assert sorted(plan.traffic(r).received for r in range(world)) == \
        sorted(without_cp.traffic(r).received for r in range(world))


@pytest.mark.parametrize("pp, tp, dp, vpp, tg", LAYOUTS)
def test_a_generation_padding_of_its_own_moves_exactly_the_missing_real_rows(pp, tp, dp, vpp, tg):
    # 60 vocab rows: Megatron pads them to a multiple of 8 x TP (64); the engine pads to a multiple
    # of tg (60 where tg divides 60; SGLang pads to 64, x tg where needed), so its generation
    # slices straddle the training slices and the vocab tensors move directly, real rows only.
    import dataclasses

    specs = tiny_specs(pp, tp, vpp, groups=8, layers=max(4, pp * vpp), vocab=60)
    engine_rows = math.ceil(60 / tg) * tg
    specs = [dataclasses.replace(spec, hf_tensors=tuple(dataclasses.replace(t, generation_padded_length=engine_rows)
                                                        for t in spec.hf_tensors))
             if spec.megatron_name in ("embedding", "lm_head") else spec for spec in specs]
    plan = ReshardPlan(hybrid(pp, tp, dp, vpp, tg), specs, ReshardTarget.SHARDED, torch.float32)
    vocab = [t for t in plan.tensors if t.name in ("embed", "lm_head")]
    assert len(vocab) == 2 and all(plan.direct(t) == plan.generation_padding_differs(t) for t in vocab)
    assert all(plan.direct(t) for t in vocab) == (60 % tg == 0)
    received = simulate(plan)
    for rank in range(plan.layout.world_size):
        traffic = plan.traffic(rank)
        assert traffic.lower_bound == received[rank] * 4
        if 60 % tg == 0:  # (else the pipeline phase moves Megatron's padding rows too, as before)
            assert traffic.received == traffic.lower_bound
        g = plan.layout.generation_coordinates(rank).tensor
        for tensor in vocab:  # the engine's rows of generation rank g, real ones only
            per_rank = engine_rows // tg
            assert tensor.real(plan.need(tensor, rank)) == SliceRange(g * per_rank, min(60, (g + 1) * per_rank))


# (pp, tp, dp, tg, ep): experts split over 2, 4 or 8 expert ranks, with TP, PP and data parallelism
# beside them (expert-data-parallel replicas), generation TP up to the training TP.
EXPERT_LAYOUTS = [(1, 1, 2, 1, 2), (1, 2, 2, 2, 2), (2, 2, 2, 1, 2), (1, 1, 4, 1, 2), (2, 1, 4, 1, 4),
                  (1, 1, 8, 1, 8), (2, 2, 2, 2, 2), (2, 1, 2, 2, 2), (2, 2, 2, 4, 2)]


@pytest.mark.parametrize("pp, tp, dp, tg, ep", EXPERT_LAYOUTS)
@pytest.mark.parametrize("target", list(ReshardTarget))
def test_experts_split_over_expert_ranks_move_exactly_the_missing_slices(pp, tp, dp, tg, ep, target):
    specs = tiny_specs(pp, tp, groups=8, layers=max(4, pp), experts=8, ep=ep)
    plan = ReshardPlan(hybrid(pp, tp, dp, 1, tg, ep=ep), specs, target, torch.float32)
    received = simulate(plan)
    for rank in range(plan.layout.world_size):
        traffic = plan.traffic(rank)
        assert traffic.received == traffic.lower_bound == received[rank] * 4
        if target is not ReshardTarget.STAGE:  # each rank receives its stage's experts it lacks
            assert traffic.by_phase["expert"] > 0
    if target is ReshardTarget.FULL:
        assert all(plan.traffic(r).output == plan.model_bytes() for r in range(plan.layout.world_size))


# (pp, tp, dp, tg, ep, etp): experts split over fewer TP ranks than the dense weights (1: whole), so
# expert parallelism can use the TP ranks too; generation TP below, at and above the training TP.
EXPERT_TENSOR_LAYOUTS = [(1, 2, 1, 1, 2, 1), (1, 2, 1, 2, 2, 1), (1, 4, 1, 2, 2, 2), (1, 4, 2, 4, 4, 1),
                         (2, 2, 2, 1, 2, 1), (2, 2, 1, 4, 2, 1), (1, 4, 1, 1, 4, 1), (1, 2, 2, 2, 4, 1)]


@pytest.mark.parametrize("pp, tp, dp, tg, ep, etp", EXPERT_TENSOR_LAYOUTS)
@pytest.mark.parametrize("target", list(ReshardTarget))
def test_experts_at_expert_tensor_parallelism_move_exactly_the_missing_slices(pp, tp, dp, tg, ep, etp, target):
    specs = tiny_specs(pp, tp, groups=8, layers=max(4, pp), experts=8, ep=ep)
    plan = ReshardPlan(hybrid(pp, tp, dp, 1, tg, ep=ep, etp=etp), specs, target, torch.float32)
    received = simulate(plan)
    for rank in range(plan.layout.world_size):
        traffic = plan.traffic(rank)
        assert traffic.received == traffic.lower_bound == received[rank] * 4
        # every rank holds a slice of its own experts (gate, up, down of 8 / ep per layer of its stage)
        held = [s for s in plan.steps(rank) if s.tensor.expert_owner is not None and s.held is not None]
        assert len(held) == 3 * 8 // ep * max(4, pp) // pp
    if target is ReshardTarget.FULL:
        assert all(plan.traffic(r).output == plan.model_bytes() for r in range(plan.layout.world_size))


def test_expert_tensor_parallelism_larger_than_tp_is_refused():
    with pytest.raises(LayoutError, match="expert_tensor_parallel_size=4 must divide tensor_model_parallel_size=2"):
        hybrid(1, 2, 2, 1, 1, ep=1, etp=4)
    with pytest.raises(LayoutError, match=r"expert_tensor_parallel_size \(1\) x expert_model_parallel_size \(4\) "
                                          "must divide the 2 ranks"):
        hybrid(1, 2, 1, 1, 1, ep=4, etp=1)


@pytest.mark.parametrize("pp, tp, dp, vpp, tg", [(1, 4, 1, 1, 2), (2, 2, 1, 1, 1), (2, 1, 1, 1, 2)])
def test_padded_model_moves_padding_but_never_misses_rows(pp, tp, dp, vpp, tg):
    plan = ReshardPlan(hybrid(pp, tp, dp, vpp, tg), tiny_specs(pp, tp, vpp, groups=2, vocab=60),
                       ReshardTarget.FULL, torch.float32)
    simulate(plan)
    for rank in range(plan.layout.world_size):
        traffic = plan.traffic(rank)
        assert traffic.lower_bound <= traffic.received


def test_hybridflow_formula_matches_the_exact_bound_for_equal_stages():
    # Only TP-split layer weights (no embedding / head, no replicated norms): every stage holds
    # the same bytes and tg <= tp, the formula's assumptions.
    specs = [s for s in tiny_specs(2, 4, groups=8)
             if s.megatron_name[0].isdigit() and s.tensor_parallel_dim is not None]
    plan = ReshardPlan(hybrid(2, 4, 1, 1, 2), specs, ReshardTarget.SHARDED, torch.bfloat16)
    for rank in range(plan.layout.world_size):
        traffic = plan.traffic(rank)
        m = plan.model_bytes()
        assert traffic.lower_bound == pytest.approx(traffic.hybridflow_bound) == (2 * 4 - 2) / (2 * 4 * 2) * m


def test_buckets_are_consecutive_and_respect_the_budget():
    plan = ReshardPlan(hybrid(2, 2, 1, 1, 1), tiny_specs(2, 2, groups=8), ReshardTarget.FULL, torch.float32)
    budget = 3000
    buckets = plan.buckets(budget)
    assert list(itertools.chain(*buckets)) == list(range(len(plan.tensors)))
    for bucket in buckets:
        costs = [max(plan.staging_bytes(plan.steps(r)[i]) for r in plan.template_ranks()) for i in bucket]
        assert len(bucket) == 1 or sum(costs) <= budget


# ---------------------------------------------------------------------------- specs


def test_shard_chunks_match_the_models_mapping():
    """hf_chunks_of_shard undoes engine.models' shard_from_hf slice by slice (padding included)."""
    from engine.models.hf_config import architecture_from_hf
    from engine.models.weight_mapping import reader_from_state_dict, shard_from_hf, weight_mappings
    from engine.sync.specs import parameter_specs
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    architecture = architecture_from_hf(config, make_vocab_size_divisible_by=8)
    for tp in (1, 2, 4):
        training = TrainingLayout(tensor_model_parallel_size=tp)
        entries = {e.megatron_name: e for e in weight_mappings(architecture)}
        torch.manual_seed(tp)
        full = {name: torch.randn(shape) for e in entries.values() for name, shape in zip(e.hf_names, e.hf_shapes)}
        read = reader_from_state_dict(full)
        for spec in parameter_specs(architecture, training, transformer_engine=False):
            entry = entries[spec.megatron_name]
            for tp_rank in range(tp):
                shard = shard_from_hf(entry, architecture, read, tp_rank, tp)
                for hf, chunk in zip(spec.hf_tensors, hf_chunks_of_shard(spec, shard)):
                    dim = spec.tensor_parallel_dim
                    if dim is None:
                        assert torch.equal(chunk, full[hf.name])
                        continue
                    span = chunk_range(hf, dim, tp_rank, tp)
                    real = min(span.stop, hf.shape[dim]) - span.start
                    assert chunk.shape[dim] == span.length
                    if real > 0:
                        assert torch.equal(chunk.narrow(dim, 0, real), full[hf.name].narrow(dim, span.start, real))
                    assert not chunk.narrow(dim, max(real, 0), span.length - max(real, 0)).any()  # padding is zero


def test_owner_stages_follow_megatrons_interleaved_layer_split():
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    from megatron.core.transformer import TransformerConfig
    from engine.sync.specs import owner_of
    from engine.models.hf_config import architecture_from_hf
    from transformers import LlamaConfig

    architecture = architecture_from_hf(LlamaConfig(num_hidden_layers=8, hidden_size=16, intermediate_size=32,
                                                    num_attention_heads=2, vocab_size=64))
    training = TrainingLayout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    config = TransformerConfig(num_layers=8, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=2,
                               virtual_pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    for stage in range(2):
        for vp in range(2):
            offset = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=stage)
            for layer in range(offset, offset + 2):
                assert owner_of(f"decoder.layers.{layer}.mlp.linear_fc1.weight", architecture, training) == (stage, vp)


# ---------------------------------------------------------------------------- data flow, fingerprints


def test_replica_slices_partition_the_batch_in_order():
    for items, parts in itertools.product(range(0, 12), range(1, 6)):
        slices = [replica_slice(items, parts, p) for p in range(parts)]
        flat = [i for s in slices for i in range(items)[s]]
        assert flat == list(range(items))
        assert max(len(range(items)[s]) for s in slices) - min(len(range(items)[s]) for s in slices) <= 1


def test_split_gives_every_tp_rank_of_a_replica_the_same_prompts():
    layout = hybrid(2, 2, 2, 1, 2)
    prompts = list(range(7))
    by_replica = {}
    for rank in range(layout.world_size):
        g = layout.generation_coordinates(rank)
        by_replica.setdefault((g.data, g.micro_data_parallel), set()).add(tuple(split_for_generation(prompts, layout, rank)))
    assert all(len(parts) == 1 for parts in by_replica.values())
    for dp in range(2):
        joined = [p for micro in range(layout.replicas_per_data_parallel_rank) for p in next(iter(by_replica[(dp, micro)]))]
        assert joined == prompts


def reference_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """The same five numbers from an explicit float64 index formula (single pass, no blocks)."""
    x = tensor.double().reshape(tensor.shape[0], -1)
    rows = torch.arange(x.shape[0], dtype=torch.float64).unsqueeze(1)
    cols = torch.arange(x.shape[1], dtype=torch.float64).unsqueeze(0)
    return torch.stack([x.sum(), x.abs().sum(), (x ** 2).sum(), ((1 + rows % 1009) * x).sum(), ((1 + cols % 1013) * x).sum()])


def test_fingerprints_add_up_over_slices_and_catch_permutations():
    torch.manual_seed(0)
    tensor = torch.randn(2100, 40)
    whole = tensor_fingerprint(tensor)
    assert torch.allclose(whole, reference_fingerprint(tensor), rtol=1e-12, atol=1e-9)
    by_rows = sum(tensor_fingerprint(part, dim=0, start=start)
                  for start, part in zip((0, 700, 1400), tensor.split(700, dim=0)))
    by_cols = sum(tensor_fingerprint(part.contiguous(), dim=1, start=start)
                  for start, part in zip((0, 10, 20, 30), tensor.split(10, dim=1)))
    check_fingerprints({"w": whole}, {"w": by_rows})
    check_fingerprints({"w": whole}, {"w": by_cols})
    swapped_rows = torch.cat([tensor[700:1400], tensor[:700], tensor[1400:]])
    swapped_cols = torch.cat([tensor[:, 10:20], tensor[:, :10], tensor[:, 20:]], dim=1)
    bf16 = tensor.to(torch.bfloat16).float()
    for name, other in (("rows", swapped_rows), ("cols", swapped_cols), ("bf16", bf16)):
        problems = compare_fingerprints({name: whole}, {name: tensor_fingerprint(other)})
        assert problems and problems[0].startswith(name), name
    assert compare_fingerprints({"w": whole, "gone": whole}, {"w": whole}) == ["gone: missing on the engine side"]
    # rounding to the transfer dtype happens before the sums
    assert torch.equal(tensor_fingerprint(tensor, dtype=torch.bfloat16), tensor_fingerprint(bf16))


@pytest.mark.parametrize("pp, tp, dp", [(2, 2, 2), (4, 1, 2), (1, 4, 1)])
def test_stage_target_keeps_every_tensor_on_its_own_stage(pp, tp, dp):
    """Disaggregated servers: each stage's data-parallel rank 0 assembles exactly its stage's tensors."""
    plan = ReshardPlan(hybrid(pp, tp, dp, 1, 1), tiny_specs(pp, tp, groups=8, layers=max(4, pp)),
                       ReshardTarget.STAGE, torch.float32)
    simulate(plan)
    training = plan.layout.training
    for rank in range(plan.layout.world_size):
        c, traffic = training.coordinates(rank), plan.traffic(rank)
        stage_bytes = sum(math.prod(t.layout.shape) * 4 for t in plan.tensors if t.pipeline_rank == c.pipeline)
        assert traffic.by_phase["pipeline"] == 0
        assert traffic.output == (stage_bytes if c.data == 0 else 0)
    assert sum(plan.traffic(training.rank(0, 0, 0, stage)).output for stage in range(pp)) == plan.model_bytes()
