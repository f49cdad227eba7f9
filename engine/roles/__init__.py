"""Training roles on the Megatron 3D mesh: actor, critic and frozen reference.

Build the model chunks with ``engine.models.build_model_chunks`` (+ ``load_hf_weights``) after
``parallel.state.initialize_model_parallel(layout)``, then, with the experiment's own sections
(``engine.config``)::

    actor = MegatronActor(chunks, cfg.actor_rollout_ref.actor, log_prob_batches=..., samples_per_prompt=n,
                          total_optimizer_steps=steps, seed=cfg.trainer.seed)
    old = actor.compute_old_log_probs(batch, temperature)          # [B, R] on every rank
    metrics = actor.update_policy(replace(batch, old_log_probs=old, advantages=adv), temperature)

Every rank passes the same global ``RolloutBatch`` and gets full-batch results back.
"""

from engine.roles.actor import MegatronActor, ReferencePolicy
from engine.roles.batch import RolloutBatch
from engine.roles.critic import MegatronCritic
from engine.roles.optim import build_optimizer, wrap_for_training
from engine.roles.vocab_parallel import vocab_parallel_log_probs
from engine.roles.worker import MicroBatchConfig, UpdateSchedule

__all__ = [
    "MegatronActor",
    "MegatronCritic",
    "MicroBatchConfig",
    "ReferencePolicy",
    "RolloutBatch",
    "UpdateSchedule",
    "build_optimizer",
    "vocab_parallel_log_probs",
    "wrap_for_training",
]
