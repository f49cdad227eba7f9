"""Training layouts: how the world is split by tensor, pipeline, context and data parallelism."""

from __future__ import annotations

from dataclasses import dataclass, fields


# megatron's cp_comm_type values: how context-parallel ranks exchange keys and values.
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
# The ones parallel.context_parallel's stand-in for Transformer Engine's kernels runs.
STAND_IN_COMM_TYPES = ("all_gather", "a2a")
# The ones that take packed (THD) rows: TE 2.11's all-gather CP attention asserts qkv_format != "thd"
# (AttnFuncWithCPAndKVAllGather.forward, attention/dot_product_attention/context_parallel.py:2842),
# as its hierarchical a2a+p2p does (attn_forward_func_with_cp, :3990-3992); the stand-in refuses the same.
PACKED_ROW_COMM_TYPES = ("p2p", "a2a")


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the sizes in conflict."""


@dataclass
class ParallelLayout:
    """Megatron model parallelism of one model (actor, critic, reference or reward model), as megatron's
    ``ModelParallelConfig`` holds it: the ``*.megatron`` config sections are this class plus their
    precision (``engine.config.model``), and the HybridEngine's training layout is this plus the
    data-parallel size (``parallel.hybrid_engine.TrainingLayout``).

    The data-parallel size is derived: world_size / (tensor * pipeline * context).

    Attributes:
        tensor_model_parallel_size: ranks that split each layer's matrices.
        pipeline_model_parallel_size: pipeline stages (consecutive blocks of layers).
        virtual_pipeline_model_parallel_size: model chunks per pipeline stage (interleaved
            schedule); null = not interleaved.
        context_parallel_size: ranks that split each sequence (megatron's context parallelism: each
            rank holds 2 of 2 x CP load-balanced chunks of every row, or of every packed sequence).
            Sequences (packed: each sequence) are padded to a multiple of 2 x CP (x TP with sequence
            parallelism).
        cp_comm_type: how CP ranks exchange keys and values in attention (megatron's ``cp_comm_type``):
            "p2p" (ring), "all_gather", "a2a" (DeepSpeed-Ulysses: all-to-all over heads; the heads and
            key/value heads of a TP rank must divide by CP) or "a2a+p2p" (a2a inside groups of up to
            8 ranks, p2p between them). Without Transformer Engine (CPU) only "all_gather" and "a2a"
            run (``parallel.context_parallel``). Packed rows (``use_remove_padding``) only under "p2p"
            and "a2a": TE's "all_gather" and "a2a+p2p" refuse them.
        expert_model_parallel_size: ranks that split the experts of MoE layers (Qwen3-MoE,
            Mixtral) over the ranks of a pipeline stage; > 1 needs an MoE model (checked at start-up).
        expert_tensor_parallel_size: ranks that split each expert's matrices; null = the TP size
            (megatron's default). Must divide tensor_model_parallel_size; 1 keeps experts whole, so
            expert parallelism can use the TP ranks too (expert TP x EP must divide TP x DP).
        sequence_parallel: split the activations outside the tensor-parallel regions along the
            sequence; only takes effect when tensor_model_parallel_size > 1 (with one TP rank there
            is nothing to split), as in Megatron-LM.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    sequence_parallel: bool = True

    def as_layout(self) -> "ParallelLayout":
        """The layout alone, of a config section or training layout that extends it (to compare two
        models' layouts, or to extend it once more)."""
        return ParallelLayout(**{field.name: getattr(self, field.name) for field in fields(ParallelLayout)})

    @property
    def uses_sequence_parallel(self) -> bool:
        """Sequence parallelism in effect: asked for, and more than one TP rank to split over."""
        return self.sequence_parallel and self.tensor_model_parallel_size > 1

    @property
    def expert_tensor_size(self) -> int:
        """The expert tensor-parallel size in effect (megatron's default: the TP size)."""
        if self.expert_tensor_parallel_size is None:
            return self.tensor_model_parallel_size
        return self.expert_tensor_parallel_size

    @property
    def hierarchical_context_parallel_sizes(self) -> list[int] | None:
        """megatron's CP sub-groups for ``a2a+p2p``: a2a inside groups of the largest divisor of CP up
        to 8 (one node's GPUs), p2p between the groups; None for the other comm types."""
        if self.cp_comm_type != "a2a+p2p" or self.context_parallel_size == 1:
            return None
        cp = self.context_parallel_size
        inner = max(size for size in range(1, min(cp, 8) + 1) if cp % size == 0)
        return [inner, cp // inner]

    def describe(self, data_parallel_size: int | None = None) -> str:
        """``tp2,pp2,vpp2,dp2,sp``-style summary for messages (the data-parallel size where given)."""
        parts = [f"tp{self.tensor_model_parallel_size}", f"pp{self.pipeline_model_parallel_size}"]
        if self.virtual_pipeline_model_parallel_size:
            parts.append(f"vpp{self.virtual_pipeline_model_parallel_size}")
        if self.context_parallel_size > 1:
            parts.append(f"cp{self.context_parallel_size}({self.cp_comm_type})")
        if self.expert_model_parallel_size > 1:
            parts.append(f"ep{self.expert_model_parallel_size}")
        if self.expert_tensor_size != self.tensor_model_parallel_size:
            parts.append(f"etp{self.expert_tensor_size}")
        if data_parallel_size is not None:
            parts.append(f"dp{data_parallel_size}")
        return ",".join(parts) + (",sp" if self.uses_sequence_parallel else "")

    @property
    def model_parallel_size(self) -> int:
        """Ranks that together hold one full copy of the model (tp * pp * cp)."""
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )

    def layer_owner(self, layer: int, num_layers: int) -> tuple[int, int]:
        """(pipeline rank, virtual pipeline chunk) holding transformer layer ``layer`` of ``num_layers``
        in megatron's interleaved assignment: chunk c of L / (pp * vpp) consecutive layers sits on
        stage c % pp as its chunk c // pp."""
        pp = self.pipeline_model_parallel_size
        chunk = layer // (num_layers // (pp * (self.virtual_pipeline_model_parallel_size or 1)))
        return chunk % pp, chunk // pp

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size for ``world_size`` ranks; raises LayoutError if it does not divide."""
        self.validate(world_size)
        return world_size // self.model_parallel_size

    def validate(self, world_size: int) -> None:
        sizes = {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_size,
        }
        for name, size in sizes.items():
            if size < 1:
                raise LayoutError(f"{name} must be >= 1, got {size}")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            if vpp < 1:
                raise LayoutError(f"virtual_pipeline_model_parallel_size must be >= 1, got {vpp}")
            if vpp > 1 and self.pipeline_model_parallel_size == 1:
                raise LayoutError(
                    "virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size > 1 "
                    f"(got vpp={vpp}, pp=1)"
                )
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise LayoutError(f"cp_comm_type={self.cp_comm_type!r}: one of {', '.join(CP_COMM_TYPES)}")
        if world_size % self.model_parallel_size:
            raise LayoutError(
                f"world size {world_size} is not divisible by tensor ({self.tensor_model_parallel_size})"
                f" x pipeline ({self.pipeline_model_parallel_size}) x context "
                f"({self.context_parallel_size}) = {self.model_parallel_size}; choose sizes whose "
                f"product divides {world_size}"
            )
        tp, etp, ep = self.tensor_model_parallel_size, self.expert_tensor_size, self.expert_model_parallel_size
        if tp % etp:
            # The HybridEngine and the planner place an expert's slices inside the TP group.
            raise LayoutError(f"expert_tensor_parallel_size={etp} must divide tensor_model_parallel_size={tp} "
                              "(expert TP larger than TP is not built)")
        # megatron lays the experts out over one stage's ranks as "etp-ep-edp": tp * cp * dp ranks.
        stage_ranks = world_size // self.pipeline_model_parallel_size
        if stage_ranks % (etp * ep):
            raise LayoutError(
                f"expert_tensor_parallel_size ({etp}) x expert_model_parallel_size ({ep}) must divide the "
                f"{stage_ranks} ranks of a pipeline stage (tensor x context x data parallel)"
            )
