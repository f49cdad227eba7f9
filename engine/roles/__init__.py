"""Training roles on the Megatron 3D mesh: actor, critic and frozen reference.

Build the model chunks with ``engine.models.build_model_chunks`` (+ ``load_hf_weights``) after
``parallel.state.initialize_model_parallel(layout)``, then::

    actor = MegatronActor(chunks, ActorConfig(...), OptimConfig(...), total_training_steps)
    old = actor.compute_old_log_probs(batch)["log_probs"]          # [B, R] on every rank
    metrics = actor.update_policy(replace(batch, old_log_probs=old, advantages=adv))

Every rank passes the same global ``RolloutBatch`` and gets full-batch results back.
"""

from engine.roles.actor import ActorConfig, MegatronActor, ReferencePolicy
from engine.roles.batch import RolloutBatch
from engine.roles.critic import CriticConfig, MegatronCritic
from engine.roles.optim import OptimConfig, build_optimizer, wrap_for_training
from engine.roles.vocab_parallel import vocab_parallel_log_probs
from engine.roles.worker import MicroBatchConfig, UpdateSchedule

__all__ = [
    "ActorConfig",
    "CriticConfig",
    "MegatronActor",
    "MegatronCritic",
    "MicroBatchConfig",
    "OptimConfig",
    "ReferencePolicy",
    "RolloutBatch",
    "UpdateSchedule",
    "build_optimizer",
    "vocab_parallel_log_probs",
    "wrap_for_training",
]
