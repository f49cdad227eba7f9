"""Worker: the PPO loop (``run_ppo``) with schema-default precision (bf16), its rollout engine watched.

Every call the loop makes on the real embedded engine is recorded in order, together with the
engine's resident weight bytes whenever a training phase starts; rank 0 writes the log and the
run directory as JSON to ``argv[1]``. Each rank also writes its memory events
(``engine.rollout.memory``) to ``memory_rank_<r>.log`` and the object collectives and barriers the
loop's own code made (caller, whether on a control-plane group, its backend) to
``collectives_rank_<r>.json`` beside it. Arguments after it are config overrides of yaml/demo_cpu.yaml.
"""

import datetime
import inspect
import json
import logging
import os
import sys
from pathlib import Path

CONTROL_PLANE_CALLS = ("barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


def record_collectives(collectives: list) -> None:
    """Wrap torch.distributed's barrier and object collectives: who called (Trident's own modules
    only; megatron-core's are its own business) and on which group."""
    import torch.distributed as dist

    from parallel.state import is_control_group

    for name in CONTROL_PLANE_CALLS:
        original = getattr(dist, name)

        def recorded(*args, _original=original, _name=name, **kwargs):
            caller = inspect.currentframe().f_back.f_globals.get("__name__", "")
            if caller.startswith(("engine.", "parallel.", "launch.")):
                group = kwargs.get("group")
                collectives.append({"call": _name, "caller": caller, "control": group is not None and is_control_group(group),
                                    "backend": str(dist.get_backend(group)) if group is not None else None})
            return _original(*args, **kwargs)

        setattr(dist, name, recorded)


def main() -> None:
    out_file, *overrides = sys.argv[1:]
    import engine.trainer.ppo_trainer as trainer
    from engine.config import load_config
    from parallel.state import control_plane_timeout, destroy_model_parallel, initialize_model_parallel

    cfg = load_config("yaml/demo_cpu.yaml", overrides, int(os.environ["WORLD_SIZE"]))
    megatron = cfg.actor_rollout_ref.actor.megatron
    rank = int(os.environ["RANK"])
    memory_log = logging.FileHandler(Path(out_file).parent / f"memory_rank_{rank}.log")
    logging.getLogger("trident.memory").addHandler(memory_log)
    logging.getLogger("trident.memory").setLevel(logging.INFO)
    collectives: list = []
    record_collectives(collectives)
    initialize_model_parallel(megatron, seed=megatron.seed, timeout_minutes=cfg.trainer.collective_timeout_minutes)
    assert control_plane_timeout() == datetime.timedelta(minutes=cfg.trainer.collective_timeout_minutes)
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
        watched["engine"] = parts.rollout.engine
        watch(parts.rollout.engine, ["generate", "release_memory", "resume_memory", "begin_weight_update", "push_weights",
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
    memory_log.close()
    (Path(out_file).parent / f"collectives_rank_{rank}.json").write_text(json.dumps(collectives))
    if rank == 0:
        with open(out_file, "w") as handle:
            json.dump({"calls": calls, "run_dir": cfg.trainer.default_local_dir}, handle)


if __name__ == "__main__":
    main()
