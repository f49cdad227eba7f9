"""Training and generation layouts of the 3D-HybridEngine, their rank maps and process groups.

Training layout (megatron-core): ranks are numbered with tensor parallelism fastest, then context,
data and pipeline parallelism (megatron's ``RankGenerator`` order "tp-cp-ep-dp-pp" with ep = 1):

    rank = tp + T * (cp + C * (dp + D * pp))

Generation layout (HybridFlow, arXiv 2409.19256, section 5): the rollout engine runs with tensor
parallelism tg = ``rollout.tensor_model_parallel_size`` and no pipeline parallelism. Every
training model-parallel group (the P x T ranks that share one (dp, cp) coordinate) is cut into
dg = P * T / tg *micro data-parallel* generation replicas. A generation TP group is formed at a
stride, so that the slice of every weight a rank needs for generation overlaps the slice it
already holds for training:

- tg <= T (s = T / tg): inside one pipeline stage, the ranks {j, j + s, j + 2s, ...} form one
  replica and training TP rank t becomes generation TP rank g = t // s. Generation shard g is the
  union of training shards g*s .. g*s + s - 1, which contains the rank's own training shard.
- tg > T (k = tg / T): the replica takes the T ranks of k pipeline stages at stride P / k; the rank
  of stage i (q = i // (P / k)) and training TP rank t becomes generation TP rank g = t * k + q, so
  its generation shard is the q-th sub-slice of its training shard.

Context-parallel ranks hold the same weights as each other, so for generation they are further
replicas: a training data-parallel rank (C model-parallel groups) serves C * P * T / tg replicas.

Expert parallelism (E ranks) splits the experts of MoE layers, and expert tensor parallelism (Te
ranks, a divisor of T; megatron's default Te = T) each expert's matrices, over the ranks of a
pipeline stage: megatron's expert layout "tp-ep-dp-pp" with tp = Te gives the rank with
r = tp + T * (cp + C * dp) inside its stage the expert TP rank r % Te, the expert-parallel rank
(r // Te) % E and the expert-data-parallel rank r // (Te E). Every generation replica serves all
experts, so the reshard moves each stage's experts to every rank that lacks them first (the
expert phase, see ``plan``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from parallel.layout import LayoutError, ParallelLayout


@dataclass(frozen=True)
class TrainingCoordinates:
    """Where a rank sits in the training layout."""

    tensor: int
    context: int
    data: int
    pipeline: int
    expert: int = 0  # expert-parallel rank: which experts of the MoE layers it holds
    expert_data: int = 0  # expert-data-parallel rank
    expert_tensor: int = 0  # expert tensor-parallel rank: which slice of those experts' matrices


@dataclass(frozen=True)
class GenerationCoordinates:
    """Where a rank sits in the generation layout."""

    # Index of the rank's generation replica in the whole world (0 .. world / tg - 1).
    replica: int
    # Generation tensor-parallel rank inside the replica (0 .. tg - 1).
    tensor: int
    # Index of the replica among those serving the same training data-parallel rank.
    micro_data_parallel: int
    # The training data-parallel rank whose batch the replica generates.
    data: int


@dataclass(frozen=True)
class ReplicaPlacement:
    """The GPUs one generation replica (one SGLang server) runs on.

    Attributes:
        replica: the replica's index (``GenerationCoordinates.replica``).
        node: the node all its ranks are on (rank // ranks_per_node, torchrun's numbering).
        local_devices: the node-local GPU index of each of its ranks, in generation TP order: the
            GPUs those ranks train on, so each GPU holds the engine's shard beside its own.
    """

    replica: int
    node: int
    local_devices: tuple[int, ...]


@dataclass
class TrainingLayout(ParallelLayout):
    """Megatron's training layout: a model's :class:`ParallelLayout` and its data-parallel size
    (world size / model-parallel size), which fixes every rank's coordinates."""

    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size",
                     "context_parallel_size", "expert_model_parallel_size", "expert_tensor_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"TrainingLayout.{name} must be an integer >= 1, got {value!r}")
        self.validate(self.world_size)  # vpp needs pp > 1, ...: ParallelLayout's checks

    @classmethod
    def from_parallel_layout(cls, layout: ParallelLayout, world_size: int) -> "TrainingLayout":
        """The training layout of ``layout`` (or of a config section, which is one) on ``world_size``
        ranks (data parallelism derived)."""
        return cls(**vars(layout.as_layout()), data_parallel_size=layout.data_parallel_size(world_size))

    @property
    def world_size(self) -> int:
        return (self.tensor_model_parallel_size * self.context_parallel_size * self.data_parallel_size
                * self.pipeline_model_parallel_size)

    @property
    def virtual_pipeline_stages(self) -> int:
        return self.virtual_pipeline_model_parallel_size or 1

    def coordinates(self, rank: int) -> TrainingCoordinates:
        """(tp, cp, dp, pp) of ``rank``: megatron's order, tensor parallelism fastest."""
        self._check_rank(rank)
        tp, rest = rank % self.tensor_model_parallel_size, rank // self.tensor_model_parallel_size
        cp, rest = rest % self.context_parallel_size, rest // self.context_parallel_size
        dp, pp = rest % self.data_parallel_size, rest // self.data_parallel_size
        in_stage = rank % (self.world_size // self.pipeline_model_parallel_size)
        etp, ep = self.expert_tensor_size, self.expert_model_parallel_size
        return TrainingCoordinates(tensor=tp, context=cp, data=dp, pipeline=pp, expert=in_stage // etp % ep,
                                   expert_data=in_stage // (etp * ep), expert_tensor=in_stage % etp)

    def rank(self, tensor: int, context: int, data: int, pipeline: int) -> int:
        """The global rank at training coordinates (inverse of ``coordinates``)."""
        return tensor + self.tensor_model_parallel_size * (
            context + self.context_parallel_size * (data + self.data_parallel_size * pipeline)
        )

    def expert_rank(self, expert_tensor: int, expert: int, expert_data: int, pipeline: int) -> int:
        """The global rank at expert coordinates (megatron's "tp-ep-dp-pp" with tp = expert TP)."""
        etp, ep = self.expert_tensor_size, self.expert_model_parallel_size
        stage_ranks = self.world_size // self.pipeline_model_parallel_size
        return expert_tensor + etp * (expert + ep * expert_data) + stage_ranks * pipeline

    def expert_peer(self, rank: int, expert: int) -> int:
        """The rank with ``rank``'s expert TP, pipeline and expert-data coordinates on expert rank ``expert``."""
        c = self.coordinates(rank)
        return self.expert_rank(c.expert_tensor, expert, c.expert_data, c.pipeline)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the training world of {self.world_size} ranks")


@dataclass(frozen=True)
class GenerationLayout:
    """The rollout engine's parallelism (``rollout.tensor_model_parallel_size``)."""

    tensor_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        value = self.tensor_model_parallel_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"rollout.tensor_model_parallel_size must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class HybridLayout:
    """A training layout and the generation layout it switches to, with every rank map."""

    training: TrainingLayout
    generation: GenerationLayout

    def __post_init__(self) -> None:
        tp = self.training.tensor_model_parallel_size
        pp = self.training.pipeline_model_parallel_size
        tg = self.generation.tensor_model_parallel_size
        if (pp * tp) % tg:
            raise LayoutError(
                f"rollout.tensor_model_parallel_size={tg} must divide the {pp * tp} ranks of one training "
                f"model replica (pipeline_model_parallel_size={pp} x tensor_model_parallel_size={tp})"
            )
        if tp % tg and tg % tp:
            raise LayoutError(
                f"rollout.tensor_model_parallel_size={tg} and tensor_model_parallel_size={tp} must divide "
                f"one another, so every generation shard lies inside or around one training shard"
            )

    @property
    def world_size(self) -> int:
        return self.training.world_size

    @property
    def replicas_per_model_parallel_group(self) -> int:
        """dg = P * T / tg: generation replicas cut out of one training model-parallel group."""
        t = self.training
        return t.pipeline_model_parallel_size * t.tensor_model_parallel_size // self.generation.tensor_model_parallel_size

    @property
    def replicas_per_data_parallel_rank(self) -> int:
        """Generation replicas that share one training data-parallel rank's batch (micro-DP size)."""
        return self.training.context_parallel_size * self.replicas_per_model_parallel_group

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.generation.tensor_model_parallel_size

    def generation_coordinates(self, rank: int) -> GenerationCoordinates:
        """Replica, generation TP rank and micro-DP rank of ``rank`` (see the module docstring)."""
        return self._generation_coordinates[rank]

    @cached_property
    def _generation_coordinates(self) -> tuple[GenerationCoordinates, ...]:
        t = self.training
        tp, pp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size
        tg = self.generation.tensor_model_parallel_size
        result = []
        for rank in range(self.world_size):
            c = t.coordinates(rank)
            if tg <= tp:
                stride = tp // tg
                tensor, local_replica = c.tensor // stride, c.pipeline * stride + c.tensor % stride
            else:
                stage_stride = pp // (tg // tp)
                tensor = c.tensor * (tg // tp) + c.pipeline // stage_stride
                local_replica = c.pipeline % stage_stride
            micro = c.context * self.replicas_per_model_parallel_group + local_replica
            replica = c.data * self.replicas_per_data_parallel_rank + micro
            result.append(GenerationCoordinates(replica=replica, tensor=tensor, micro_data_parallel=micro, data=c.data))
        return tuple(result)

    # ------------------------------------------------------------------ rank groups (global ranks)

    def generation_tensor_groups(self) -> list[list[int]]:
        """One list per generation replica: its ranks ordered by generation TP rank."""
        groups = [[-1] * self.generation.tensor_model_parallel_size for _ in range(self.num_replicas)]
        for rank, g in enumerate(self._generation_coordinates):
            groups[g.replica][g.tensor] = rank
        return groups

    def replica_placements(self, ranks_per_node: int) -> list[ReplicaPlacement]:
        """Where every generation replica runs when each node holds ``ranks_per_node`` consecutive
        ranks, one GPU each (``LOCAL_RANK`` = GPU index). A replica's GPUs are exactly those of its
        ranks, which follow the strided generation groups (consecutive only when tg = T), so no two
        replicas share a GPU. A replica whose ranks sit on different nodes cannot be one server.
        """
        if ranks_per_node < 1 or self.world_size % ranks_per_node:
            raise LayoutError(f"{ranks_per_node} ranks per node do not divide the world of {self.world_size} ranks")
        placements = []
        for replica, ranks in enumerate(self.generation_tensor_groups()):
            nodes = sorted({rank // ranks_per_node for rank in ranks})
            if len(nodes) > 1:
                raise LayoutError(
                    f"generation replica {replica} of {self.describe()} would span nodes {nodes} (ranks {ranks}, "
                    f"{ranks_per_node} per node): an SGLang server runs on one node. Use a generation TP size "
                    f"that keeps a replica inside a node (tg <= tensor_model_parallel_size, or a pipeline "
                    f"layout whose combined stages share a node)"
                )
            placements.append(ReplicaPlacement(replica, nodes[0], tuple(rank % ranks_per_node for rank in ranks)))
        return placements

    def micro_data_parallel_groups(self) -> list[list[int]]:
        """One list per training data-parallel rank: all its ranks (every pp, tp, cp), in rank order.

        Prompts of that DP rank are split over its generation replicas and responses gathered back
        inside this group.
        """
        groups: list[list[int]] = [[] for _ in range(self.training.data_parallel_size)]
        for rank in range(self.world_size):
            groups[self.training.coordinates(rank).data].append(rank)
        return groups

    def pipeline_groups(self) -> list[list[int]]:
        """Megatron's pipeline groups: same (tp, cp, dp), ordered by stage."""
        t = self.training
        return [
            [t.rank(tp, cp, dp, pp) for pp in range(t.pipeline_model_parallel_size)]
            for dp in range(t.data_parallel_size)
            for cp in range(t.context_parallel_size)
            for tp in range(t.tensor_model_parallel_size)
        ]

    def tensor_gather_groups(self, gather_size: int) -> list[list[int]]:
        """Consecutive training TP ranks in blocks of ``gather_size`` (the whole TP group when = T).

        The reshard all-gathers training shards inside these blocks: generation shard g of
        tg <= T is the union of the training shards of block g (size T / tg).
        """
        t = self.training
        if t.tensor_model_parallel_size % gather_size:
            raise LayoutError(f"gather block {gather_size} does not divide tensor_model_parallel_size")
        return [
            [t.rank(first + i, cp, dp, pp) for i in range(gather_size)]
            for pp in range(t.pipeline_model_parallel_size)
            for dp in range(t.data_parallel_size)
            for cp in range(t.context_parallel_size)
            for first in range(0, t.tensor_model_parallel_size, gather_size)
        ]

    def describe(self) -> str:
        t = self.training
        vpp = f",vpp{t.virtual_pipeline_model_parallel_size}" if t.virtual_pipeline_model_parallel_size else ""
        cp = f",cp{t.context_parallel_size}" if t.context_parallel_size > 1 else ""
        ep = f",ep{t.expert_model_parallel_size}" if t.expert_model_parallel_size > 1 else ""
        etp = f",etp{t.expert_tensor_size}" if t.expert_tensor_size != t.tensor_model_parallel_size else ""
        return (f"pp{t.pipeline_model_parallel_size},tp{t.tensor_model_parallel_size},dp{t.data_parallel_size}"
                f"{vpp}{cp}{ep}{etp}->tp_gen{self.generation.tensor_model_parallel_size}")


def lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


@dataclass
class HybridEngineGroups:
    """This rank's torch.distributed groups for resharding and generation-side data flow.

    Built by ``build_groups``: a partition of the world that megatron already has a group for
    (pipeline, tensor parallel: the usual case for ``pipeline`` and often for ``tensor_gather``)
    reuses megatron's group, so no second NCCL communicator is made for the same ranks; the others
    are new groups, created on every rank in the same order. The ``*_control`` groups hold the same
    ranks on gloo (``parallel.state.control_groups``): the generation results gathered while replica
    leaders wait on their engines, and the per-rank weight payloads a replica leader collects.
    """

    layout: HybridLayout
    rank: int
    pipeline: object  # ProcessGroup of this rank's pipeline group
    pipeline_ranks: list[int]
    tensor_gather: object  # ProcessGroup of this rank's TP gather block
    tensor_gather_ranks: list[int]
    generation_tensor: object
    generation_tensor_ranks: list[int]
    micro_data_parallel: object
    micro_data_parallel_ranks: list[int]
    micro_data_parallel_control: object
    generation_tensor_control: object


def build_groups(layout: HybridLayout, tensor_gather_size: int) -> HybridEngineGroups:
    """Create the groups for ``layout`` on every rank (collective over the default group).

    ``tensor_gather_size``: ranks per TP all-gather block, ``ReshardPlan.tensor_gather_size``.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call parallel.state.init_distributed() first")
    if dist.get_world_size() != layout.world_size:
        raise LayoutError(
            f"the layout {layout.describe()} needs {layout.world_size} ranks, the world has {dist.get_world_size()}"
        )
    from parallel.state import control_groups

    rank = dist.get_rank()
    made = {}
    for key, rank_lists in (
        ("pipeline", layout.pipeline_groups()),
        ("tensor_gather", layout.tensor_gather_groups(tensor_gather_size)),
        ("generation_tensor", layout.generation_tensor_groups()),
        ("micro_data_parallel", layout.micro_data_parallel_groups()),
    ):
        mine = next(ranks for ranks in rank_lists if rank in ranks)
        group = _megatron_group_of(mine)
        if group is None:
            group, _ = dist.new_subgroups_by_enumeration(rank_lists)
        made[key], made[key + "_ranks"] = group, mine
    made["micro_data_parallel_control"] = control_groups(layout.micro_data_parallel_groups())
    made["generation_tensor_control"] = control_groups(layout.generation_tensor_groups())
    return HybridEngineGroups(layout=layout, rank=rank, **made)


def _megatron_group_of(ranks: list[int]):
    """megatron-core's existing group holding exactly ``ranks`` (this rank's block of a partition),
    if every rank of the world finds one for its own block; None otherwise. Collective: the ranks
    agree (a gloo all-reduce of the answer) so that all of them create a new group, or none does."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from parallel.state import control_group

    found = None
    if parallel_state.model_parallel_is_initialized():
        for get in (parallel_state.get_tensor_model_parallel_group, parallel_state.get_pipeline_model_parallel_group,
                    parallel_state.get_data_parallel_group, parallel_state.get_model_parallel_group):
            group = get()
            if dist.get_process_group_ranks(group) == list(ranks):  # the same ranks in the same order
                found = group
                break
    everywhere = torch.tensor([int(found is not None)])
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=control_group())
    return found if everywhere.item() else None
