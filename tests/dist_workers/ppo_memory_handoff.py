"""Worker: the PPO loop (``run_ppo``) with schema-default precision (bf16), its rollout engine watched.

Every call the loop makes on the real embedded engine is recorded in order, together with the
engine's resident weight bytes whenever a training phase starts; rank 0 writes the log and the
run directory as JSON to ``argv[1]``. Arguments after it are config overrides of yaml/demo_cpu.yaml.
"""

import json
import os
import sys


def main() -> None:
    out_file, *overrides = sys.argv[1:]
    import engine.trainer.ppo_trainer as trainer
    from engine.config import load_config
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    cfg = load_config("yaml/demo_cpu.yaml", overrides, int(os.environ["WORLD_SIZE"]))
    megatron = cfg.actor_rollout_ref.actor.megatron
    initialize_model_parallel(megatron.layout(), seed=megatron.seed)
    calls: list = []
    watched: dict = {}
    build = trainer.build_components

    def watch(obj, names, label):
        for name in names:
            method = getattr(obj, name)

            def recorded(*args, _method=method, _name=name, **kwargs):
                entry = [f"{label}{_name}"]
                if label == "engine." and _name in ("release_memory", "resume_memory"):
                    entry.append(sorted(args[0] if args else kwargs["tags"]))
                if label == "train.":
                    entry.append(watched["engine"].resident_weight_bytes())
                if not (calls and calls[-1][0] == entry[0] == "engine.push_weights"):  # one entry per push run
                    calls.append(entry)
                return _method(*args, **kwargs)

            setattr(obj, name, recorded)

    def instrumented(cfg, run):
        parts = build(cfg, run)
        watched["engine"] = parts.engine
        watch(parts.engine, ["generate", "release_memory", "resume_memory", "begin_weight_update", "push_weights",
                       "end_weight_update", "shutdown"], "engine.")
        watch(parts.actor, ["compute_old_log_probs", "update_policy"], "train.")
        watch(parts.reference, ["compute_ref_log_probs"], "train.")
        watch(parts.critic, ["compute_values", "update_critic"], "train.")
        return parts

    trainer.build_components = instrumented
    try:
        trainer.run_ppo(cfg)
    finally:
        destroy_model_parallel()
    if int(os.environ["RANK"]) == 0:
        with open(out_file, "w") as handle:
            json.dump({"calls": calls, "run_dir": cfg.trainer.default_local_dir}, handle)


if __name__ == "__main__":
    main()
