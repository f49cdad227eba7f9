"""Worker: the actor with LoRA adapters at several layouts of one 4-rank torchrun world.

For each ``--layouts`` entry (tp,pp,vpp,sp,packing,dynamic, as in roles_parity) the worker loads the
tiny HF Llama, computes the base model's log-probs (a plain reference policy), adds rank-4 adapters
on every linear layer with B set to the same non-zero values in every layout (B = 0 at init would
give A no gradient), and runs:

- log-probs with adapters disabled (must equal the base model's bit for bit) and enabled;
- one PPO update (2 mini-batches) -> metrics; the base weights must be bit-identical afterwards;
- the PEFT export of the updated adapters (compared across layouts by the pytest side);
- a weight sync of the merged weights into the embedded engine (generation TP 2 where the model
  replica allows; fingerprint check on): its teacher-forced log-probs must equal the trainer's,
  its tensors the HF export's (adapters merged).

``--engine sglang`` pushes the adapters only and then the merged weights into a real SGLang server
instead (and stops there).
With ``--peft-dir`` the last layout also writes its PEFT folder there and the trainer's log-probs
to ``--out-dir/trainer_log_probs.pt``, which the pytest side loads with ``peft``.
"""

from __future__ import annotations

import argparse
import json
import zlib
from dataclasses import replace
from pathlib import Path

import torch

from tests.dist_workers.roles_parity import SEED, TEMPERATURE, configs, make_batch, parse_layout, use_layout

RANK, ALPHA = 4, 8
# Adam's update g / (sqrt(v) + eps) turns fp32 round-off of an adapter gradient element near 0 into
# a change of order lr when eps is far below it: with the default 1e-8 one element of a 512 differed
# by 0.5% of its update at TP2xPP2 (4.3e-5 of the tensor's largest value; every other element within
# 1e-7; deterministic on an AVX-512 Xeon; it passed on an AMD EPYC CI machine). With 1e-6 the
# largest difference is 3.3e-6 (measured at TP2+SP and TP2xPP2), so the 1e-5 bound tests the layouts
# and not the conditioning of Adam.
ADAM_EPS = 1e-6


def set_adapter_b(chunks, architecture) -> None:
    """Every adapter's B from HF-layout tensors drawn per HF module, split like its base weight."""
    from megatron.core import parallel_state

    from engine.models.lora import adapters
    from engine.models.weight_mapping import mappings_by_megatron_name, reader_from_state_dict, shard_from_hf

    entries = mappings_by_megatron_name(architecture)
    tp_rank, tp_size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    for chunk in chunks:
        for name, adapter in adapters(chunk):
            entry = entries[name]
            full = {}
            for hf_name, shape in zip(entry.hf_names, entry.hf_shapes):
                generator = torch.Generator().manual_seed(zlib.crc32(hf_name.encode()))
                full[hf_name] = torch.randn(shape[0], RANK, generator=generator) * 0.05
            if entry.tensor_parallel_dim == 0:
                local = shard_from_hf(entry, architecture, reader_from_state_dict(full), tp_rank, tp_size)
            else:
                (local,) = full.values()
            with torch.no_grad():
                adapter.lora_B.copy_(local)


def base_parameters(chunks) -> dict[str, torch.Tensor]:
    from engine.models.lora import is_adapter_parameter

    return {name: param.detach().clone() for chunk in chunks for name, param in chunk.named_parameters()
            if not is_adapter_parameter(name)}


def engine_log_probs(model, batch) -> torch.Tensor:
    """Teacher-forced log-probs of the response tokens from an HF model, ``[B, R]`` (0 at padding)."""
    from engine.roles.worker import response_columns

    out = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for row in range(len(batch)):
            columns = batch.attention_mask[row].nonzero().flatten()
            tokens = batch.input_ids[row, columns]
            logits = model(tokens[None]).logits[0].double() / TEMPERATURE
            out[row, columns[:-1]] = torch.log_softmax(logits, -1)[:-1].gather(-1, tokens[1:, None])[:, 0]
    return response_columns(out, batch.response_length)


def sync_into_sglang(chunks, layout, hf_dir: Path, run_dir: Path) -> dict:
    """Into a real SGLang server with LoRA enabled (fp32, generation TP 2, on rank 0): first the
    adapters only (``rollout.lora_sync=adapters``: the server keeps its base weights), then the merged
    weights (which drop the adapter). After each, its greedy log-probs against transformers holding
    the merged HF export (which the embedded-engine case holds equal to the trainer); before any
    push they must differ (the base). The two pushes' greedy tokens and log-probs are compared too,
    and the adapters push's bytes with the size of the PEFT adapters."""
    from engine.config import RolloutConfig
    from engine.models.checkpoint import export_hf_state_dict
    from engine.sync import WeightSynchronizer
    from engine.sync.specs import unwrap
    from tests.dist_workers.reshard_sync import hf_reference_model
    from tests.rollout_support import start_cpu_sglang

    exported = export_hf_state_dict(chunks)
    generation_tp = 2  # the server's own TP: each rank serializes the shard it holds for its TP worker
    settings, architecture = unwrap(chunks[0]).lora_settings, unwrap(chunks[0]).hf_architecture
    adapters_sync, merged_sync = (WeightSynchronizer(chunks, layout, RolloutConfig(
        tensor_model_parallel_size=generation_tp, dtype="float32", lora_sync=mode)) for mode in ("adapters", "merged"))
    assert adapters_sync.adapters_only and not merged_sync.adapters_only
    engine, merged, out = None, None, {}
    if merged_sync.is_replica_leader:
        merged = hf_reference_model(str(hf_dir), exported, str(run_dir / "merged"))
        engine = start_cpu_sglang(hf_dir, run_dir, rollout={"weight_update_timeout_s": 120,
                                                             "tensor_model_parallel_size": generation_tp}, lora=settings)
        out["before_push"], _ = greedy_log_prob_difference(engine, merged)
    report = adapters_sync.sync(engine)
    out["adapters_push"] = {"bytes": report.stats.bytes_received, "peft_bytes": settings.peft_elements(architecture) * 4}
    if engine is not None:
        out["after_adapters_push"], adapter_samples = greedy_log_prob_difference(engine, merged)
    merged_sync.sync(engine)
    if engine is not None:
        out["after_push"], merged_samples = greedy_log_prob_difference(engine, merged)
        out["same_tokens"] = [a.token_ids for a in adapter_samples] == [m.token_ids for m in merged_samples]
        out["adapters_vs_merged"] = max(abs(a - m) for sa, sm in zip(adapter_samples, merged_samples)
                                        for a, m in zip(sa.log_probs, sm.log_probs))
        engine.shutdown()
    return out


def greedy_log_prob_difference(engine, model) -> tuple[dict, list]:
    """The engine's greedy log-probs (8 tokens each, EOS ignored) vs ``model``'s of the same tokens;
    and the engine's samples."""
    from engine.rollout.base import SamplingParams
    from tests.dist_workers.reshard_sync import hf_log_probs

    prompts = [[5, 6, 7], [11, 3, 8, 2], [40, 41]]
    samples = [sample for (sample,) in engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0,
                                                                                ignore_eos=True))]
    worst, tokens = 0.0, 0
    for prompt, sample in zip(prompts, samples):
        reference = hf_log_probs(model, prompt, sample.token_ids).double()
        worst = max(worst, float((reference - torch.tensor(sample.log_probs, dtype=torch.float64)).abs().max()))
        tokens += len(sample.token_ids)
    return {"max_abs_difference": worst, "tokens": tokens}, samples


def checkpoint_round_trip(actor, chunks, directory: Path, adapters: dict) -> dict:
    """Save (adapters + their Adam state only), scramble the adapters, load: the same adapters again."""
    from engine.models.checkpoint import export_peft_state_dict
    from engine.models.lora import adapters as adapters_of
    from engine.trainer.checkpoint import CheckpointManager, CheckpointTarget

    manager = CheckpointManager(directory)
    target = {"actor": CheckpointTarget(actor.ddp_chunks, actor.optimizer, actor.lr_scheduler)}
    saved = manager.save(1, target)
    with torch.no_grad():
        for chunk in chunks:
            for _, adapter in adapters_of(chunk):
                adapter.lora_A.mul_(-3.0)
                adapter.lora_B.add_(1.0)
    manager.load(saved, target)
    loaded = export_peft_state_dict(chunks)
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(saved / "actor")).read_metadata().state_dict_metadata
    # megatron's per-layer extra state (None for the local spec) left out
    sizes = {key: value.size.numel() for key, value in stored.items()
             if "_extra_state" not in key and hasattr(value, "size")}
    from megatron.core import parallel_state

    # the adapter elements every model-parallel rank's optimizer holds (replicated ones once per rank)
    numel = torch.tensor(float(sum(p.numel() for chunk in chunks for _, a in adapters_of(chunk) for p in (a.lora_A, a.lora_B))))
    torch.distributed.all_reduce(numel, group=parallel_state.get_model_parallel_group())
    return {"equal": all(torch.equal(loaded[k], v) for k, v in adapters.items()), "tensor_sizes": sizes,
            "adapter_numel": int(numel.item())}


def export_to_leaders(chunks, on_rank_zero: dict) -> dict:
    """The adapters exported to ranks 1 and 3 only (as a sync sends them to its replica leaders), in
    32 KiB buckets (the tiny model has 72 KiB of adapters), counting this rank's sends: per rank, how
    many tensors it got, whether they equal rank 0's full export, and where it sent messages."""
    from engine.models import checkpoint

    sends = []
    send = torch.distributed.send
    torch.distributed.send = lambda tensor, dst, *args, **kwargs: sends.append(dst) or send(tensor, dst, *args, **kwargs)
    try:
        received = checkpoint.export_peft_state_dict(chunks, destinations=[1, 3], bucket_bytes=32 * 1024)
    finally:
        torch.distributed.send = send
    sums = {name: float(tensor.double().sum()) for name, tensor in received.items()}
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, {"tensors": len(received), "sums": sums, "sends": sends})
    reference = {name: float(tensor.double().sum()) for name, tensor in on_rank_zero.items()}
    return [{"tensors": r["tensors"], "equal_to_rank_0": r["sums"] == reference if r["tensors"] else None,
             "sends": r["sends"]} for r in every] if torch.distributed.get_rank() == 0 else []


def run_layout(spec: dict, hf_dir: Path, seed: int, peft_dir: Path | None, out_dir: Path, name: str,
               engine_name: str = "torch") -> dict:
    from megatron.core import parallel_state

    from engine.config import RefConfig, RolloutConfig
    from engine.models.checkpoint import export_hf_state_dict, export_peft_state_dict, load_hf_weights, save_peft_adapter
    from engine.models.gpt import build_model_chunks
    from engine.models.lora import LoRASettings, add_lora, adapters_disabled
    from engine.roles import MegatronActor, ReferencePolicy
    from engine.rollout.torch_engine import TorchRolloutEngine
    from engine.sync import WeightSynchronizer, engine_weights

    layout = use_layout(spec)
    actor_config, _, log_prob_batches = configs(spec, parallel_state.get_data_parallel_world_size())
    actor_config = replace(actor_config, optim=replace(actor_config.optim, eps=ADAM_EPS))
    chunks = build_model_chunks(hf_dir, layout)
    load_hf_weights(chunks, hf_dir)
    architecture = chunks[0].hf_architecture
    batch = make_batch(architecture.vocab_size, seed)
    mask = batch.response_mask.bool()
    base = ReferencePolicy(chunks, RefConfig(log_prob_micro_batch_size_per_gpu=log_prob_batches.micro_batch_size_per_gpu,
                                             log_prob_max_token_len_per_gpu=24),
                           use_dynamic_bsz=spec["dynamic"], use_remove_padding=spec["packing"])
    base_log_probs = base.compute_ref_log_probs(batch, TEMPERATURE)

    add_lora(chunks, LoRASettings(RANK, ALPHA, ("all-linear",), seed=1))
    set_adapter_b(chunks, architecture)
    before = base_parameters(chunks)
    actor = MegatronActor(chunks, actor_config, log_prob_batches=log_prob_batches, samples_per_prompt=1,
                          total_optimizer_steps=4, seed=SEED, use_remove_padding=spec["packing"])
    trainable = sum(p.numel() for chunk in actor.ddp_chunks for p in chunk.parameters() if p.requires_grad)
    with adapters_disabled(chunks):
        disabled = actor.compute_log_probs(batch, log_prob_batches, TEMPERATURE)["log_probs"]
    old = actor.compute_log_probs(batch, log_prob_batches, TEMPERATURE)["log_probs"]
    result = {
        "disabled_equals_base": bool(torch.equal(disabled[mask], base_log_probs[mask])),
        "adapters_change_log_probs": float((old - base_log_probs)[mask].abs().max()),
        "trainable_parameters_on_rank": trainable,
    }
    result["actor"] = actor.update_policy(replace(batch, old_log_probs=old), TEMPERATURE)
    after = base_parameters(chunks)
    same = torch.tensor([all(torch.equal(before[name], after[name]) for name in before)], dtype=torch.int32)
    torch.distributed.all_reduce(same, op=torch.distributed.ReduceOp.MIN)
    result["base_weights_bit_identical"] = bool(same.item())
    adapters_after = export_peft_state_dict(chunks)
    if torch.distributed.get_rank() == 0:
        torch.save(adapters_after, out_dir / f"{name}.pt")
    if torch.distributed.get_world_size() == 4:  # (ranks 1 and 3 as the leaders)
        result["leaders_only"] = export_to_leaders(chunks, adapters_after)

    if engine_name == "sglang":
        result["sglang"] = sync_into_sglang(chunks, layout, hf_dir, out_dir / f"sglang_{name}")
        return result
    trainer = actor.compute_log_probs(batch, log_prob_batches, TEMPERATURE)["log_probs"]
    # The merged weights through the HybridEngine into the embedded engine (generation TP 2 where
    # the model replica has 2 ranks or more).
    generation_tp = min(2, spec["tp"] * spec["pp"])
    sync = WeightSynchronizer(chunks, layout, RolloutConfig(name="torch", tensor_model_parallel_size=generation_tp,
                                                            dtype="float32", check_weight_sync=True))
    engine = TorchRolloutEngine(str(hf_dir), RolloutConfig(name="torch", dtype="float32"), device="cpu") \
        if sync.is_replica_leader else None
    report = sync.sync(engine)
    exported = export_hf_state_dict(chunks)  # the merged HF export, on rank 0 (a replica leader)
    difference = torch.zeros(1, dtype=torch.float64)
    if engine is not None:
        assert report.checked_by_fingerprint
        served = engine_log_probs(engine.model, batch)
        difference[0] = (served - trainer.double())[mask].abs().max()
        if exported:
            served_weights = engine_weights(engine, exported)
            result["export_equals_engine"] = all(torch.equal(served_weights[k], v) for k, v in exported.items())
        engine.shutdown()
    torch.distributed.all_reduce(difference, op=torch.distributed.ReduceOp.MAX)
    result["engine_vs_trainer_log_probs"] = float(difference)

    result["checkpoint_round_trip"] = checkpoint_round_trip(actor, chunks, out_dir / f"ckpt_{name}", adapters_after)
    if peft_dir is not None:
        save_peft_adapter(chunks, peft_dir, base_model_name_or_path=hf_dir)
        if torch.distributed.get_rank() == 0:
            torch.save({"log_probs": trainer, "batch_seed": seed}, out_dir / "trainer_log_probs.pt")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, required=True)
    parser.add_argument("--layouts", nargs="+", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peft-dir", type=Path)
    parser.add_argument("--engine", choices=("torch", "sglang"), default="torch")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()

    from parallel.state import destroy_model_parallel

    results = {}
    for index, text in enumerate(args.layouts):
        last = index == len(args.layouts) - 1
        results[text] = run_layout(parse_layout(text), args.hf_dir, args.seed, args.peft_dir if last else None,
                                   args.out_dir, text.replace(",", "_"), args.engine)
    if torch.distributed.get_rank() == 0:
        args.out.write_text(json.dumps(results))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
