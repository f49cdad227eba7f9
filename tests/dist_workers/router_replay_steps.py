"""Worker: PPO steps (``ppo_iteration``) of a tiny Qwen3-MoE whose embedded rollout engine routes
some tokens to other experts than the trainer's routers would (its routers' hook swaps a token's
last expert for the next-best one, every third token, mixing with the router's own weights of the
experts it chose, as an engine with a slightly different router would). Two steps without router
replay, then two with it (``actor.megatron.moe_router_replay``, flipped on the same components);
writes every step's metrics as JSON.

    torchrun --nproc_per_node 1 tests/dist_workers/router_replay_steps.py OUT_JSON RUN_DIR MODEL_DIR
"""
from __future__ import annotations

import json
import sys

import torch


def swap_some_experts(router, args, output):
    """Every third token: the router's last chosen expert replaced by its next-best one."""
    logits, _, indices = output
    probs = torch.softmax(logits.float(), dim=-1)
    ranked = probs.topk(router.top_k + 1, dim=-1).indices
    swapped = indices.clone()
    swapped[::3, -1] = ranked[::3, -1]
    scores = probs.gather(1, swapped)
    if router.norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return logits, scores.to(logits.dtype), swapped


def main() -> None:
    out_file, run_dir, model_dir = sys.argv[1:]
    from engine.trainer.ppo_trainer import ppo_iteration
    from tests.dist_workers.registry_steps import demo_on_one_rank, serving_components

    overrides = ["trainer.n_gpus_per_node=1", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
                 f"actor_rollout_ref.model.path={model_dir}", "algorithm.use_kl_in_reward=false",
                 f"trainer.default_local_dir={run_dir}"]
    rows = []
    with demo_on_one_rank(overrides) as cfg:
        parts = serving_components(cfg, run_dir)
        for router in (m for m in parts.rollout.engine.model.modules() if type(m).__name__.endswith("TopKRouter")):
            router.register_forward_hook(swap_some_experts)
        batches = iter(parts.train_loader)
        for step in range(1, 5):
            cfg.actor_rollout_ref.actor.megatron.moe_router_replay = step > 2
            metrics = ppo_iteration(cfg, parts, next(batches), step)
            rows.append({"step": step, "replay": step > 2, **{key: metrics[key] for key in (
                "rollout/routed_experts_mismatch", "rollout/log_prob_abs_diff", "actor/pg_loss", "actor/grad_norm")}})
        parts.rollout.engine.shutdown()
    with open(out_file, "w") as handle:
        json.dump(rows, handle)

if __name__ == "__main__":
    main()
