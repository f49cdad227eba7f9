"""Worker: one PPO step (``ppo_iteration``) per entry of every config-selectable registry kind.

Argv: an output JSON, a run directory. On the demo model, one rank, 2 samples per prompt, with the
reference (KL in the reward and as a loss) and, for GAE, the critic: the components are built once
with a critic (GAE) and once without (every other estimator), and between steps the loop's own
config fields are switched, as a user's YAML would set them. Each step's metrics are checked to be
finite; the JSON maps "kind/name" to the step's key metrics.
"""

import contextlib
import json
import math
import sys


@contextlib.contextmanager
def demo_on_one_rank(overrides: list[str]):
    """``yaml/demo_cpu.yaml`` with ``overrides`` at world size 1, its model-parallel groups up inside."""
    from engine.config import load_config
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    cfg = load_config("yaml/demo_cpu.yaml", overrides, world_size=1)
    initialize_model_parallel(cfg.actor_rollout_ref.actor.megatron, seed=cfg.trainer.seed)
    try:
        yield cfg
    finally:
        destroy_model_parallel()


def serving_components(cfg, run_dir: str):
    """The run's components, the engine serving the actor's weights (it starts released,
    ``engine/trainer/components.py``)."""
    from engine.trainer.components import build_components
    from engine.trainer.run_dir import RunDirectory

    parts = build_components(cfg, RunDirectory.create(run_dir))
    parts.rollout.wake_and_sync(1)
    return parts


def main() -> None:
    out_file, run_dir = sys.argv[1:]
    from engine.algo import registry
    from engine.algo.kl import build_kl_controller
    from engine.config import load_config
    from engine.trainer.ppo_trainer import ppo_iteration

    overrides = ["trainer.n_gpus_per_node=1", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=2",
                 "algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true",
                 f"trainer.default_local_dir={run_dir}"]
    results: dict = {}
    step = 0

    def run_step(parts, cfg, batches, label: str) -> None:
        nonlocal step
        step += 1
        metrics = ppo_iteration(cfg, parts, next(batches), step)
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "actor/ppo_kl"):
            if not math.isfinite(metrics[key]):
                raise AssertionError(f"{label}: {key} = {metrics[key]}")
        if parts.critic is not None and not math.isfinite(metrics["critic/vf_loss"]):
            raise AssertionError(f"{label}: critic/vf_loss = {metrics['critic/vf_loss']}")
        results[label] = {key: value for key, value in metrics.items() if key.startswith(("actor/", "critic/"))}

    def build(estimator: str):
        cfg = load_config("yaml/demo_cpu.yaml", [*overrides, f"algorithm.adv_estimator={estimator}"], world_size=1)
        parts = serving_components(cfg, run_dir)
        return cfg, parts, iter(parts.train_loader)

    with demo_on_one_rank(overrides):
        cfg, parts, batches = build("gae")
        run_step(parts, cfg, batches, "adv_estimator/gae")
        for name in registry.names("loss_agg_mode"):
            cfg.actor_rollout_ref.actor.loss_agg_mode = cfg.critic.loss_agg_mode = name
            run_step(parts, cfg, batches, f"loss_agg_mode/{name}")
        for name in registry.names("kl_estimator"):
            cfg.algorithm.kl_penalty = cfg.actor_rollout_ref.actor.kl_loss_type = name
            run_step(parts, cfg, batches, f"kl_estimator/{name}")
        for name in registry.names("kl_controller"):
            cfg.algorithm.kl_ctrl.type = name
            parts.kl_controller = build_kl_controller(cfg.algorithm.kl_ctrl)
            run_step(parts, cfg, batches, f"kl_controller/{name}")
        for name in registry.names("policy_loss"):
            cfg.actor_rollout_ref.actor.policy_loss.loss_mode = name
            run_step(parts, cfg, batches, f"policy_loss/{name}")
        parts.rollout.engine.shutdown()

        cfg, parts, batches = build("grpo")  # no critic from here on
        for name in registry.names("adv_estimator"):
            if name != "gae":
                cfg.algorithm.adv_estimator = name
                run_step(parts, cfg, batches, f"adv_estimator/{name}")
        parts.rollout.engine.shutdown()
    with open(out_file, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main()
