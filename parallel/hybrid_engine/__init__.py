"""The 3D-HybridEngine: reshard actor weights from the training layout to the generation layout.

- ``layouts``: training / generation layouts, HybridFlow's micro data-parallel groups, process groups;
- ``spec``: how each parameter is sharded (filled in by ``engine.sync`` from the model's mapping);
- ``plan``: which slices move where, bytes per rank against the lower bound;
- ``executor``: bucketed execution with async collectives, yielding what each generation rank gets;
- ``dataflow``: prompts split over the micro-DP replicas, results gathered back;
- ``integrity``: fingerprints of the trainer's export vs the engine's weights.
"""

from parallel.hybrid_engine.dataflow import (
    gather_generation_results,
    gather_generation_tensors,
    replica_slice,
    split_for_generation,
)
from parallel.hybrid_engine.executor import ReshardExecutor, ReshardStats, WeightShard
from parallel.hybrid_engine.integrity import (
    WeightSyncError,
    check_fingerprints,
    compare_fingerprints,
    fingerprints_of,
    tensor_fingerprint,
)
from parallel.hybrid_engine.layouts import (
    GenerationCoordinates,
    GenerationLayout,
    HybridEngineGroups,
    HybridLayout,
    ReplicaPlacement,
    TrainingCoordinates,
    TrainingLayout,
    build_groups,
)
from parallel.hybrid_engine.plan import ReshardPlan, TensorSteps
from parallel.hybrid_engine.spec import FusedKind, HFTensorLayout, ParameterSpec, ReshardTarget, hf_chunks_of_shard

__all__ = [
    "FusedKind", "GenerationCoordinates", "GenerationLayout", "HFTensorLayout", "HybridEngineGroups",
    "HybridLayout", "ParameterSpec", "ReplicaPlacement", "ReshardExecutor", "ReshardPlan", "ReshardStats", "ReshardTarget",
    "TensorSteps", "TrainingCoordinates", "TrainingLayout", "WeightShard", "WeightSyncError", "build_groups",
    "check_fingerprints", "compare_fingerprints", "fingerprints_of", "gather_generation_results",
    "gather_generation_tensors", "hf_chunks_of_shard", "replica_slice", "split_for_generation",
    "tensor_fingerprint",
]
