"""Actor -> rollout weight sync: the HybridEngine plan for the actor's model, streamed into an engine.

    sync = WeightSynchronizer(actor_chunks, parallel_layout, cfg.actor_rollout_ref.rollout)   # plan once
    report = sync.sync(engine)   # every step, on every rank (collective); engine None off-leader

Which ranks push: with the embedded engine or SGLang servers each generation replica has one
engine handle, on its generation TP rank 0 (``sync.is_replica_leader``); the other ranks take part
in the collectives and drop what they receive, except for a colocated SGLang server of generation
TP > 1: there every generation rank serializes the bucket it received itself (a CUDA IPC handle
into its own GPU) and the leader sends the handles in TP order, so that no SGLang TP worker reads
another GPU's memory (SGLang's own ``srt/weight_sync/utils.py`` does the same). ``ReshardTarget.FULL`` (the default) delivers full
HF tensors to every generation rank, which is what SGLang's own loader and the embedded HF engine
take; ``SHARDED`` delivers exactly each rank's generation shard. Into SGLang (colocated) each rank
then hands its shards to its own TP worker, which copies them into place
(``engine.rollout.sglang_presharded``): the bytes lower bound, and zero bytes across GPUs when
training and generation TP agree. Where that loader does not cover the model the synchronizer
falls back to FULL and says why (``fallback_reason``). ``iter_weight_shards`` gives the shards to
other consumers; ``sync`` refuses SHARDED for engines that only take full tensors.
``STAGE`` (disaggregated servers outside the training world): TP rank 0 of each pipeline stage's
data-parallel rank 0 pushes its stage's full tensors (``sync.pushes_weights``), each over its own
weight-update group, inside the one session that global rank 0 (the servers' owner) opens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from engine.config.actor_rollout_ref import RolloutConfig
from engine.models.checkpoint import export_peft_state_dict
from engine.models.lora import has_lora, merged_weights
from engine.rollout.base import RolloutEngine, SamplingParams
from engine.rollout.memory import hand_back_bucket, record
from engine.rollout.sglang_presharded import vocab_rows as sglang_vocab_rows
from engine.sync.specs import local_parameters, parameter_specs, unwrap
from parallel.hybrid_engine import (
    GenerationLayout,
    HybridLayout,
    ReshardExecutor,
    ReshardPlan,
    ReshardStats,
    ReshardTarget,
    TrainingLayout,
    WeightShard,
    WeightSyncError,
    build_groups,
    check_fingerprints,
    fingerprints_of,
)
from parallel.layout import ParallelLayout
from parallel.state import control_group, device



@dataclasses.dataclass
class WeightSyncReport:
    """One sync on this rank: measured traffic and time, and the plan's prediction."""

    stats: ReshardStats
    predicted_received_bytes: int
    lower_bound_bytes: int
    push_seconds: float
    check_seconds: float = 0.0
    checked_by_fingerprint: bool = False


class WeightSynchronizer:
    """Plans the actor's training -> generation reshard once and runs it per sync."""

    def __init__(self, model_chunks: Sequence[torch.nn.Module], layout: ParallelLayout, rollout: RolloutConfig, *,
                 target: str = "full", overlap: bool = True) -> None:
        """``rollout``: ``actor_rollout_ref.rollout`` (generation TP, dtype, bucket size, the check);
        ``target``: a ``ReshardTarget`` value; ``overlap``: communicate the next bucket while the
        current one is pushed."""
        from megatron.core import parallel_state

        self.rollout = rollout
        self.overlap = overlap
        self.model_chunks = list(model_chunks)
        architecture = unwrap(self.model_chunks[0]).hf_architecture
        self.disaggregated = ReshardTarget(target) is ReshardTarget.STAGE
        self.layout = self.hybrid_layout(layout, rollout, target)
        tg = self.layout.generation.tensor_model_parallel_size
        # Why a sharded push into SGLang fell back to full tensors (None: it did not).
        self.fallback_reason = None
        if ReshardTarget(target) is ReshardTarget.SHARDED and rollout.name == "sglang":
            self.fallback_reason = presharded_refusal(architecture, layout.tensor_model_parallel_size, tg)
            target = "full" if self.fallback_reason else target
        # Shards into SGLang's TP workers, placed there by the presharded loader.
        self.pushes_shards = ReshardTarget(target) is ReshardTarget.SHARDED and rollout.name == "sglang"
        # LoRA with rollout.lora_sync=adapters: each sync pushes the adapters only (``_push_adapters``).
        self.adapters_only = rollout.lora_sync == "adapters" and has_lora([unwrap(c) for c in self.model_chunks])
        # Whether ``sync`` checks the engine by fingerprints (rollout.check_weight_sync into the
        # embedded engine, whole weights); otherwise the trainer compares the rollout's log-probs.
        self.checks_by_fingerprint = rollout.check_weight_sync and rollout.name == "torch" and not self.adapters_only
        training = self.layout.training
        self.rank = dist.get_rank()
        coordinates = training.coordinates(self.rank)
        stage = coordinates.pipeline
        if (stage, coordinates.expert, coordinates.expert_tensor) != (
                parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_rank()):
            raise ValueError("megatron's parallel state does not match the layout's rank order")
        self.specs = parameter_specs(architecture, training, generation_vocab_rows=(
            sglang_vocab_rows(architecture.vocab_size, tg) if self.pushes_shards else None))
        self.dtype = getattr(torch, rollout.dtype)
        self.plan = ReshardPlan(self.layout, self.specs, ReshardTarget(target), self.dtype)
        self.groups = build_groups(self.layout, self.plan.tensor_gather_size)
        self._parameters = local_parameters(self.model_chunks, self.specs, stage, coordinates.expert)
        # LoRA: the engine serves W + scaling B A, merged one weight at a time as its bucket goes.
        self._merged = merged_weights([unwrap(chunk) for chunk in self.model_chunks])
        self.executor = ReshardExecutor(self.plan, self.groups, self._local_shard, device=device())
        self.is_replica_leader = self.layout.generation_coordinates(self.rank).tensor == 0
        self.serializes_per_rank = (rollout.name == "sglang" and not self.disaggregated
                                    and (tg > 1 or self.pushes_shards))
        # The ranks that hand weights to an engine (the others only take part in the collectives).
        self.pushes_weights = (self.plan.sends_stage(stage, self.rank) and coordinates.tensor == 0
                               if self.disaggregated else self.is_replica_leader)
        self.traffic = self.plan.traffic(self.rank)

    @staticmethod
    def hybrid_layout(layout: ParallelLayout, rollout: RolloutConfig, target: str = "full") -> HybridLayout:
        """The layouts this synchroniser plans between, known before any model exists: which rank
        leads which generation replica, on which GPUs its engine runs."""
        training = TrainingLayout.from_parallel_layout(layout, dist.get_world_size())
        # Servers outside the world keep their own TP: no generation ranks to lay out here.
        disaggregated = ReshardTarget(target) is ReshardTarget.STAGE
        return HybridLayout(training, GenerationLayout(1 if disaggregated else rollout.tensor_model_parallel_size))

    def _local_shard(self, spec) -> torch.Tensor:
        merge = self._merged.get(spec.megatron_name)
        return merge() if merge is not None else self._parameters[spec.megatron_name]

    def iter_weight_shards(self, fingerprints: bool = False) -> Iterator[list[WeightShard]]:
        """This rank's received tensors, bucket by bucket (collective: iterate on every rank)."""
        with torch.no_grad():
            yield from self.executor.iter_buckets(
                self.rollout.update_weights_bucket_megabytes, overlap=self.overlap, fingerprints=fingerprints
            )

    def sync(self, engine: RolloutEngine | None) -> WeightSyncReport:
        """Reshard and push every bucket into ``engine`` (None: take part only). Collective.

        With ``check_weight_sync`` the engine's tensors are compared with fingerprints of the
        training shards afterwards (``WeightSyncError`` names the tensors that differ). Engines
        that cannot show their tensors (servers) are left to ``check_rollout_log_probs`` on the
        next rollout; ``report.checked_by_fingerprint`` says which happened.
        """
        if self.adapters_only:
            return self._push_adapters(engine)
        if engine is not None and self.plan.target is ReshardTarget.SHARDED and not self.pushes_shards:
            raise ValueError("this rollout engine takes full HF tensors; use target 'full' or iter_weight_shards()")
        push_seconds = 0.0
        if engine is not None:
            engine.begin_weight_update()
        if self.disaggregated:
            dist.barrier(group=control_group())  # rank 0 has opened the servers' session before any stage pushes
        buckets = 0
        try:
            for bucket in self.iter_weight_shards(fingerprints=self.rollout.check_weight_sync):
                if self.serializes_per_rank:
                    push_seconds += self._push_serialized_by_every_rank(engine, bucket)
                elif engine is not None:
                    start = time.perf_counter()
                    engine.push_weights([(shard.name, shard.tensor) for shard in bucket])
                    push_seconds += time.perf_counter() - start
                del bucket
                hand_back_bucket()
                buckets += 1
            if self.disaggregated:
                dist.barrier(group=control_group())  # every stage has pushed before rank 0 closes the session
        finally:
            if engine is not None:
                engine.end_weight_update()
        record("push", buckets=buckets, pushed=engine is not None, cache_handed_back_after_each=True)
        report = WeightSyncReport(self.executor.stats, self.traffic.received, self.traffic.lower_bound, push_seconds)
        if self.rollout.check_weight_sync and engine is not None and hasattr(engine, "served_weight"):
            start = time.perf_counter()
            check_engine_weights(engine, self.executor.expected_fingerprints)
            report.check_seconds = time.perf_counter() - start
            report.checked_by_fingerprint = True
        return report

    def _push_adapters(self, engine: RolloutEngine | None) -> WeightSyncReport:
        """The LoRA adapters, gathered whole on each replica leader only (PEFT's names and layout, in
        the rollout dtype; in buckets of ``update_weights_bucket_megabytes``), into its engine.
        Collective. The bytes reported are the adapters' (what a sync moves); the base weights never
        move."""
        start = time.perf_counter()
        settings = unwrap(self.model_chunks[0]).lora_settings
        leaders: list = [None] * dist.get_world_size()
        dist.all_gather_object(leaders, engine is not None, group=control_group())
        with torch.no_grad():
            tensors = {name: tensor.to(self.dtype) for name, tensor in export_peft_state_dict(
                self.model_chunks, destinations=[rank for rank, leads in enumerate(leaders) if leads],
                bucket_bytes=int(self.rollout.update_weights_bucket_megabytes * 2**20)).items()}
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        push_seconds = 0.0
        if engine is not None:
            pushed = time.perf_counter()
            engine.push_adapters(tensors, settings.peft_config())
            push_seconds = time.perf_counter() - pushed
        record("push", adapters=len(tensors), pushed=engine is not None)
        stats = ReshardStats(num_tensors=len(tensors), num_buckets=1, bytes_received=size, bytes_output=size,
                             seconds=time.perf_counter() - start)
        return WeightSyncReport(stats, size, size, push_seconds)

    def _push_serialized_by_every_rank(self, engine: RolloutEngine | None, bucket: list[WeightShard]) -> float:
        """Every generation rank of the replica serializes the bucket it holds; the leader (holding
        ``engine``) sends the payloads in TP order; every rank keeps its buffer until the server has
        loaded it, then learns from the leader whether it did. Collective over the replica (its gloo
        control group). Returns the leader's push time."""
        from engine.rollout.sglang_engine import serialize_weights

        named = [(shard.name, shard.tensor) for shard in bucket]
        payload, flat = serialize_weights(named, presharded=self.pushes_shards)
        group = self.groups.generation_tensor_control
        members = dist.get_process_group_ranks(group)
        leader = next(rank for rank in members if self.layout.generation_coordinates(rank).tensor == 0)
        gathered = [None] * len(members) if self.rank == leader else None
        dist.gather_object(payload, gathered, dst=leader, group=group)
        seconds, outcome = 0.0, [None]
        if engine is not None:
            by_tensor_rank = {self.layout.generation_coordinates(rank).tensor: item for rank, item in zip(members, gathered)}
            start = time.perf_counter()
            try:
                engine.push_serialized_weights([(shard.name, shard.full_shape) for shard in bucket],
                                               [by_tensor_rank[g] for g in range(len(members))],
                                               presharded=self.pushes_shards)
            except Exception as error:  # the other ranks wait for the outcome: tell them, then raise
                outcome = [f"{type(error).__name__}: {error}"]
                dist.broadcast_object_list(outcome, src=leader, group=group)
                raise
            seconds = time.perf_counter() - start
        dist.broadcast_object_list(outcome, src=leader, group=group)
        del flat  # the server has loaded it (or will not)
        if outcome[0] is not None:
            raise WeightSyncError(f"the generation replica's leader (rank {leader}) failed to push a bucket: {outcome[0]}")
        return seconds


def presharded_refusal(architecture, training_tp: int, generation_tp: int) -> str | None:
    """Why SGLang's TP workers cannot take this model's shards as the HybridEngine cuts them
    (None: they can). SGLang gives each TP rank num_kv_heads / TP key/value heads, or copies one
    head to several ranks when TP exceeds them; Megatron's slices are whole query groups."""
    a = architecture
    if a.num_query_groups % generation_tp or a.num_attention_heads % generation_tp:
        return (f"the model's {a.num_query_groups} key/value heads (of {a.num_attention_heads} query heads) do not "
                f"split over rollout.tensor_model_parallel_size={generation_tp} (SGLang replicates them)")
    if a.padded_num_query_groups(training_tp) != a.num_query_groups:
        return (f"Megatron pads the {a.num_query_groups} query groups to {a.padded_num_query_groups(training_tp)} "
                f"at tensor_model_parallel_size={training_tp}")
    for what, size in (("MLP", a.ffn_hidden_size), ("expert MLP", a.moe.ffn_hidden_size if a.moe else 0)):
        if size % generation_tp:
            return f"the {what}'s {size} rows do not split over rollout.tensor_model_parallel_size={generation_tp}"
    return None


def engine_weights(engine: RolloutEngine, names: Iterable[str]) -> dict[str, torch.Tensor] | None:
    """The tensors an in-process engine serves under these HF checkpoint names, or None when it
    cannot show them (servers). The embedded engine resolves each name to its transformers model's
    tensor, or the slice of a fused MoE expert tensor (``served_weight``)."""
    served_weight = getattr(engine, "served_weight", None)
    if served_weight is None:
        return None
    return {name: served_weight(name) for name in names}


def check_engine_weights(engine: RolloutEngine, expected: dict[str, torch.Tensor]) -> None:
    """Compare the trainer's fingerprints with the engine's tensors; raise ``WeightSyncError``."""
    weights = engine_weights(engine, expected)
    if weights is None:
        raise WeightSyncError(
            f"{type(engine).__name__} cannot report its weights; check it with check_by_log_probs() instead"
        )
    missing = [name for name, tensor in weights.items() if tensor is None]
    if missing:
        raise WeightSyncError(f"the engine serves no tensor named {missing[0]!r} ({len(missing)} missing)")
    actual = fingerprints_of(weights)
    check_fingerprints(expected, actual)


def check_by_log_probs(
    engine: RolloutEngine,
    prompt_token_ids: Sequence[Sequence[int]],
    reference_log_probs: Callable[[list[int], list[int]], torch.Tensor],
    max_new_tokens: int = 8,
    atol: float = 1e-3,
) -> float:
    """Greedy-generate a probe batch and compare the engine's log-probs with the trainer's.

    ``reference_log_probs(prompt, response)`` returns the trainer's log-prob of each response token
    (teacher-forced). Returns the largest absolute difference; raises ``WeightSyncError`` above
    ``atol`` naming the probe prompts that differ.
    """
    samples = engine.generate(prompt_token_ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0))
    worst, bad = 0.0, []
    for index, (prompt, (sample,)) in enumerate(zip(prompt_token_ids, samples)):
        reference = reference_log_probs(list(prompt), sample.token_ids).double().cpu()
        engine_side = torch.tensor(sample.log_probs, dtype=torch.float64)
        difference = float((reference - engine_side).abs().max()) if len(engine_side) else 0.0
        worst = max(worst, difference)
        if difference > atol:
            bad.append(f"probe {index}: max |log-prob difference| {difference:.3g}")
    if bad:
        raise WeightSyncError(f"rollout log-probs differ from the trainer's (atol {atol}): " + "; ".join(bad))
    return worst


# The mean |rollout - trainer| log-prob per response token that matching weights stay under, by the
# coarser of the two precisions. Measured on the demo model (embedded engine and SGLang on CPU):
# fp32 ~1e-6, fp16 ~1e-3, bf16 ~7e-3; each bound is ~4x the measurement (fp32: round-off of other
# kernels and TP reductions). Wrong or missing weights give differences of order 1.
EXPECTED_LOG_PROB_GAP = {"float32": 1e-3, "float16": 0.0075, "bfloat16": 0.03}


def expected_log_prob_gap(*dtypes: str) -> float:
    """The log-prob gap to expect between engines running at ``dtypes`` (the coarsest one counts)."""
    return max(EXPECTED_LOG_PROB_GAP[dtype] for dtype in dtypes)


def check_rollout_log_probs(rollout_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor,
                            response_mask: torch.Tensor, tolerance: float) -> float:
    """The sync check for engines that cannot show their tensors: the rollout's own log-probs of
    the sampled tokens vs the trainer's recomputation (``old_log_prob``) of the same batch.

    Returns the mean absolute difference per response token; raises ``WeightSyncError`` above
    ``tolerance``. Matching weights differ only by numerics (~1e-6 in fp32, ~1e-2 in bf16); a
    missed or misplaced tensor changes the distribution and gives differences of order 1.
    """
    mask = response_mask.to(torch.float64)
    difference = ((rollout_log_probs.double() - trainer_log_probs.double()).abs() * mask).sum() / mask.sum().clamp(min=1)
    difference = float(difference)
    if difference > tolerance:
        worst = int(((rollout_log_probs - trainer_log_probs).abs() * response_mask).amax(dim=1).argmax())
        raise WeightSyncError(
            f"the rollout engine's log-probs differ from the trainer's by {difference:.3g} per token on average "
            f"(rollout.check_weight_sync_tolerance={tolerance}; worst sequence: {worst}): the engine does not "
            "serve the actor's weights")
    return difference
