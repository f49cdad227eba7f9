"""Worker: the HybridEngine weight sync of a real megatron-core actor, for several layouts per launch.

For each case "pp,tp,vpp,tp_gen[,ep]" (world size = nproc; vpp 0 = none; ep: expert parallel), re-initialising megatron's
parallel state between cases:
- megatron's own rank groups equal the TrainingLayout rank map;
- actor chunks are built with megatron's random init; the reference is the models engineer's
  ``export_hf_state_dict`` (an independent gather path);
- FULL target: every generation rank receives tensors bit-identical to the export; SHARDED target:
  every rank receives exactly its generation slice, bit-identical; measured bytes equal the plan's
  prediction, and staging memory stays within the bucket plus one tensor;
- ``WeightSynchronizer.sync`` pushes into an embedded torch engine on each replica leader (which
  starts from other weights), the fingerprint check passes, and a corrupted tensor is named by it;
  with ``--engine sglang`` into a real SGLang server per replica instead (which cannot show its
  tensors: before the sync its log-probs must fail the HF check, after it pass);
- the engine's greedy generation equals that of an HF model holding the exported weights, with
  log-probs equal within 1e-4 (check_by_log_probs), and the DP rank's prompts split over the
  micro-DP replicas come back complete and in order on every rank.
Rank 0 writes one record per case to --out; any failed check raises.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from pathlib import Path

import torch

PROMPTS_PER_DP_RANK = 5
MAX_NEW_TOKENS = 5


def parse_case(text: str):
    values = [int(x) for x in text.split(",")]
    pp, tp, vpp, tg, ep, etp = values + [1, 0][len(values) - 4:]
    return pp, tp, vpp or None, tg, ep, etp or None


def check_rank_map(training) -> None:
    from megatron.core import parallel_state

    c = training.coordinates(torch.distributed.get_rank())
    actual = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_context_parallel_rank(),
              parallel_state.get_data_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    assert actual == (c.tensor, c.context, c.data, c.pipeline), (actual, c)
    assert parallel_state.get_expert_model_parallel_rank() == c.expert, (parallel_state.get_expert_model_parallel_rank(), c)
    mine = [training.rank(c.tensor, c.context, c.data, p) for p in range(training.pipeline_model_parallel_size)]
    theirs = torch.distributed.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    assert mine == theirs, (mine, theirs)
    mine = [training.rank(t, c.context, c.data, c.pipeline) for t in range(training.tensor_model_parallel_size)]
    theirs = torch.distributed.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    assert mine == theirs, (mine, theirs)


def hf_reference_model(hf_dir: str, state_dict: dict, folder: str):
    """The HF model holding ``state_dict``, loaded by transformers itself from a safetensors folder (so
    its own checkpoint conversion applies, e.g. MoE experts fused in memory)."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    Path(folder).mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(hf_dir) / "config.json", folder)
    save_file(state_dict, str(Path(folder) / "model.safetensors"))
    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"] and not info["mismatched_keys"], info
    model.eval()
    model.generation_config.eos_token_id = None  # fixed-length, like the engine's ignore_eos
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prompt + response])).logits[0].float()
    predicted = logits[len(prompt) - 1: len(prompt) + len(response) - 1]
    return torch.log_softmax(predicted, dim=-1).gather(1, torch.tensor(response).view(-1, 1)).squeeze(1)


def check_received(shards, reference: dict, target: str) -> int:
    count = 0
    for shard in shards:
        want = reference[shard.name]
        if target == "full":
            assert shard.is_full, f"{shard.name}: FULL target delivered a slice {tuple(shard.tensor.shape)}"
        else:
            want = want.narrow(shard.dim, shard.start, shard.tensor.shape[shard.dim]) if shard.dim is not None else want
        assert shard.tensor.dtype == want.dtype and torch.equal(shard.tensor.cpu(), want), f"{shard.name} differs"
        count += 1
    return count


def start_engine(engine_name: str, hf_dir: str, run_dir: str, generation_tp: int):
    if engine_name == "torch":
        from engine.config import RolloutConfig
        from engine.rollout.torch_engine import TorchRolloutEngine

        return TorchRolloutEngine(hf_dir, RolloutConfig(name="torch", dtype="float32"), device="cpu")
    from tests.rollout_support import start_cpu_sglang

    return start_cpu_sglang(hf_dir, run_dir, rollout={"weight_update_timeout_s": 120,
                                                      "tensor_model_parallel_size": generation_tp})


def payload_producers(engine) -> list[list[int]]:
    """Record, for every bucket the leader pushes as per-rank payloads, the pid of the process that
    made each TP rank's payload: a CPU payload names the shared-memory file its producer created,
    ``/torch_<pid>_...`` (torch's file_system sharing)."""
    import base64
    import re

    pushes: list[list[int]] = []
    push = engine.push_serialized_weights

    def recorded(named_shapes, payloads, **options):
        pushes.append([int(re.search(rb"/torch_(\d+)_", base64.b64decode(p)).group(1)) for p in payloads])
        return push(named_shapes, payloads, **options)

    engine.push_serialized_weights = recorded
    return pushes


@contextlib.contextmanager
def batched_point_to_point():
    """The point-to-point operations issued through ``torch.distributed.batch_isend_irecv`` while
    the block runs (a list of (op name, peer))."""
    issued, batch = [], torch.distributed.batch_isend_irecv

    def recording(ops):
        issued.extend((op.op.__name__, op.peer) for op in ops)
        return batch(ops)

    torch.distributed.batch_isend_irecv = recording
    try:
        yield issued
    finally:
        torch.distributed.batch_isend_irecv = batch


PROBES = [[5, 6, 7], [9, 3, 12, 4]]


def sglang_state(engine) -> dict:
    """What an SGLang server serves: the checksum of every parameter on each of its TP workers
    (SGLang's ``/weights_checker``), and the greedy tokens and log-probs of the probe prompts."""
    import requests

    from engine.rollout.base import SamplingParams

    (server,) = engine.servers
    answer = requests.post(f"{server.url}/weights_checker", json={"action": "checksum"}, timeout=120).json()
    assert answer["success"], answer
    checksums = {info["parallelism_info"][0]["tp_rank"]: info["checksums"] for info in answer["ranks"]}
    samples = engine.generate(PROBES, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True))
    return {"checksums": checksums, "probes": [(s[0].token_ids, s[0].log_probs) for s in samples]}


def push_sharded_into_sglang(chunks, layout, tg: int, bucket_megabytes: float, engine, record: dict) -> dict | None:
    """The sharded push: each rank hands its own generation shard (SGLang's layout) to its own TP
    worker. Every rank receives exactly the plan's lower bound, and each TP worker's payload was
    made by the training rank of that generation TP rank. Returns the leader's ``sglang_state``."""
    from engine.config import RolloutConfig
    from engine.sync import WeightSynchronizer

    sync = WeightSynchronizer(chunks, layout, RolloutConfig(
        name="sglang", tensor_model_parallel_size=tg, update_weights_bucket_megabytes=bucket_megabytes,
        dtype="float32"), target="sharded")
    assert sync.pushes_shards and sync.serializes_per_rank and sync.fallback_reason is None
    pushes = payload_producers(engine) if engine is not None else None
    report = sync.sync(engine)
    assert report.stats.bytes_received == report.lower_bound_bytes, (report.stats.bytes_received, report.lower_bound_bytes)
    pids: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(pids, os.getpid())
    received = torch.tensor([report.stats.bytes_received])
    torch.distributed.all_reduce(received, op=torch.distributed.ReduceOp.MAX)
    record["sharded_push"] = {"max_received": int(received), "output": sync.traffic.output}
    if engine is None:
        return None
    replica = sorted(sync.groups.generation_tensor_ranks, key=lambda r: sync.layout.generation_coordinates(r).tensor)
    assert pushes and all(producers == [pids[r] for r in replica] for producers in pushes), (pushes, replica, pids)
    return sglang_state(engine)


def run_case(case: str, hf_dir: str, bucket_megabytes: float, engine_name: str, run_dir: str) -> dict:
    from megatron.core import parallel_state

    from engine.models.checkpoint import export_hf_state_dict
    from engine.models.gpt import build_model_chunks
    from engine.config import RolloutConfig
    from engine.sync import WeightSynchronizer, check_by_log_probs, check_engine_weights, engine_weights
    from parallel.hybrid_engine import WeightSyncError, gather_generation_results, split_for_generation
    from parallel.layout import ParallelLayout
    from parallel.state import initialize_model_parallel

    pp, tp, vpp, tg, ep, etp = parse_case(case)
    layout = ParallelLayout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    initialize_model_parallel(layout, seed=3)
    chunks = build_model_chunks(hf_dir, layout)
    reference = export_hf_state_dict(chunks, destination_rank=None)
    rank = torch.distributed.get_rank()
    record: dict = {"case": case}

    for target in ("full", "sharded"):
        sync = WeightSynchronizer(chunks, layout, RolloutConfig(
            name=engine_name, tensor_model_parallel_size=tg, update_weights_bucket_megabytes=bucket_megabytes,
            dtype="float32", check_weight_sync=True), target=target)
        if target == "full":
            check_rank_map(sync.layout.training)
        received = 0
        with batched_point_to_point() as batched:
            for bucket in sync.iter_weight_shards():
                received += check_received(bucket, reference, target)
        assert received == len(reference), (received, len(reference))
        # Every point-to-point transfer the plan gives this rank went out inside a batch_isend_irecv
        # (NCCL: one communicator, not one per pair of ranks).
        planned = sum(len(s.sends) + (s.receive is not None) + len(s.expert_sends) + (s.expert_receive is not None)
                      + len(s.direct_sends) + len(s.direct_receives) for s in sync.plan.steps(rank))
        assert len(batched) == planned, (target, len(batched), planned)
        stats, traffic = sync.executor.stats, sync.traffic
        assert stats.bytes_received == traffic.received, (target, stats.bytes_received, traffic.received)
        assert traffic.lower_bound <= traffic.received
        largest = max(sync.plan.staging_bytes(s) for s in sync.plan.steps(rank))
        assert stats.peak_staging_bytes <= bucket_megabytes * 2**20 + largest, (stats.peak_staging_bytes, largest)
        world_planned = torch.tensor([planned])
        torch.distributed.all_reduce(world_planned)
        record[target] = {"received": stats.bytes_received, "lower_bound": traffic.lower_bound,
                          "batched_p2p_world": int(world_planned),
                          "peak_staging": stats.peak_staging_bytes, "buckets": stats.num_buckets}

    # The full path into real engines, with the fingerprint check on.
    hf_model = hf_reference_model(hf_dir, reference, f"{run_dir}/rank{rank}/reference")
    engine = None
    if sync.is_replica_leader:
        engine = start_engine(engine_name, hf_dir, f"{run_dir}/rank{rank}", tg)
        weights = engine_weights(engine, ["model.layers.0.self_attn.q_proj.weight"])
        if weights is not None:
            before = weights["model.layers.0.self_attn.q_proj.weight"].clone()
            assert not torch.equal(before, reference["model.layers.0.self_attn.q_proj.weight"])
        else:  # the server starts from other weights: its log-probs must fail the check
            try:
                check_by_log_probs(engine, [[5, 6, 7]], lambda p, r: hf_log_probs(hf_model, p, r), MAX_NEW_TOKENS,
                                   atol=1e-4)
            except WeightSyncError:
                pass
            else:
                raise AssertionError("the engine matched the trained weights before any sync")
    sharded_state = None
    if engine_name == "sglang":  # the sharded push first: the server still holds other weights
        sharded_state = push_sharded_into_sglang(chunks, layout, tg, bucket_megabytes, engine, record)
    full_sync = WeightSynchronizer(chunks, layout, RolloutConfig(
        name=engine_name, tensor_model_parallel_size=tg, update_weights_bucket_megabytes=bucket_megabytes,
        dtype="float32", check_weight_sync=True), target="full")
    pushes = payload_producers(engine) if engine is not None and full_sync.serializes_per_rank else None
    report = full_sync.sync(engine)
    if sharded_state is not None and engine is not None:
        # SGLang's own loader, slicing the full tensors: every TP worker's parameters, the greedy
        # tokens and their log-probs are the sharded push's, bit for bit.
        full_state = sglang_state(engine)
        assert full_state["checksums"].keys() == sharded_state["checksums"].keys()
        record["sharded_push"]["differing"] = sorted({name for g, sums in full_state["checksums"].items()
                                                      for name, value in sums.items()
                                                      if sharded_state["checksums"][g].get(name) != value})
        for (tokens, log_probs), (sharded_tokens, sharded_log_probs) in zip(full_state["probes"], sharded_state["probes"]):
            # (the same weights bit for bit; batching and the prefix cache reorder fp32 sums)
            assert tokens == sharded_tokens, (tokens, sharded_tokens)
            assert max(abs(a - b) for a, b in zip(log_probs, sharded_log_probs)) < 1e-5, (log_probs, sharded_log_probs)
        record["sharded_push"]["tensors_compared"] = sum(len(sums) for sums in full_state["checksums"].values())
    record["sync_seconds"] = report.stats.seconds
    pids: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(pids, os.getpid())
    if pushes is not None:  # each TP rank's payload came from the rank holding that rank's tensors
        replica = sorted(full_sync.groups.generation_tensor_ranks,
                         key=lambda r: full_sync.layout.generation_coordinates(r).tensor)
        assert pushes and all(producers == [pids[r] for r in replica] for producers in pushes), (pushes, replica, pids)
        assert len(set(pids[r] for r in replica)) == tg
        record["per_rank_payloads_checked"] = len(pushes)
    if engine is not None:
        assert report.checked_by_fingerprint == (engine_name == "torch"), report

    dp_rank = full_sync.layout.training.coordinates(rank).data
    prompts = [[3 + dp_rank, 7 + i, 11 + (i * 5) % 50] for i in range(PROMPTS_PER_DP_RANK)]
    mine = split_for_generation(prompts, full_sync.layout, rank)
    results = []
    if engine is not None:
        from engine.rollout.base import SamplingParams

        samples = engine.generate(mine, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0, ignore_eos=True))
        results = [sample[0].token_ids for sample in samples]
        record["max_log_prob_difference"] = check_by_log_probs(
            engine, mine[:2], lambda p, r: hf_log_probs(hf_model, p, r), MAX_NEW_TOKENS, atol=1e-4)
    if engine is not None and engine_name == "torch":
        # A wrong row order in one tensor must be named by the fingerprint check.
        name = "model.layers.1.self_attn.k_proj.weight"
        weights = engine_weights(engine, [name])
        with torch.no_grad():
            weights[name].copy_(weights[name].flip(0))
        try:
            check_engine_weights(engine, full_sync.executor.expected_fingerprints)
        except WeightSyncError as error:
            assert name in str(error) and "q_proj" not in str(error), str(error)
        else:
            raise AssertionError("a flipped k_proj passed the fingerprint check")
    if engine is not None:
        engine.shutdown()
    gathered = gather_generation_results(results, full_sync.groups)
    expected = [hf_greedy(hf_model, prompt) for prompt in prompts]
    assert gathered == expected, f"rank {rank}: generation {gathered} != HF {expected}"
    record["prompts_checked"] = len(prompts)
    return record


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--cases", nargs="+", required=True, help="pp,tp,vpp,tp_gen[,ep[,etp]] (vpp 0 = none, etp 0 = tp)")
    parser.add_argument("--bucket-megabytes", type=float, default=0.05)
    parser.add_argument("--engine", choices=["torch", "sglang"], default="torch")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from engine.lifecycle import start_reaper
    from parallel.state import destroy_model_parallel

    start_reaper()  # a failed check must not leave this rank's SGLang servers behind (as launch.main)

    run_dir = str(Path(args.out).parent / "engines")
    records = [run_case(case, args.hf_dir, args.bucket_megabytes, args.engine, run_dir) for case in args.cases]
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as handle:
            json.dump(records, handle, indent=1)
    destroy_model_parallel()


if __name__ == "__main__":
    main()
