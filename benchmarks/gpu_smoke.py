"""One-GPU smoke check of the production path: bf16 PPO at TP1 on a random ~0.5B Qwen2-shaped model.

    python -m benchmarks.gpu_smoke [--steps 3] [--out DIR] [--work DIR]   # on one GPU (2-4 minutes)
    python -m benchmarks.gpu_smoke --cpu                                  # the same flow on a tiny model (CI)

A world of one rank. The experiment is ``yaml/qwen2.5-0.5b_gsm8k.yaml`` as written (bf16, GAE with a
critic, the distributed optimizer, sequence packing) except: a random model with Qwen2.5-0.5B's
shapes (tied 151,936-token embedding, 24 layers, 14 heads / 2 KV heads: 494M parameters; ``--cpu``:
2 layers of width 64), the character tokenizer and GSM8K stand-in prompts of ``launch.rehearse``, a
batch of 64 prompts (``--cpu``: 8), and the rollout engine ``torch-process``: transformers'
generate in a process of its own on the same GPU (``engine.rollout.process_engine``), which reserves
``gpu_memory_utilization`` of the memory free when it starts and releases and resumes its memory in
that process, as an SGLang server does. SGLang and transformer-engine are too large to carry to a
bare lent machine, so megatron uses its local layer spec (with transformer-engine installed, the same
script picks TE's spec). In order it:

1. checks the start order and SGLang's sizing rule: the engine started before any training model,
   on (nearly) the whole GPU, and took its fraction of it;
2. checks the colocated memory hand-off on the engine's process: its weights and pool leave the
   device on ``release_memory`` and come back on resume; on a GPU, a training rank that keeps its
   cached memory makes the engine's resume run out of memory, and handing the cache back
   (``engine.rollout.memory.hand_back_cache``) lets it through;
3. runs PPO steps 1 .. N-1 (each releases and resumes the engine as the loop does), saves a
   checkpoint after step N-1's training while the engine sleeps, tears everything down, builds it
   again from the checkpoint (the actor's weights must come back bit-identical) and runs step N;
4. reports per-phase seconds and peak memory, the actor update's MFU (989 TFLOP/s peak on H100/H200),
   the rollout-vs-trainer log-prob gap (checked against ``engine.sync.expected_log_prob_gap``), and
   writes it to ``OUT/gpu_smoke.json`` (the model, data and run go to ``--work``, a temporary folder
   by default). Exit status 1 when a check fails.

Before them, three gates, each with a CPU half that ``--cpu`` runs (issue 45's smoke):

- the environment: the NVIDIA driver's version, ``torch.version.cuda``, the device decided as a job
  decides it (``parallel.device``: a machine whose GPUs CUDA cannot use stops here with the driver
  to install), and a one-rank ``launch.torchrun`` job that must get the ``nccl`` backend and a CUDA
  tensor (``gloo`` and the CPU with ``--cpu``), with one all-reduce;
- memory around the save (free device memory on a GPU, resident host memory on the CPU) and around
  what a server restart finds: ``training_state_off_device`` (``engine.trainer.components``) must
  give the device back what the training state held (on a GPU);
- the attention path a packed row takes (``engine.models.attention.attention_path``), and that path
  run on a pack of 8 sequences against one causal SDPA call per sequence: on a GPU in bf16 through
  torch's varlen flash kernel, where this torch has it (``packed_attention``).

What a bare lent machine reaches (torch 2.11 cu130, transformers, pyarrow; megatron-core and
omegaconf as wheels): all of the above with megatron's local layer spec and the ``torch-process``
engine. What needs the pinned stack: SGLang (a real server's restart and its pool), and
transformer-engine (its THD attention and CP kernels).

On a lent GPU machine (Python 3.12; torch, transformers, pyarrow, tensorboard present; megatron-core
and omegaconf carried as wheels, ``bash benchmarks/gpu_wheels.sh`` makes them in ``.whl``)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_smoke --out $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = REPO_ROOT / "yaml" / "qwen2.5-0.5b_gsm8k.yaml"
GIB = 1024**3
# Qwen2.5-0.5B's config.json shapes (launch.plan.KNOWN_ARCHITECTURES) and the CPU stand-in.
GPU_MODEL = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768}
CPU_MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 100, "max_position_embeddings": 512}
# (prompts per step, prompts per mini-batch, sequences per micro-batch, response tokens)
GPU_BATCH, CPU_BATCH = (64, 32, 16, 128), (8, 4, 2, 16)
# The engine's share of the GPU free when it starts (SGLang's mem_fraction_static): the model's
# training state must fit beside it, as in a colocated run.
GPU_MEMORY_UTILIZATION = 0.5


class SmokeFailure(AssertionError):
    """A check of the smoke run failed; the message says which."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SmokeFailure(message)


def prepare(work: Path, cpu: bool) -> list[str]:
    """The random model, the stand-in data, and the config overrides that point at them."""
    from launch.plan import KNOWN_ARCHITECTURES
    from launch.rehearse import write_gsm8k_stand_in, write_tiny_model

    written = KNOWN_ARCHITECTURES["qwen2.5-0.5b-instruct"]
    fields = {"model_type": "qwen2", "rms_norm_eps": written["rms_norm_eps"], "tie_word_embeddings": True,
              "rope_parameters": {"rope_type": "default", "rope_theta": written["rope_theta"]},
              "hidden_act": "silu", "initializer_range": 0.02, **(CPU_MODEL if cpu else GPU_MODEL)}
    model_dir = write_tiny_model(fields, work / "model")
    prompts, mini, micro, response = CPU_BATCH if cpu else GPU_BATCH
    train, val = write_gsm8k_stand_in(work / "data", train_prompts=prompts * 8, val_prompts=8)
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={train}", f"data.val_files={val}",
        f"data.train_batch_size={prompts}", "data.max_prompt_length=128", f"data.max_response_length={response}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", f"critic.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}", f"critic.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        "actor_rollout_ref.rollout.name=torch-process",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={GPU_MEMORY_UTILIZATION}", "reward_model.num_workers=0",
        "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
        f"trainer.default_local_dir={work / 'run'}", "trainer.resume_mode=disable", "trainer.val_before_train=false",
    ]


def start_order(engine) -> dict[str, float]:
    """The engine started before any training model (on a GPU: on nearly all of it) and took
    ``GPU_MEMORY_UTILIZATION`` of what was free then for its weights and pool (SGLang's rule)."""
    import torch

    from engine.rollout.base import sglang_static_pool_bytes

    startup = engine.startup
    result = {"free_at_engine_start_gb": startup["free_at_start_bytes"] / GIB,
              "engine_weights_gb": startup["weight_bytes"] / GIB, "engine_pool_gb": startup["pool_bytes"] / GIB}
    if torch.cuda.is_available():
        total = torch.cuda.mem_get_info()[1]
        result["gpu_total_gb"] = total / GIB
        # The training models (~9 GiB for the actor's bf16 weights, fp32 grads and Adam alone) were not there.
        check(startup["free_at_start_bytes"] > total - 3 * GIB,
              f"the engine started with {startup['free_at_start_bytes'] / GIB:.1f} of {total / GIB:.1f} GiB free: "
              "after the training models, not before them")
        expected = sglang_static_pool_bytes(startup["free_at_start_bytes"], GPU_MEMORY_UTILIZATION) - startup["weight_bytes"]
        check(abs(startup["pool_bytes"] - expected) < 2**20, f"the engine's pool {startup['pool_bytes']} != SGLang's rule {expected}")
    return result


def memory_hand_off(parts) -> dict[str, Any]:
    """release -> (a cache kept, on a GPU) -> hand the cache back -> resume, push, resume KV + graphs,
    measured in the engine's process and, on a GPU, as free device memory in this one."""
    import torch

    from engine.rollout.base import MEMORY_TAGS, RolloutError, WEIGHTS
    from engine.rollout.memory import hand_back_cache

    engine = parts.rollout.engine
    before = engine.memory()
    engine.release_memory(MEMORY_TAGS)
    released = engine.memory()
    result: dict[str, Any] = {"engine_before": before, "engine_released": released}
    check(released["weight_bytes"] == 0 and released["pool_bytes"] == 0,
          f"release_memory left {released} in the engine's process")
    if torch.cuda.is_available():
        # A training rank that keeps its cache: blocks freed in this process but still reserved by
        # its allocator, as many as the engine needs. The engine's resume must fail on them.
        free = torch.cuda.mem_get_info()[0]
        kept = torch.empty(max(0, free - (before["pool_bytes"] + before["weight_bytes"]) // 2), dtype=torch.uint8,
                           device="cuda")
        del kept
        result["cache_kept_gb"] = torch.cuda.memory_reserved() / GIB
        try:
            engine.resume_memory([WEIGHTS] + (["kv_cache"] if before["pool_bytes"] else []))
        except RolloutError as error:
            result["resume_without_hand_back"] = str(error)[:300]
        else:
            raise SmokeFailure("the engine resumed although this process held its cached memory: the smoke "
                               "cannot see a missing cache hand-back")
        engine.release_memory(MEMORY_TAGS)  # whatever part of the resume went through
        hand_back_cache("gpu_smoke")
        result["free_after_hand_back_gb"] = torch.cuda.mem_get_info()[0] / GIB
    parts.rollout.wake_and_sync(1)  # hand back, resume weights, push, resume KV cache and graphs
    result["engine_resumed"] = engine.memory()
    check(result["engine_resumed"]["weight_bytes"] == before["weight_bytes"], "the weights did not come back")
    return result


def environment_gate(cpu: bool, work: Path) -> dict[str, Any]:
    """Gate 1 (see the module docstring)."""
    import subprocess

    import torch

    from parallel.device import DeviceError, decide
    from parallel.state import find_free_port

    try:
        choice = decide("cpu" if cpu else "cuda")
    except DeviceError as error:
        raise SmokeFailure(str(error)) from None
    out = work / "environment_gate.json"
    job = subprocess.run([sys.executable, "-m", "launch.torchrun", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                          f"--master_port={find_free_port()}", "-m", "benchmarks.gpu_smoke", "--gate-worker", str(out)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    check(job.returncode == 0, f"the one-rank launch.torchrun job failed:\n{job.stderr[-3000:]}")
    rank = json.loads(out.read_text())
    expected = ("gloo", "cpu") if cpu else ("nccl", "cuda")
    check((rank["backend"], rank["device"]) == expected,
          f"the one-rank job ran on {rank['backend']} and {rank['device']}, expected {expected}: a CPU fall-back")
    check(rank["all_reduce"] == 2.0, f"one rank's all-reduce of 2.0 gave {rank['all_reduce']}")
    return {"driver": choice.driver, "torch_cuda": torch.version.cuda, "decided": choice.banner(), "rank": rank}


def gate_worker(out: str) -> None:
    """The one-rank job of ``environment_gate``, started as ``launch.main`` is: the device decided
    first, then the process group."""
    import torch
    import torch.distributed as dist

    from parallel.device import decide
    from parallel.state import device, init_distributed

    decide("auto")
    init_distributed()
    tensor = torch.full((1,), 2.0, device=device())
    dist.all_reduce(tensor)
    Path(out).write_text(json.dumps({"backend": dist.get_backend(), "device": tensor.device.type,
                                     "all_reduce": tensor.item()}))
    dist.destroy_process_group()


def device_memory() -> float:
    """Free device memory in GiB on a GPU; on the CPU, this process's resident host memory."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.mem_get_info()[0] / GIB
    from benchmarks.load_memory import status_kib

    return status_kib("VmRSS") * 1024 / GIB


def restart_memory(parts) -> dict[str, float]:
    """Gate 2's second half: the memory a restarting server would find, before, inside and after the
    training state's trip off the device."""
    import torch

    before = device_memory()
    with parts.rollout.training_state_off_device():
        inside = device_memory()
    after = device_memory()
    result = {"before_gb": before, "training_state_off_gb": inside, "after_gb": after}
    if torch.cuda.is_available():  # (on the CPU the offload copies to the same host memory)
        from parallel.offload import PARTS

        held = sum(role.offloader.nbytes(part) for role in (parts.actor, parts.critic) if role is not None
                   for part in PARTS) / GIB
        check(inside - before > 0.8 * held, f"taking the training state off freed {inside - before:.2f} GiB of its "
                                            f"{held:.2f} GiB: a restarted server would size its pool beside it")
    return result


def actor_fingerprint(parts) -> list[float]:
    import torch

    with torch.no_grad():
        return [float(p.detach().double().sum()) for chunk in parts.actor.model_chunks for p in chunk.parameters()]


def run(steps: int, cpu: bool, work: Path) -> dict[str, Any]:
    import torch

    from engine.config import load_config
    from engine.models.attention import attention_path
    from engine.models.gpt import use_transformer_engine
    from engine.sync import expected_log_prob_gap
    from engine.trainer.components import build_components
    from engine.trainer.ppo_trainer import resume_from_checkpoint, save_checkpoint
    from engine.trainer.run_dir import RunDirectory
    from parallel.state import destroy_model_parallel, initialize_model_parallel

    check(cpu or torch.cuda.is_available(), "no GPU: run with --cpu for the CPU flow")
    started = time.perf_counter()
    gate = environment_gate(cpu, work)
    cfg = load_config(EXPERIMENT, [*prepare(work, cpu), f"trainer.total_training_steps={steps}"], world_size=1)
    megatron = cfg.actor_rollout_ref.actor.megatron
    initialize_model_parallel(megatron, seed=megatron.seed)
    run_dir = RunDirectory.create(cfg.trainer.default_local_dir)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "layer_spec": "transformer-engine" if use_transformer_engine() else "megatron local (no transformer-engine)",
        "rollout_engine": "torch-process (transformers generate, a process of its own on the same device)",
        "param_dtype": megatron.param_dtype, "rollout_dtype": cfg.actor_rollout_ref.rollout.dtype, "steps": [],
        "environment": gate, "attention_packed_rows": attention_path(packed=True),
        "packed_attention": packed_attention(),
    }
    try:
        parts = build_components(cfg, run_dir)  # the engine first, released, then the models
        report["start_order"] = start_order(parts.rollout.engine)
        report["parameters"] = sum(p.numel() for chunk in parts.actor.model_chunks for p in chunk.parameters())
        parts.rollout.wake_and_sync(1)
        report["memory_hand_off"] = memory_hand_off(parts)
        report["restart_memory"] = restart_memory(parts)
        batches = iter(parts.train_loader)
        saved: list[float] = []

        def save() -> None:  # after step N-1's training, while the engine sleeps, as the loop saves
            before = device_memory()
            save_checkpoint(parts, steps - 1, parts.train_loader.state_dict())
            report["save_memory"] = {"before_gb": before, "after_gb": device_memory()}
            saved.extend(actor_fingerprint(parts))

        for step in range(1, steps):
            report["steps"].append(_step(cfg, parts, next(batches), step, save if step == steps - 1 else None))
        parts.rollout.engine.shutdown()
        del parts, batches
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        cfg.trainer.resume_mode = "auto"
        parts = build_components(cfg, run_dir)
        check(resume_from_checkpoint(cfg, parts) == steps - 1, "the rebuilt run did not resume from the checkpoint")
        check(actor_fingerprint(parts) == saved, "the resumed actor's weights differ from the saved ones")
        parts.rollout.wake_and_sync(steps)
        report["steps"].append(_step(cfg, parts, next(iter(parts.train_loader)), steps))
        parts.rollout.engine.shutdown()
    finally:
        destroy_model_parallel()
    tolerance = expected_log_prob_gap(cfg.actor_rollout_ref.rollout.dtype, megatron.param_dtype)
    for row in report["steps"]:
        check(row["rollout/log_prob_abs_diff"] <= tolerance,
              f"step {row['step']}: rollout vs trainer log-prob gap {row['rollout/log_prob_abs_diff']:.3g} > {tolerance}")
        for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm"):
            check(row[key] == row[key] and abs(row[key]) < float("inf"), f"step {row['step']}: {key} = {row[key]}")
    report["seconds"] = time.perf_counter() - started
    return report


def packed_attention() -> dict[str, Any]:
    """``engine.models.attention.packed_causal_attention`` on a random pack of 8 sequences (64-1024
    tokens, 8 query and 2 key/value heads of 64), against a causal SDPA call per sequence in float32:
    the largest difference, whether torch's varlen kernel ran, and both timings."""
    import torch

    from engine.models.attention import packed_causal_attention, uses_varlen_kernel

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(64, 1025, (8,), generator=generator).tolist()
    q, k, v = (torch.randn(sum(lengths), heads, 64, generator=generator).to(device, dtype) for heads in (8, 2, 2))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def per_sequence():
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].float().transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=0.125,
            enable_gqa=True).transpose(0, 1) for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())])

    def timed(function):
        function()  # warm-up (kernel selection, allocator)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = function()
        if cuda:
            torch.cuda.synchronize()
        return result, time.perf_counter() - started

    packed, packed_s = timed(lambda: packed_causal_attention(q, k, v, cu_seqlens, max(lengths), 0.125))
    reference, reference_s = timed(per_sequence)
    error = float((packed.float() - reference).abs().max())
    check(error < (2e-2 if cuda else 1e-4), f"packed attention differs from per-sequence SDPA by {error:.3g}")
    return {"tokens": sum(lengths), "varlen_kernel": uses_varlen_kernel(q), "max_abs_diff": error,
            "packed_s": packed_s, "per_sequence_fp32_s": reference_s}


def _step(cfg, parts, prompts, step: int, save=None) -> dict[str, Any]:
    from engine.trainer.ppo_trainer import ppo_iteration

    metrics = ppo_iteration(cfg, parts, prompts, step, save=save)
    keys = ("rollout/log_prob_abs_diff", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "perf/mfu/actor",
            "perf/throughput", "perf/total_num_tokens", "response_length/mean")
    row = {"step": step, **{key: metrics[key] for key in keys if key in metrics}}
    row.update({key: value for key, value in metrics.items() if key.startswith(("timing_s/", "perf/max_"))})
    phases = [key[len("timing_s/"):] for key in metrics if key.startswith("timing_s/") and key != "timing_s/step"]
    memory = "max_memory_allocated_gb" if "perf/max_memory_allocated_gb" in metrics else "max_rss_gb"
    mfu = row.get("perf/mfu/actor")
    print(f"[gpu_smoke] step {step}: {metrics['timing_s/step']:.2f} s, log-prob gap "
          f"{metrics['rollout/log_prob_abs_diff']:.2e}, actor MFU {'-' if mfu is None else f'{mfu:.1%}'}", flush=True)
    for name in phases:
        print(f"[gpu_smoke]   {name:<15} {metrics[f'timing_s/{name}']:8.3f} s   peak "
              f"{metrics[f'perf/{memory}/{name}']:7.2f} GiB ({memory})", flush=True)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the same flow on a tiny model (machines without a GPU)")
    parser.add_argument("--steps", type=int, default=3, help="PPO steps; a checkpoint is saved and resumed before the last")
    parser.add_argument("--out", default=None, help="folder for gpu_smoke.json (default: the work folder)")
    parser.add_argument("--work", default=None, help="folder for the model, data and run (default: a temporary one)")
    parser.add_argument("--gate-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gate_worker:
        gate_worker(args.gate_worker)
        return
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the last step runs after a resume)")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="trident-gpu-smoke-"))
    out = Path(args.out) if args.out else work
    for folder in (work, out):
        folder.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # megatron's jit fuser compiles for ~16 s on CPU
    try:
        report = run(args.steps, args.cpu, work)
    except SmokeFailure as failure:
        print(f"[gpu_smoke] FAILED: {failure}", file=sys.stderr, flush=True)
        sys.exit(1)
    (out / "gpu_smoke.json").write_text(json.dumps(report, indent=2))
    print(f"[gpu_smoke] passed in {report['seconds']:.0f} s on {report['device']} ({report['environment']['decided']}; "
          f"one rank on {report['environment']['rank']['backend']}); memory hand-off {report['memory_hand_off']}; "
          f"around the save {report['save_memory']}; training state off for a restart {report['restart_memory']}; "
          f"packed rows: {report['attention_packed_rows']}; report {out / 'gpu_smoke.json'}", flush=True)


if __name__ == "__main__":
    main()
