"""Every key of the experiment schema is read by the run-time code, or refused as not built yet.

A key that is accepted and then ignored makes a user pay for a run that did something else. The
worker runs ``launch.main`` on the demo model in several scenarios that between them take every
branch a key can steer (critic or not, KL in the reward or as a loss, fixed or token-budget
micro-batches, validation sampling, resume from a path, epochs instead of steps, validation only,
the SGLang engine), and records every read of a config field made outside loading and checking.
"""
from __future__ import annotations

import json

import pytest
import pyarrow.parquet as pq

from engine.config.loader import all_keys, section_class, type_of_key
from engine.config.validation import NOT_BUILT
from parallel.state import find_free_port
from tests.distributed import run_torchrun
from tests.rollout_support import requires_sglang

pytestmark = [pytest.mark.dist, pytest.mark.slow]


# Keys only the SGLang engine reads (checked by the test that starts one, with the SGLang tier).
SGLANG_ONLY = tuple(f"actor_rollout_ref.rollout.{key}" for key in (
    "gpu_memory_utilization", "startup_timeout_s", "request_timeout_s", "weight_update_timeout_s",
    "check_weight_sync_tolerance", "num_gpus", "server_addresses", "max_server_restarts", "weight_sync_target"))


def judge_keys() -> set[str]:
    """Keys only the LLM judge reads (checked by the SGLang test, which also starts a judge server)."""
    return {key for key in leaf_keys() if key.startswith("reward_model.judge.") and key != "reward_model.judge.enable"
            } | {"reward_model.combine.judge_weight"}


def leaf_keys() -> set[str]:
    return {key for key in all_keys() if section_class(type_of_key(key)) is None}


# A user reward function: the built-in score, failing on odd-length answers (so the failure guard counts).
REWARD_FILE = """
from engine.rewards import default_compute_score


def sometimes_failing(data_source, solution_str, ground_truth, extra_info=None):
    if len(solution_str) % 2:
        raise ValueError("odd")
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""


def scenarios(tmp_path, demo_model) -> list[str]:
    from tests.test_reward_model import save_tiny_reward_models

    reward_model = save_tiny_reward_models(tmp_path)[0]  # its own chat template: the conversations are re-tokenized
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    small = tmp_path / "small.parquet"
    pq.write_table(pq.read_table(demo_model.train_file).slice(0, 32), small)
    run = tmp_path / "runs"
    tools, interaction = tmp_path / "tools.yaml", tmp_path / "interaction.yaml"
    tools.write_text("tools:\n  - class_name: engine.rollout.agentic.tools.CalculatorTool\n")
    interaction.write_text("interaction:\n  - name: ask_again\n    class_name: tests.agentic_support.AskAgain\n")
    common = ["trainer.n_gpus_per_node=1", "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.save_freq=1", "trainer.test_freq=1",
              "trainer.max_ckpt_to_keep=1", "data.val_batch_size=64"]
    gae = [*common, f"trainer.default_local_dir={run}/gae", "trainer.total_training_steps=2",
           "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "critic.warmup_steps=1",
           "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
           "actor_rollout_ref.rollout.check_weight_sync=true", "actor_rollout_ref.rollout.val_kwargs.n=2",
           "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.top_k=20",
           "reward_model.enable=true", f"reward_model.model.path={reward_model}", "reward_model.combine.model_weight=0.1",
           "reward_model.combine.normalize_model_score=true", "reward_model.combine.model_score_clip=3",
           "reward_model.combine.reward_clip=2", "algorithm.rollout_correction.rollout_is=sequence",
           "algorithm.rollout_correction.rollout_rs=geometric", "algorithm.rollout_correction.rollout_rs_threshold=1.5",
           "algorithm.rollout_correction.rollout_rs_threshold_lower=0.5",
           "reward_model.combine.mode=gated", "reward_model.combine.gate_threshold=0.5",
           # multi-turn: a user who asks again (the calculator is offered; this model never calls it)
           "actor_rollout_ref.rollout.multi_turn.enable=true", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
           f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={interaction}",
           "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "actor_rollout_ref.rollout.multi_turn.max_user_turns=1",
           "actor_rollout_ref.rollout.multi_turn.format=hermes", "data.max_response_length=16"]
    grpo = [*common, f"trainer.default_local_dir={run}/grpo", f"data.train_files={small}", "trainer.total_epochs=1",
            "trainer.total_training_steps=null", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.rollout.top_p=0.9",
            "actor_rollout_ref.actor.use_rollout_log_probs=true",
            f"reward_model.custom_reward_function.path={reward_file}",
            "reward_model.custom_reward_function.name=sometimes_failing", "reward_model.max_failed_fraction=0.01",
            "reward_model.max_failed_steps=1000",
            # DAPO: dynamic sampling (more rounds than one, almost surely) and the overlong penalty
            "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
            "algorithm.filter_groups.max_num_gen_batches=50", "reward_model.overlong_buffer.enable=true",
            "reward_model.overlong_buffer.len=4", "reward_model.overlong_buffer.penalty_factor=0.5",
            # LoRA: the reference is the actor with its adapters off (use_kl_loss)
            "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
            "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]"]
    resumed = [*gae, "trainer.total_training_steps=3", "trainer.resume_mode=resume_path",
               f"trainer.resume_from_path={run}/gae/checkpoints/step_2", "trainer.val_before_train=false"]
    val_only = [*common, f"trainer.default_local_dir={run}/val", "trainer.val_only=true", "reward_model.num_workers=1"]
    return [f"{name}|{';'.join(overrides)}" for name, overrides in
            (("gae", gae), ("grpo", grpo), ("resume", resumed), ("val_only", val_only))]


def read_keys(tmp_path, runs: list[str]) -> set[str]:
    out = tmp_path / "read.json"
    run_torchrun("config_liveness.py", 1, [str(out), *runs], timeout=1200)
    return set(json.loads(out.read_text()))


def test_every_key_is_read_at_run_time_or_refused(demo_model, tmp_path):
    read = read_keys(tmp_path, scenarios(tmp_path, demo_model))
    unread = leaf_keys() - read - set(NOT_BUILT) - set(SGLANG_ONLY) - judge_keys()
    assert not unread, f"schema keys no run-time code read: {sorted(unread)}"


@pytest.mark.sglang
@requires_sglang
def test_sglang_keys_are_read(demo_model, tmp_path):
    run = [f"sglang|trainer.n_gpus_per_node=1;data.train_batch_size=8;actor_rollout_ref.actor.ppo_mini_batch_size=8;"
           f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8;trainer.total_training_steps=1;"
           f"trainer.val_before_train=false;trainer.export_hf_at_end=false;trainer.default_local_dir={tmp_path}/run;"
           # Disaggregated, then colocated (which reads only weight_sync_target beyond this one).
           f"actor_rollout_ref.rollout.name=sglang;actor_rollout_ref.rollout.mode=disaggregated;"
           f"actor_rollout_ref.rollout.num_gpus=1;actor_rollout_ref.rollout.check_weight_sync=true;"
           f"actor_rollout_ref.rollout.gpu_memory_utilization=0.05;trainer.prometheus_port={find_free_port()};"
           f"reward_model.judge.enable=true;reward_model.judge.model.path={demo_model.model_dir};"
           f"reward_model.judge.model.dtype=float32;reward_model.judge.fallback_score=0;"
           # The demo model answers this with a number (its task), so replies parse.
           f"reward_model.judge.prompt_template='{{prompt}} {{response}}';reward_model.judge.max_score=200"]
    # Colocated, one step: how the weights reach the server's TP workers (weight_sync_target).
    run.append(f"sglang|trainer.n_gpus_per_node=1;data.train_batch_size=8;actor_rollout_ref.actor.ppo_mini_batch_size=8;"
               f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8;trainer.total_training_steps=1;"
               f"trainer.val_before_train=false;trainer.export_hf_at_end=false;trainer.default_local_dir={tmp_path}/colocated;"
               f"actor_rollout_ref.rollout.name=sglang;actor_rollout_ref.rollout.gpu_memory_utilization=0.05")
    read = read_keys(tmp_path, run)
    assert set(SGLANG_ONLY) | judge_keys() <= read, (set(SGLANG_ONLY) | judge_keys()) - read
    # With Prometheus on, the server exports its own metrics, listed beside the trainer's.
    target = json.loads(next((tmp_path / "run" / "prometheus").glob("sglang_*.json")).read_text())
    assert target[0]["labels"]["job"] == "sglang"
    assert "--enable-metrics" in (tmp_path / "run" / "rollout" / "sglang_replica0.log").read_text()


def test_not_built_keys_are_schema_keys():
    assert set(NOT_BUILT) <= leaf_keys(), set(NOT_BUILT) - leaf_keys()
