"""Worker: parameter / gradient / optimizer offload (parallel.offload) on 2 ranks, bf16 + distributed
optimizer (the production defaults), tiny HF Llama.

Two actors from the same checkpoint, one offloading all three parts between its phases, one not,
run the same two PPO updates. Rank 0 writes to --out: the bytes each part held on the device before
it was offloaded and after (the storages themselves, resized to 0), whether every value came back
bit for bit (weights and Adam state, against the twin that never offloaded; gradients come back
zeroed), and both actors' update metrics.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from tests.dist_workers.roles_parity import TEMPERATURE, configs, make_batch, use_layout


def live_bytes(offloader, part: str) -> int:
    """Bytes the part's storages hold right now (0 once offloaded)."""
    return sum(storage.nbytes() for storage in offloader.parts[part].collect())


def state_of(actor) -> list[torch.Tensor]:
    """Weights and Adam state (moments, fp32 main weights) of an actor, in a fixed order (clones)."""
    tensors = [p.detach().clone() for chunk in actor.ddp_chunks for p in chunk.parameters()]
    for part in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = part.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                tensors.append(param.detach().clone())
                tensors += [value.clone() for value in inner.state.get(param, {}).values() if torch.is_tensor(value)]
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from megatron.core import parallel_state

    from engine.models.checkpoint import load_hf_weights
    from engine.models.gpt import build_model_chunks
    from engine.roles import MegatronActor
    from parallel.offload import PARTS
    from parallel.state import destroy_model_parallel

    spec = dict(tp=1, pp=1, vpp=None, sp=False, packing=True, dynamic=False)
    layout = use_layout(spec)
    actors = {}
    for name, offload in (("offloading", True), ("resident", False)):
        actor_config, _, log_prob_batches = configs(spec, parallel_state.get_data_parallel_world_size())
        actor_config.megatron = replace(actor_config.megatron, param_dtype="bfloat16", param_offload=offload,
                                        grad_offload=offload, optimizer_offload=offload)
        chunks = build_model_chunks(args.hf_dir, layout, params_dtype=torch.bfloat16)
        load_hf_weights(chunks, args.hf_dir)
        actors[name] = MegatronActor(chunks, actor_config, log_prob_batches=log_prob_batches, samples_per_prompt=1,
                                     total_optimizer_steps=4, seed=3, use_remove_padding=True)
    offloader = actors["offloading"].offloader
    batch = make_batch(actors["resident"].model_chunks[0].hf_architecture.vocab_size, 0)
    out: dict = {"updates": {name: [] for name in actors}, "bytes": {}}
    for update in range(2):
        for name, actor in actors.items():
            old = actor.compute_log_probs(batch, actor.log_prob_batches, TEMPERATURE)["log_probs"]
            out["updates"][name].append(actor.update_policy(replace(batch, old_log_probs=old), TEMPERATURE))
        if update == 0:  # after the first step Adam has its state: measure every part
            out["bytes"] = {part: {"offloaded": offloader.nbytes(part), "on_device": live_bytes(offloader, part)}
                            for part in PARTS}
            offloader.reload(*PARTS)
            out["resident_again"] = {part: live_bytes(offloader, part) for part in PARTS}
            mine, twin = state_of(actors["offloading"]), state_of(actors["resident"])
            out["compared_tensors"] = len(mine)
            out["bit_identical"] = len(mine) == len(twin) and all(torch.equal(a, b) for a, b in zip(mine, twin))
            # Gradients are freed, not copied: they come back zeroed (megatron zeroes them before use).
            out["grads_zero"] = all(not p.main_grad.any() for chunk in actors["offloading"].ddp_chunks
                                    for p in chunk.parameters() if getattr(p, "main_grad", None) is not None)
            offloader.offload_enabled()
    if torch.distributed.get_rank() == 0:
        args.out.write_text(json.dumps(out))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
