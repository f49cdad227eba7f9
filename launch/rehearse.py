"""Rehearse an experiment on this machine before renting the cluster it was written for.

    python -m launch.rehearse yaml/X.yaml [--steps 2] [--max-ranks 4] [--out DIR] [key=value ...]

Runs the experiment's own config (every key as written: precision, rollout engine, batching, loss
and KL switches, checkpointing, loggers) for a few PPO steps on CPU ranks over gloo, changing only
what this machine cannot hold. Every change is printed first, with its reason, and written to
``DIR/rehearsal.json``:

- the model: a random model of the same architecture family (``model_type``, query/KV head ratio,
  QKV bias, tied embeddings, RoPE base and scaling type, Mixture-of-Experts layers and their
  router's renormalisation, from the checkpoint's ``config.json`` or ``launch.plan``'s table of
  published configs), as few layers as the shrunk pipeline needs, heads of 8 dimensions, at most
  4 experts and each token routed to at most 2, with the character-level tokenizer of the demo
  model as a stand-in;
- the layout: tensor, pipeline and virtual pipeline sizes above 2 become 2, data parallelism at
  most 2 and within ``--max-ranks``, expert TP dividing the shrunk TP, expert parallelism within
  the stage's ranks that expert TP leaves and dividing the tiny model's experts; the generation TP
  keeps its ratio to the training TP;
- lengths and batches: prompts of ``PROMPT_CAP`` tokens (characters of the stand-in tokenizer, so
  shorter written limits are raised too) and responses capped at ``RESPONSE_CAP`` tokens
  (token budgets scale with them), micro-batches at 2 sequences, at most 2 optimizer steps per
  iteration, and the smallest prompt batch the shrunk layout divides;
- data missing here: GSM8K stand-ins (arithmetic questions written through ``launch.data.gsm8k``,
  so the real converter and the real GSM8K reward run); other missing data is an error;
- the cluster: one node of the rehearsal's ranks (CPU processes), Ray reward pools of 1 worker,
  weight buckets of 1 MB (so the tiny model also travels in several buckets), a fresh run
  directory under DIR.

It then checks what the first steps of a healthy run show: every step logged, losses finite, and
the rollout engine's log-probs equal to the trainer's within the precision's tolerance
(``engine.sync.expected_log_prob_gap``); an experiment that takes pi_old from the engine
(``actor.use_rollout_log_probs``) recomputes nothing to compare, and its embedded engine's weights
are checked by fingerprint instead (``rollout.check_weight_sync``). Exit status 0 on success, 1 when
the rehearsal fails (the message names the check, the job log is ``DIR/job.log``), 2 for a config
error.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from engine.config import ConfigError, ExperimentConfig, load_config, to_yaml
from engine.config.loader import type_of_key
from engine.models.char_tokenizer import VOCAB_SIZE
from parallel.layout import STAND_IN_COMM_TYPES

PROMPT_CAP = 128  # tokens (characters of the stand-in tokenizer)
RESPONSE_CAP = 16
MICRO_BATCH_CAP = 2
PARALLEL_CAP = 2  # tensor, pipeline, virtual pipeline, context, data and expert parallel sizes
OPTIMIZER_STEPS_CAP = 2  # mini-batches per iteration
HEAD_DIM = 8
EXPERTS_CAP = 4
TOPK_CAP = 2
STAND_IN_VAL_PROMPTS = 8
# Keys whose values are checked against the rehearsal's losses (must be finite when present).
LOSS_KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
ACTOR_MEGATRON = "actor_rollout_ref.actor.megatron"
CRITIC_MEGATRON = "critic.megatron"


class RehearsalError(RuntimeError):
    """The rehearsal ran and a check failed; the message names it."""


@dataclasses.dataclass
class Change:
    """One key the rehearsal sets differently from the experiment, and why."""

    key: str
    written: Any
    rehearsed: Any
    why: str


@dataclasses.dataclass
class Rehearsal:
    """What ``plan_rehearsal`` decided: the overrides (in order) and the world they run on."""

    world_size: int
    changes: list[Change]

    def overrides(self) -> list[str]:
        return [f"{change.key}={json.dumps(change.rehearsed)}" for change in self.changes]


def _get(config: ExperimentConfig, key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


class _Changes:
    """Collects ``Change``s, skipping keys whose value would not change."""

    def __init__(self, config: ExperimentConfig) -> None:
        self.config = config
        self.items: list[Change] = []

    def set(self, key: str, value: Any, why: str) -> None:
        written = _get(self.config, key)
        if type_of_key(key) is None:
            raise KeyError(key)
        if written != value:
            self.items.append(Change(key, written, value, why))


# ----------------------------------------------------------------------------- the model


def tiny_model_config(architecture, tensor_parallel: int, pipeline_stages: int, generation_tp: int,
                      vocab_size: int, max_positions: int, context_parallel: int = 1) -> dict[str, Any]:
    """HF config fields of a tiny model of ``architecture``'s family that the shrunk layout can split
    (CP's all-to-all splits each TP rank's key/value heads too)."""
    group = architecture.num_attention_heads // architecture.num_query_groups
    kv_heads = max(tensor_parallel * context_parallel, generation_tp)
    heads = kv_heads * group
    hidden = heads * HEAD_DIM
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": architecture.rotary_base}
    scaling = architecture.rope_scaling
    if scaling is not None:
        rope.update(rope_type=scaling.rope_type, factor=scaling.factor)
        if scaling.rope_type == "llama3":
            rope.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                        original_max_position_embeddings=max_positions // 4)
    fields = {
        "model_type": architecture.model_type, "vocab_size": vocab_size, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": max(2, pipeline_stages),
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": max_positions,
        "head_dim": HEAD_DIM,  # explicit: Qwen3's config would default to 128
        "rms_norm_eps": architecture.layernorm_epsilon, "rope_parameters": rope,
        "tie_word_embeddings": architecture.tie_word_embeddings, "hidden_act": "silu", "initializer_range": 0.02,
    }
    moe = architecture.moe
    if moe is not None:
        # Few experts, top-2 at most, the router's renormalisation as written (a top-1 stays top-1:
        # hf_config accepts it only unnormalised).
        experts, topk = min(moe.num_experts, EXPERTS_CAP), min(moe.topk, TOPK_CAP)
        if architecture.model_type == "mixtral":  # every layer MoE, experts of intermediate_size, renormalised
            fields.update(num_local_experts=experts, num_experts_per_tok=topk)
        else:  # qwen3_moe: the first layer keeps a dense MLP only when the written model has dense layers
            fields.update(num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=2 * hidden,
                          norm_topk_prob=moe.renormalize, decoder_sparse_step=1,
                          mlp_only_layers=[0] if len(moe.layers) < architecture.num_layers else [])
    return fields


def write_tiny_model(fields: dict[str, Any], out_dir: Path, seed: int = 0) -> Path:
    """A random HF model with ``fields`` and the character tokenizer, saved to ``out_dir``."""
    import torch
    import transformers

    from engine.models.char_tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, build_char_tokenizer

    fields = dict(fields)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields, bos_token_id=BOS_TOKEN_ID,
                                               eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.generation_config = transformers.GenerationConfig(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
                                                            pad_token_id=PAD_TOKEN_ID)
    model.save_pretrained(out_dir)
    build_char_tokenizer(model_max_length=config.max_position_embeddings).save_pretrained(out_dir)
    return out_dir


# ----------------------------------------------------------------------------- data


def write_gsm8k_stand_in(out_dir: Path, train_prompts: int, val_prompts: int, seed: int = 0) -> tuple[Path, Path]:
    """GSM8K-format rows (``question``, ``answer`` ending in ``#### N``) converted by launch.data.gsm8k."""
    from launch.data.gsm8k import convert

    rng = random.Random(seed)

    def rows(count: int) -> list[dict[str, str]]:
        result = []
        for _ in range(count):
            a, b = rng.randint(1, 99), rng.randint(1, 99)
            result.append({"question": f"Calculate {a} + {b}.", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"})
        return result

    out_dir.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", train_prompts), ("test", val_prompts)):
        (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows(count)))
    convert(str(out_dir / "train.jsonl"), str(out_dir / "parquet"), test_input=str(out_dir / "test.jsonl"))
    return out_dir / "parquet" / "train.parquet", out_dir / "parquet" / "test.parquet"


def _data_is_here(files: Sequence[str]) -> bool:
    return all(Path(file).is_file() for file in files)


# ----------------------------------------------------------------------------- the plan


def _shrunk_layout(megatron) -> dict[str, Any]:
    pp = min(megatron.pipeline_model_parallel_size, PARALLEL_CAP)
    vpp = megatron.virtual_pipeline_model_parallel_size
    return {
        "tensor_model_parallel_size": min(megatron.tensor_model_parallel_size, PARALLEL_CAP),
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": min(vpp, PARALLEL_CAP) if vpp and pp > 1 else None,
        "context_parallel_size": min(megatron.context_parallel_size, PARALLEL_CAP),
    }


def _model_parallel_ranks(layout: dict[str, Any]) -> int:
    return (layout["tensor_model_parallel_size"] * layout["pipeline_model_parallel_size"]
            * layout["context_parallel_size"])


def _generation_tp(written_tg: int, written_tp: int, tp: int, pp: int) -> int:
    """Keep the generation/training TP relation: tg = T / s stays T' / s; tg = k T stays k' T'."""
    if written_tg <= written_tp:
        return max(1, tp // (written_tp // written_tg))
    return tp * min(written_tg // written_tp, pp)


def plan_rehearsal(yaml_path: str, base_overrides: Sequence[str], config: ExperimentConfig, model_dir: Path,
                   data: tuple[list[str], list[str]], run_dir: Path, steps: int, max_ranks: int) -> Rehearsal:
    """Decide the rehearsal's keys (see the module docstring) for ``config`` (``yaml_path`` with
    ``base_overrides``, as written) and the tiny model in ``model_dir``; the result passes
    ``load_config`` on the rehearsal's world."""
    from engine.models.hf_config import architecture_from_hf

    arr = config.actor_rollout_ref
    actor_megatron = arr.actor.megatron
    changes = _Changes(config)
    layout = _shrunk_layout(actor_megatron)
    tp, pp = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
    written_world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    written_dp = actor_megatron.data_parallel_size(written_world)
    dp = max(1, min(written_dp, PARALLEL_CAP, max_ranks // _model_parallel_ranks(layout)))
    world = _model_parallel_ranks(layout) * dp
    # Megatron splits the experts over a stage's ranks (expert TP x EP of the tp x dp); the tiny model's
    # must divide. A dense model's EP > 1 stays > 1, to fail at start-up as the real run would.
    expert_tp = actor_megatron.expert_tensor_parallel_size
    if expert_tp is not None:
        expert_tp = math.gcd(expert_tp, tp)
    ep = min(actor_megatron.expert_model_parallel_size, tp * dp // (expert_tp or tp), PARALLEL_CAP)
    tiny_moe = architecture_from_hf(model_dir).moe
    if tiny_moe is not None:
        ep = math.gcd(ep, tiny_moe.num_experts)
    for prefix in (ACTOR_MEGATRON, CRITIC_MEGATRON):
        for name, value in layout.items():
            changes.set(f"{prefix}.{name}", value, f"layout shrunk to {world} CPU ranks (data parallel {dp})")
        changes.set(f"{prefix}.expert_tensor_parallel_size", expert_tp, f"expert TP divides the TP size {tp}")
        changes.set(f"{prefix}.expert_model_parallel_size", ep,
                    f"the tiny model's experts split over at most {tp * dp // (expert_tp or tp)} ranks "
                    "(a stage's TP x DP ranks / expert TP)")
    if layout["context_parallel_size"] > 1 and actor_megatron.cp_comm_type not in STAND_IN_COMM_TYPES:
        for prefix in (ACTOR_MEGATRON, CRITIC_MEGATRON):
            changes.set(f"{prefix}.cp_comm_type", "a2a",
                        f"{actor_megatron.cp_comm_type} runs in Transformer Engine (GPU); the CPU's CP attention "
                        "exchanges by all-to-all (a2a), which takes packed rows as p2p does")
    rollout_tp = _generation_tp(arr.rollout.tensor_model_parallel_size, actor_megatron.tensor_model_parallel_size,
                                tp, pp)
    changes.set("actor_rollout_ref.rollout.tensor_model_parallel_size", rollout_tp,
                "generation TP keeps its ratio to the training TP")

    # The model and the data.
    changes.set("actor_rollout_ref.model.path", str(model_dir), "a random model of the same family")
    changes.set("actor_rollout_ref.model.tokenizer_path", str(model_dir), "character-level stand-in tokenizer")
    if config.critic.model.path != arr.model.path:
        changes.set("critic.model.path", str(model_dir), "the critic starts from the rehearsal model")
        changes.set("critic.model.tokenizer_path", str(model_dir), "character-level stand-in tokenizer")
    train_files, val_files = data
    changes.set("data.train_files", train_files, "GSM8K stand-in prompts (the data is not on this machine)")
    changes.set("data.val_files", val_files, "GSM8K stand-in prompts (the data is not on this machine)")
    # The stand-in tokenizer spends a token per character, more than the model's own on any prompt.
    prompt, response = PROMPT_CAP, min(config.data.max_response_length, RESPONSE_CAP)
    written_length = config.data.max_prompt_length + config.data.max_response_length
    changes.set("data.max_prompt_length", prompt, "tiny model context" if config.data.max_prompt_length > prompt
                else "the character-level stand-in tokenizer spends a token per character")
    changes.set("data.max_response_length", response, "tiny model context")
    for key in ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"):
        budget = _get(config, key)
        changes.set(key, max(prompt + response, round(budget * (prompt + response) / written_length)),
                    "token budget scaled with the sequence length")
    for key in ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"):
        value = _get(config, key)
        if value is not None:
            changes.set(key, min(value, MICRO_BATCH_CAP), f"micro-batches of at most {MICRO_BATCH_CAP} sequences")

    # The cluster and the run.
    changes.set("trainer.nnodes", 1, "one machine")
    changes.set("trainer.n_gpus_per_node", world, "CPU ranks of this machine")
    changes.set("trainer.total_training_steps", steps, "a rehearsal")
    changes.set("trainer.default_local_dir", str(run_dir), "the rehearsal's own run directory")
    changes.set("trainer.resume_mode", "disable", "a fresh run")
    changes.set("actor_rollout_ref.rollout.update_weights_bucket_megabytes", 1,
                "the tiny model still travels in several buckets")
    if config.reward_model.num_workers > 1:
        changes.set("reward_model.num_workers", 1, "one Ray reward worker on 2 cores")
    if arr.rollout.mode == "disaggregated" and not arr.rollout.server_addresses:
        changes.set("actor_rollout_ref.rollout.num_gpus", rollout_tp, "one server of the generation TP, on this CPU")
    overlong = config.reward_model.overlong_buffer
    if overlong.enable:
        changes.set("reward_model.overlong_buffer.len",
                    max(1, round(overlong.len * response / config.data.max_response_length)),
                    "the penalised tail scaled with the response length")
    if config.algorithm.filter_groups.enable and config.algorithm.filter_groups.metric != "score":
        changes.set("algorithm.filter_groups.metric", "score",
                    "the random model answers nothing right, so groups differ only in their length penalty")
    if arr.actor.use_rollout_log_probs and arr.rollout.name == "torch":
        changes.set("actor_rollout_ref.rollout.check_weight_sync", True,
                    "pi_old is the engine's own log-probs, so nothing is recomputed to compare them with: the "
                    "engine's weights are checked against the actor's by fingerprint instead")

    # Batches: the smallest prompt batch the shrunk layout divides, at most 2 optimizer steps.
    batch = config.data.train_batch_size
    actor_steps = min(batch // arr.actor.ppo_mini_batch_size, OPTIMIZER_STEPS_CAP)
    critic_steps = min(batch // config.critic.ppo_mini_batch_size, OPTIMIZER_STEPS_CAP)
    base = [*base_overrides, *(f"{c.key}={json.dumps(c.rehearsed)}" for c in changes.items)]
    for mini in range(1, 257):
        candidate = _Changes(config)
        train = mini * max(actor_steps, critic_steps)
        candidate.set("data.train_batch_size", train, f"{actor_steps} optimizer step(s) per iteration on the "
                                                      "shrunk layout")
        candidate.set("actor_rollout_ref.actor.ppo_mini_batch_size", train // actor_steps,
                      "smallest mini-batch the shrunk layout divides")
        candidate.set("critic.ppo_mini_batch_size", train // critic_steps,
                      "smallest mini-batch the shrunk layout divides")
        try:
            load_config(yaml_path, [*base, *(f"{c.key}={json.dumps(c.rehearsed)}" for c in candidate.items)],
                        world_size=world)
        except ConfigError:
            continue
        changes.items += candidate.items
        return Rehearsal(world, changes.items)
    # No batch fits: report the config error of the last candidate.
    load_config(yaml_path, [*base, *(f"{c.key}={json.dumps(c.rehearsed)}" for c in candidate.items)], world_size=world)
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------- running and checking


def run_job(config_file: Path, world_size: int, log_file: Path, timeout_s: float) -> None:
    """``torchrun -m launch.main config_file`` on this machine; the job's step lines are echoed."""
    from parallel.state import find_free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    command = [sys.executable, "-m", "launch.torchrun", f"--nproc_per_node={world_size}",
               "--master_addr=127.0.0.1", f"--master_port={find_free_port()}", "-m", "launch.main", str(config_file)]
    deadline = time.monotonic() + timeout_s
    with open(log_file, "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                   start_new_session=True)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            if line.startswith(("step ", "[trident]")):
                print(f"  {line.rstrip()}", flush=True)
            if time.monotonic() > deadline:
                os.killpg(process.pid, 9)
                raise RehearsalError(f"the job ran past --timeout {timeout_s:.0f}s; log {log_file}")
        code = process.wait()
    if code != 0:
        tail = "".join(log_file.read_text().splitlines(keepends=True)[-40:])
        raise RehearsalError(f"the job failed with exit status {code}; log {log_file}, last lines:\n{tail}")


def check_run(run_dir: Path, steps: int, config: ExperimentConfig) -> dict[str, Any]:
    """The checks of a healthy start; returns the last step's key numbers."""
    from engine.sync import expected_log_prob_gap

    metrics_file = run_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise RehearsalError(f"no {metrics_file}: the run logged no step (is 'jsonl' in trainer.logger?)")
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    trained = [row for row in rows if "timing_s/step" in row]
    if [row["step"] for row in trained] != list(range(1, steps + 1)):
        raise RehearsalError(f"steps logged {[row['step'] for row in trained]}, expected 1..{steps}")
    tolerance = expected_log_prob_gap(config.actor_rollout_ref.rollout.dtype,
                                      config.actor_rollout_ref.actor.megatron.param_dtype)
    for row in trained:
        for key in LOSS_KEYS:
            if key in row and (row[key] is None or not math.isfinite(row[key])):
                raise RehearsalError(f"step {row['step']}: {key} = {row[key]} is not finite")
        gap = row.get("rollout/log_prob_abs_diff")
        if gap is None:
            if config.actor_rollout_ref.actor.use_rollout_log_probs:
                continue  # pi_old is the engine's own: nothing recomputed to compare (see plan_rehearsal)
            raise RehearsalError(f"step {row['step']}: no rollout/log_prob_abs_diff was logged")
        if row.get("rollout/staleness/max", 0) > 0:
            continue  # off-policy (trainer.max_staleness): sampled by earlier weights, nothing to compare
        if not gap <= tolerance:
            raise RehearsalError(f"step {row['step']}: the rollout engine's log-probs differ from the trainer's by "
                                 f"{gap:.3g} per token, over the {tolerance} expected at this precision")
    last = trained[-1]
    return {key: last[key] for key in ("timing_s/step", "rollout/log_prob_abs_diff", *LOSS_KEYS) if key in last}


def rehearse(yaml_path: str, overrides: Sequence[str], *, steps: int, max_ranks: int, out_dir: Path,
             timeout_s: float, dry_run: bool = False) -> dict[str, Any]:
    """Plan, build, run and check the rehearsal of ``yaml_path``; returns its report."""
    from launch.plan import PlanError, resolve_architecture

    config = load_config(yaml_path, overrides)  # the experiment as written, at its own size
    try:
        architecture, source = resolve_architecture(config.actor_rollout_ref.model.path, "actor_rollout_ref.model.path")
    except PlanError as error:
        raise ConfigError(str(error)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    layout = _shrunk_layout(config.actor_rollout_ref.actor.megatron)
    stages = layout["pipeline_model_parallel_size"] * (layout["virtual_pipeline_model_parallel_size"] or 1)
    tg = _generation_tp(config.actor_rollout_ref.rollout.tensor_model_parallel_size,
                        config.actor_rollout_ref.actor.megatron.tensor_model_parallel_size,
                        layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"])
    fields = tiny_model_config(architecture, layout["tensor_model_parallel_size"], stages, tg, VOCAB_SIZE,
                               max_positions=2 * (PROMPT_CAP + RESPONSE_CAP),
                               context_parallel=layout["context_parallel_size"])
    model_dir = write_tiny_model(fields, out_dir / "model")

    train_files, val_files = list(config.data.train_files), list(config.data.val_files)
    if not _data_is_here(train_files + val_files):
        if not all("gsm8k" in file.lower() for file in train_files):
            raise ConfigError(f"data.train_files={train_files} are not on this machine and the rehearsal has "
                              "stand-ins only for GSM8K; pass data.train_files=... (and data.val_files) of a "
                              "local sample in the same schema")
        train, val = write_gsm8k_stand_in(out_dir / "data", train_prompts=512, val_prompts=STAND_IN_VAL_PROMPTS)
        train_files, val_files = [str(train)], ([str(val)] if config.data.val_files else [])
    run_dir = out_dir / "run"
    plan = plan_rehearsal(yaml_path, overrides, config, model_dir, (train_files, val_files), run_dir, steps,
                          max_ranks)
    rehearsed = load_config(yaml_path, [*overrides, *plan.overrides()], world_size=plan.world_size)
    config_file = out_dir / "rehearsal.yaml"
    config_file.write_text(to_yaml(rehearsed))
    report: dict[str, Any] = {
        "experiment": yaml_path, "architecture_source": source, "world_size": plan.world_size,
        "model": {key: fields[key] for key in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                                "num_key_value_heads", "tie_word_embeddings", "num_experts",
                                                "num_local_experts", "num_experts_per_tok") if key in fields},
        "changes": [dataclasses.asdict(change) for change in plan.changes],
        "config": str(config_file), "log": str(out_dir / "job.log"),
    }
    (out_dir / "rehearsal.json").write_text(json.dumps(report, indent=2, default=str))
    _print_plan(report)
    if dry_run:
        return report
    started = time.monotonic()
    run_job(config_file, plan.world_size, out_dir / "job.log", timeout_s)
    report["result"] = check_run(run_dir, steps, rehearsed)
    report["seconds"] = round(time.monotonic() - started, 1)
    (out_dir / "rehearsal.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def _print_plan(report: dict[str, Any]) -> None:
    print(f"[rehearse] {report['experiment']} on {report['world_size']} CPU ranks; model "
          f"{report['model']} (family from {report['architecture_source']})", flush=True)
    for change in report["changes"]:
        print(f"  {change['key']}: {change['written']!r} -> {change['rehearsed']!r}  ({change['why']})", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("yaml_path", help="experiment file, e.g. yaml/qwen2.5-7b_gsm8k.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides, applied before shrinking")
    parser.add_argument("--steps", type=int, default=2, help="PPO steps to run (default 2)")
    parser.add_argument("--max-ranks", type=int, default=4, help="most CPU ranks to start (default 4)")
    parser.add_argument("--out", default=None, help="working folder (default: a new temporary folder)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds the job may take (default 1800)")
    parser.add_argument("--dry-run", action="store_true", help="write the model, data and config; print the changes; "
                                                                "do not run the job")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may follow the options
    if args.steps < 1 or args.max_ranks < 1:
        parser.error("--steps and --max-ranks must be >= 1")
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="trident-rehearse-"))
    try:
        report = rehearse(args.yaml_path, args.overrides, steps=args.steps, max_ranks=args.max_ranks,
                          out_dir=out_dir, timeout_s=args.timeout, dry_run=args.dry_run)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        sys.exit(2)
    except RehearsalError as error:
        print(f"[rehearse] FAILED: {error}", file=sys.stderr)
        sys.exit(1)
    if args.dry_run:
        print(f"[rehearse] dry run: the rehearsal's config is {report['config']}", flush=True)
        return
    print(f"[rehearse] passed: {args.steps} steps in {report['seconds']} s; last step {report['result']}; "
          f"report {out_dir / 'rehearsal.json'}", flush=True)


if __name__ == "__main__":
    main()
