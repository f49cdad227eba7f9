"""engine.config: every class of mistake is one ConfigError whose message names the key and the fix."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.algo import registry
from engine.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "yaml" / "demo_cpu.yaml"
QWEN_7B = REPO / "yaml" / "qwen2.5-7b_gsm8k.yaml"


@pytest.fixture
def model_dir(tmp_path):
    """A model folder whose config.json has SmolLM2-135M's shape: 9 heads, 3 KV heads, 30 layers."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30}))
    return str(folder)


def error_of(path, overrides=(), world_size=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), world_size)
    message = str(info.value)
    assert "\n\n" not in message and "Traceback" not in message
    return message


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "experiment.yaml"
    path.write_text(text)
    return path


MINIMAL = "data:\n  train_files: prompts.parquet\nactor_rollout_ref:\n  model:\n    path: m\n  actor:\n" \
          "    ppo_micro_batch_size_per_gpu: 4\n"


# ----------------------------------------------------------------------------- unknown keys


def test_unknown_key_in_file_names_file_line_and_closest_key(tmp_path):
    path = write(tmp_path, MINIMAL + "trainer:\n  n_gpus_per_node: 8\n  total_epoch: 3\n")
    message = error_of(path)
    assert "'trainer.total_epoch'" in message
    assert f"{path}, line 10" in message
    assert "Did you mean 'trainer.total_epochs'?" in message


def test_unknown_key_in_override_suggests_typo_fix():
    message = error_of(DEMO, ["actor_rollout_ref.actor.ppo_mini_batchsize=4"])
    assert "'actor_rollout_ref.actor.ppo_mini_batchsize'" in message
    assert "override 'actor_rollout_ref.actor.ppo_mini_batchsize=4'" in message
    assert "Did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'?" in message


def test_key_in_the_wrong_section_points_to_the_right_one():
    message = error_of(DEMO, ["actor_rollout_ref.rollout.ppo_epochs=2"])
    assert "Did you mean 'actor_rollout_ref.actor.ppo_epochs'?" in message
    message = error_of(DEMO, ["actor.clip_ratio=0.1"])
    assert "Unknown config key 'actor'" in message and "'actor_rollout_ref.actor'" in message


def test_verl_names_map_to_ours():
    message = error_of(DEMO, ["actor_rollout_ref.actor.grad_clip=1.0"])
    assert "Did you mean 'actor_rollout_ref.actor.optim.max_grad_norm'" in message
    message = error_of(DEMO, ["actor_rollout_ref.rollout.response_length=128"])
    assert "'data.max_response_length'" in message


# ----------------------------------------------------------------------------- types and syntax


@pytest.mark.parametrize("override, key, given, expected", [
    ("data.train_batch_size=0.5", "'data.train_batch_size'", "got 0.5", "expected an integer"),
    ("data.train_batch_size=many", "'data.train_batch_size'", "got 'many'", "expected an integer"),
    ("actor_rollout_ref.actor.optim.lr=fast", "'actor_rollout_ref.actor.optim.lr'", "got 'fast'", "expected a number"),
    ("data.shuffle=maybe", "'data.shuffle'", "got 'maybe'", "expected true or false"),
    ("actor_rollout_ref.actor.optim.betas=0.9", "'actor_rollout_ref.actor.optim.betas'", "got 0.9",
     "expected a list of numbers"),
    ("actor_rollout_ref.actor.optim.betas=[0.9,high]", "'actor_rollout_ref.actor.optim.betas[1]'", "got 'high'",
     "expected a number"),
    ("data.max_prompt_length=null", "'data.max_prompt_length'", "got None", "expected an integer"),
])
def test_wrong_type_names_key_value_and_expected_type(override, key, given, expected):
    message = error_of(DEMO, [override])
    assert message.startswith(f"Wrong type for {key}")
    assert given in message and expected in message and f"override {override!r}" in message


def test_wrong_type_in_file(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "trainer:\n  nnodes: two\n"))
    assert "'trainer.nnodes'" in message and "got 'two'" in message and "an integer" in message


def test_section_given_a_value():
    message = error_of(DEMO, ["trainer=5"])
    assert "trainer is a section" in message and "trainer.KEY=VALUE" in message and "n_gpus_per_node" in message


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "data:\n  train_files: [a.parquet\ntrainer:\n  nnodes: 1\n")
    message = error_of(path)
    assert message.startswith(f"YAML syntax error in {path}, line 3")


def test_duplicate_key_is_a_syntax_error(tmp_path):
    message = error_of(write(tmp_path, MINIMAL + "trainer:\n  nnodes: 1\n  nnodes: 2\n"))
    assert "YAML syntax error" in message and "line 10" in message and "duplicate key nnodes" in message


def test_malformed_overrides():
    assert "not of the form dotted.key=value" in error_of(DEMO, ["data.train_batch_size"])
    assert "Hydra prefixes" in error_of(DEMO, ["+trainer.seed=3"])
    assert "not valid YAML" in error_of(DEMO, ["actor_rollout_ref.actor.optim.betas=[0.9,"])


def test_missing_file_lists_the_experiments():
    message = error_of(REPO / "yaml" / "demo.yaml")
    assert "does not exist" in message and "demo_cpu.yaml" in message


def test_empty_section_means_defaults(tmp_path):
    config = load_config(write(tmp_path, MINIMAL + "critic:\n  # nothing set yet\ntrainer:\n  n_gpus_per_node: 2\n"))
    assert config.critic.optim.lr == 1e-5 and config.trainer.n_gpus_per_node == 2


def test_required_key_missing(tmp_path):
    message = error_of(write(tmp_path, "data:\n  train_files: prompts.parquet\n"))
    assert "'actor_rollout_ref.model.path' is required" in message


def test_bad_interpolation():
    message = error_of(DEMO, ["trainer.default_local_dir=runs/${trainer.no_such_key}"])
    assert "'trainer.default_local_dir'" in message and "no_such_key" in message


def test_section_post_init_check_becomes_config_error():
    assert "reward_model.num_workers=-1" in error_of(DEMO, ["reward_model.num_workers=-1"])


# ----------------------------------------------------------------------------- layouts


def test_world_size_not_divisible_by_model_parallel_size():
    message = error_of(DEMO, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                              "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                              "trainer.n_gpus_per_node=6"], world_size=6)
    assert "actor_rollout_ref.actor.megatron" in message
    assert "world_size = tp * pp * cp * dp" in message and "6 / (2 * 2 * 1)" in message


def test_expert_tensor_parallel_size_must_divide_tp_and_fit_the_stage():
    tp2 = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"]
    message = error_of(DEMO, tp2 + ["actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=4"], world_size=2)
    assert message.startswith("actor_rollout_ref.actor.megatron: expert_tensor_parallel_size=4 must divide "
                              "tensor_model_parallel_size=2 (expert TP larger than TP is not built)"), message
    message = error_of(DEMO, tp2 + ["actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
                                    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=4"], world_size=2)
    assert ("expert_tensor_parallel_size (1) x expert_model_parallel_size (4) must divide the 2 ranks of a "
            "pipeline stage") in message, message


def test_critic_layout_checked_when_gae_uses_it():
    overrides = ["critic.megatron.tensor_model_parallel_size=2"]
    message = error_of(DEMO, overrides)
    assert message.startswith("critic.megatron's layout tp2,pp1,sp differs from the actor's tp1,pp1")
    assert "one mesh" in message
    # GRPO has no critic: its layout is not checked.
    load_config(DEMO, overrides + ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"])


def test_heads_not_divisible_by_tensor_parallel_size(model_dir):
    message = error_of(DEMO, [f"actor_rollout_ref.model.path={model_dir}",
                              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], world_size=2)
    assert "tensor_model_parallel_size=2" in message
    assert "num_attention_heads=9" in message and "num_key_value_heads=3" in message
    assert "Valid TP sizes for this model: 1, 3" in message


def test_kv_heads_not_divisible_by_tensor_parallel_size(tmp_path):
    folder = tmp_path / "gqa"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(
        {"num_attention_heads": 12, "num_key_value_heads": 2, "num_hidden_layers": 4}))
    message = error_of(DEMO, [f"actor_rollout_ref.model.path={folder}",
                              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                              "trainer.n_gpus_per_node=4"], world_size=4)
    assert "num_key_value_heads=2" in message and "Valid TP sizes for this model: 1, 2" in message


def test_layers_not_divisible_by_pipeline_times_virtual_pipeline(model_dir):
    message = error_of(DEMO, [f"actor_rollout_ref.model.path={model_dir}",
                              "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                              "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
                       world_size=2)
    assert "num_hidden_layers=30" in message and "2 x 2 = 4" in message


def test_virtual_pipeline_needs_pipeline():
    message = error_of(DEMO, ["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"])
    assert "virtual_pipeline_model_parallel_size > 1 needs pipeline_model_parallel_size > 1" in message


def test_head_checks_skipped_without_config_json():
    load_config(DEMO, ["actor_rollout_ref.model.path=/nonexistent/model",
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                       "critic.megatron.tensor_model_parallel_size=2"], world_size=2)


# ----------------------------------------------------------------------------- batch sizes

# The numbers the messages below quote, pinned so a retuned demo yaml does not move them.
PINNED = ["actor_rollout_ref.actor.ppo_mini_batch_size=16", "data.max_response_length=16"]


def test_batch_not_divisible_by_data_parallel_size():
    message = error_of(DEMO, ["data.train_batch_size=9"], world_size=2)
    assert "data.train_batch_size=9 prompts must split evenly" in message and "dp = 2" in message


def test_batch_not_divisible_by_mini_batch():
    message = error_of(DEMO, [*PINNED, "data.train_batch_size=24"], world_size=2)
    assert "data.train_batch_size=24" in message and "ppo_mini_batch_size=16" in message


def test_mini_batch_not_divisible_by_micro_batch_times_data_parallel():
    message = error_of(DEMO, [*PINNED, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], world_size=2)
    assert "16 * 1 = 16 sequences per mini-batch" in message and "3 * 2 = 6" in message


def test_rollout_n_multiplies_the_mini_batch():
    # Micro-batches of 24 on each of 2 ranks (48) do not divide a mini-batch of 16 prompts x n=1, but do with n=3.
    micro = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=24"
    message = error_of(DEMO, [*PINNED, micro, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"])
    assert "16 * 1 = 16 sequences" in message and "24 * 2 = 48" in message
    load_config(DEMO, [*PINNED, micro, "actor_rollout_ref.rollout.n=3"])


def test_critic_batches_checked_with_critic_data_parallel_size():
    message = error_of(DEMO, [*PINNED, "critic.ppo_micro_batch_size_per_gpu=16"], world_size=2)
    assert message.startswith("critic.ppo_mini_batch_size * actor_rollout_ref.rollout.n = 16 * 1 = 16")


def test_interleaved_pipeline_needs_a_multiple_of_pp_micro_batches():
    vpp = ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
           "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
           "critic.megatron.pipeline_model_parallel_size=2", "critic.megatron.virtual_pipeline_model_parallel_size=2"]
    # 1 rank (dp 1): 16 sequences per mini-batch in micro-batches of 16 is one micro-batch, not a multiple of 2.
    message = error_of(DEMO, [*PINNED, *vpp, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"], world_size=2)
    assert message.startswith("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 over a mini-batch of 16")
    assert "makes 1 micro-batches per rank" in message and "pipeline_model_parallel_size=2" in message
    # The log-prob pass: 64 rows in micro-batches of 40 -> 2 micro-batches; of 64 -> 1.
    message = error_of(DEMO, [*PINNED, *vpp, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64"],
                       world_size=2)
    assert message.startswith("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64 over 64 sequences")
    load_config(DEMO, [*PINNED, *vpp, "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40"], world_size=2)
    # Token-budget batching: at least pp sequences per rank in every mini-batch.
    dynamic = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true"]
    message = error_of(DEMO, [*vpp, *dynamic, "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                              "critic.ppo_mini_batch_size=1"], world_size=2)
    assert "gives each rank 1 sequences" in message and "at least pipeline_model_parallel_size=2" in message


def test_micro_batch_required_without_dynamic_batching(tmp_path):
    message = error_of(DEMO, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"])
    assert "ppo_micro_batch_size_per_gpu is not set" in message and "use_dynamic_bsz=true" in message


def test_dynamic_token_budget_must_hold_one_sequence():
    message = error_of(DEMO, [*PINNED, "actor_rollout_ref.actor.use_dynamic_bsz=true",
                              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=50"])
    assert "ppo_max_token_len_per_gpu=50" in message and "64 + 16 = 80" in message


# ----------------------------------------------------------------------------- rollout


def test_generation_tp_must_divide_training_model_parallel_size():
    message = error_of(QWEN_7B, ["actor_rollout_ref.rollout.tensor_model_parallel_size=8"], world_size=8)
    assert "tensor_model_parallel_size=8" in message and "tp * pp = 4 * 1 = 4" in message
    assert "1, 2, 4" in message


def test_generation_heads_divisible_by_generation_tp(model_dir):
    message = error_of(DEMO, [f"actor_rollout_ref.model.path={model_dir}",
                              "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
                              "critic.megatron.pipeline_model_parallel_size=2",
                              "actor_rollout_ref.rollout.name=sglang",
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], world_size=2)
    assert "rollout.tensor_model_parallel_size=2" in message and "num_attention_heads=9" in message


def test_torch_engine_has_no_tensor_parallelism():
    message = error_of(DEMO, ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                              "critic.megatron.tensor_model_parallel_size=2",
                              "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                              "actor_rollout_ref.model.path=/nonexistent"], world_size=2)
    assert "name=torch" in message and "tensor_model_parallel_size=1" in message


def test_features_not_built_yet_are_refused():
    assert "critic.model.lora_rank=8: LoRA is built for the actor only" in error_of(DEMO, ["critic.model.lora_rank=8"])


def test_lora_target_modules_checked():
    assert "actor_rollout_ref.model.target_modules: megatron fuses gate_proj, up_proj into one layer" in error_of(
        DEMO, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[gate_proj,o_proj]"])
    assert "actor_rollout_ref.model.target_modules=5: a module name, 'all-linear' or a list of names" in error_of(
        DEMO, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=5"])
    assert "unknown module 'lm_head'" in error_of(
        DEMO, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=lm_head"])
    assert "actor_rollout_ref.model.lora_alpha=0: must be > 0" in error_of(
        DEMO, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=0"])
    assert "ref.megatron.param_offload=True: must be false with LoRA: the reference is the actor" in error_of(
        DEMO, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.ref.megatron.param_offload=true"])


def test_removed_keys_say_why():
    message = error_of(DEMO, ["critic.model.tokenizer_path=x"])
    assert "'critic.model.tokenizer_path'" in message and "does not exist here" in message
    assert "scores the actor's token ids" in message


def test_the_device_key_takes_verls_values_and_ours():
    assert load_config(DEMO, ["trainer.device=cuda"]).trainer.device == "cuda"  # verl's default, carried over
    assert load_config(DEMO, []).trainer.device == "auto"
    message = error_of(DEMO, ["trainer.device=npu"])
    assert "trainer.device='npu' is not a valid choice" in message and "auto, cuda, cpu" in message


def test_disaggregated_rollout_settings():
    assert "rollout.num_gpus=2: must be 0 with actor_rollout_ref.rollout.mode=colocated" in error_of(
        DEMO, ["actor_rollout_ref.rollout.num_gpus=2"])
    disaggregated = ["actor_rollout_ref.rollout.mode=disaggregated"]
    assert "rollout.name='torch': must be 'sglang'" in error_of(
        DEMO, disaggregated + ["actor_rollout_ref.rollout.num_gpus=1"])
    assert "rollout.num_gpus=0: must be a positive multiple of" in error_of(
        DEMO, disaggregated + ["actor_rollout_ref.rollout.name=sglang"])
    assert "rollout.num_gpus=3: must be a positive multiple of actor_rollout_ref.rollout.tensor_model_parallel_size=2" \
        in error_of(QWEN_7B, disaggregated + ["actor_rollout_ref.rollout.num_gpus=3"])
    assert "trainer.nnodes=2: must be 1 with actor_rollout_ref.rollout.mode=disaggregated and num_gpus" in error_of(
        QWEN_7B, disaggregated + ["actor_rollout_ref.rollout.num_gpus=4", "trainer.nnodes=2"], world_size=16)
    # Servers on nodes of their own: any number of trainer nodes, no GPUs of this job, host:port each.
    external = disaggregated + ["actor_rollout_ref.rollout.server_addresses=[10.0.0.5:30000,10.0.0.6:30000]"]
    load_config(QWEN_7B, external + ["trainer.nnodes=2"], world_size=16)
    assert "rollout.server_addresses=['10.0.0.5:30000']: must be empty with actor_rollout_ref.rollout.mode=colocated" \
        in error_of(QWEN_7B, ["actor_rollout_ref.rollout.server_addresses=[10.0.0.5:30000]"])
    assert "rollout.num_gpus=2: must be 0 with actor_rollout_ref.rollout.server_addresses" in error_of(
        QWEN_7B, external + ["actor_rollout_ref.rollout.num_gpus=2"])
    assert "must be 'host:port' entries (got '10.0.0.5')" in error_of(
        QWEN_7B, disaggregated + ["actor_rollout_ref.rollout.server_addresses=[10.0.0.5]"])


# ----------------------------------------------------------------------------- choices


@pytest.mark.parametrize("key, kind", [
    ("algorithm.adv_estimator", "adv_estimator"),
    ("algorithm.kl_penalty", "kl_estimator"),
    ("actor_rollout_ref.actor.kl_loss_type", "kl_estimator"),
    ("algorithm.kl_ctrl.type", "kl_controller"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "policy_loss"),
    ("actor_rollout_ref.actor.loss_agg_mode", "loss_agg_mode"),
    ("critic.loss_agg_mode", "loss_agg_mode"),
])
def test_algorithm_names_come_from_the_registry(key, kind):
    message = error_of(DEMO, [f"{key}=no-such-thing"])
    assert message.startswith(f"{key}='no-such-thing' is not a valid choice")
    assert f"Valid values: {', '.join(registry.names(kind))}." in message


def test_misspelled_choice_gets_a_suggestion():
    assert "Did you mean 'gae'?" in error_of(DEMO, ["algorithm.adv_estimator=gea"])
    assert "Did you mean 'sglang'?" in error_of(DEMO, ["actor_rollout_ref.rollout.name=sglng"])
    assert "trainer.logger[1]='wandbb' is not a valid choice. Did you mean 'wandb'?" in error_of(
        DEMO, ["trainer.logger=[console,wandbb]"])


def test_group_estimator_needs_several_samples_per_prompt():
    message = error_of(DEMO, ["algorithm.adv_estimator=grpo"])
    assert "actor_rollout_ref.rollout.n=1" in message and "2 or more" in message
    load_config(DEMO, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"])


@pytest.mark.parametrize("override, fragment", [
    ("actor_rollout_ref.actor.clip_ratio_c=0.5", "clip_ratio_c=0.5: must be > 1"),
    ("actor_rollout_ref.actor.megatron.moe_aux_loss_coeff=-0.1", "moe_aux_loss_coeff=-0.1: must be >= 0"),
    ("critic.megatron.use_distributed_optimizer=false critic.megatron.overlap_param_gather=true",
     "critic.megatron.overlap_param_gather=True: must be false or null with critic.megatron.use_distributed_optimizer=false"),
    ("algorithm.lam=1.5", "algorithm.lam=1.5: must be in [0, 1]"),
    ("critic.megatron.moe_router_replay=true", "router replay is built for the actor's passes"),
    ("actor_rollout_ref.actor.megatron.moe_router_replay=true actor_rollout_ref.model.enable_gradient_checkpointing=true "
     "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
     "moe_router_replay=True: must be false with actor_rollout_ref.model.enable_gradient_checkpointing=true and "
     "pipeline parallelism"),
    ("actor_rollout_ref.rollout.top_p=0", "top_p=0.0: must be in (0, 1]"),
    ("actor_rollout_ref.actor.optim.betas=[0.9]", "betas=[0.9]: must be two numbers"),
    ("trainer.save_freq=0", "trainer.save_freq=0: must be -1 (only at the end) or >= 1"),
    ("trainer.resume_mode=resume_path", "needs trainer.resume_from_path"),
])
def test_out_of_range_values(override, fragment):
    assert fragment in error_of(DEMO, override.split())


def test_rollout_log_probs_as_old_leave_nothing_for_the_sglang_weight_check():
    reuse, check = "actor_rollout_ref.actor.use_rollout_log_probs=true", "actor_rollout_ref.rollout.check_weight_sync=true"
    message = error_of(DEMO, [reuse, check, "actor_rollout_ref.rollout.name=sglang"])
    assert "actor_rollout_ref.actor.use_rollout_log_probs=True: must be false with" in message
    assert "check_weight_sync" in message
    load_config(DEMO, [reuse, check])  # the embedded engine checks weights by fingerprints instead


def test_validation_only_needs_validation_prompts():
    message = error_of(DEMO, ["trainer.val_only=true", "data.val_files=[]"])
    assert message == "trainer.val_only=true needs data.val_files (the prompts to validate on)."


# ----------------------------------------------------------------------------- entry point


def test_cli_prints_the_message_and_exits_2_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "engine.config.cli", str(DEMO), "actor_rollout_ref.actor.ppo_mini_batchsize=4"],
        capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.startswith("config error: Unknown config key 'actor_rollout_ref.actor.ppo_mini_batchsize'")


def test_max_staleness_needs_servers_that_generate_while_training():
    assert "trainer.max_staleness=-1: must be >= 0" in error_of(DEMO, ["trainer.max_staleness=-1"])
    assert "generation cannot overlap training" in error_of(DEMO, ["trainer.max_staleness=2"])
    assert "partial_rollout=True: must be false with trainer.max_staleness=0" in error_of(
        DEMO, ["actor_rollout_ref.rollout.partial_rollout=true"])
    off_policy = ["trainer.max_staleness=1", "actor_rollout_ref.rollout.mode=disaggregated",
                  "actor_rollout_ref.rollout.num_gpus=2"]
    assert "check_weight_sync=True: must be false with trainer.max_staleness=1" in error_of(
        QWEN_7B, [*off_policy, "actor_rollout_ref.rollout.check_weight_sync=true"])
    assert "adv_estimator=remax" in error_of(QWEN_7B, [*off_policy, "algorithm.adv_estimator=remax"])


def test_rollout_correction_settings():
    key = "algorithm.rollout_correction"
    assert f"{key}.rollout_is='tokens': must be null or one of ['token', 'sequence']" in error_of(
        DEMO, [f"{key}.rollout_is=tokens"])
    assert f"{key}.rollout_rs='seq': must be null or one of" in error_of(DEMO, [f"{key}.rollout_rs=seq"])
    assert f"{key}.rollout_is_threshold=0.5: must be >= 1" in error_of(
        DEMO, [f"{key}.rollout_is=token", f"{key}.rollout_is_threshold=0.5"])
    assert f"{key}.rollout_is_threshold=0.0: must be >= 1" in error_of(DEMO, [f"{key}.rollout_is_threshold=0"])
    assert f"{key}.rollout_rs_threshold=0.0: must be >= 1 or null (a ratio of 1" in error_of(
        DEMO, [f"{key}.rollout_rs=sequence", f"{key}.rollout_rs_threshold=0"])
    assert f"{key}.rollout_rs_threshold=0.9: must be >= 1" in error_of(
        DEMO, [f"{key}.rollout_rs=geometric", f"{key}.rollout_rs_threshold=0.9"])
    assert f"{key}.rollout_rs_threshold_lower=3.0: must be in (0, 1] or null" in error_of(  # above the upper 2.0
        DEMO, [f"{key}.rollout_rs=token", f"{key}.rollout_rs_threshold_lower=3"])
    assert f"{key}.rollout_rs_threshold_lower=-0.5: must be in (0, 1]" in error_of(
        DEMO, [f"{key}.rollout_rs=token", f"{key}.rollout_rs_threshold_lower=-0.5"])
    message = error_of(DEMO, [f"{key}.rollout_is=token", "actor_rollout_ref.actor.use_rollout_log_probs=true"])
    assert "use_rollout_log_probs=True: must be false with algorithm.rollout_correction" in message
    assert "silently do nothing" in message


# ----------------------------------------------------------------------------- what users paste


def test_a_tab_in_the_yaml_says_tab(tmp_path):
    message = error_of(write(tmp_path, "data:\n\ttrain_batch_size: 8\n"))
    assert "line 2, column 1" in message and "tab character" in message and "spaces" in message


def test_verl_strategy_megatron_is_accepted_and_fsdp_refused(tmp_path):
    config = load_config(DEMO, ["actor_rollout_ref.actor.strategy=megatron", "critic.strategy=megatron"])
    assert config.actor_rollout_ref.actor.megatron.tensor_model_parallel_size == 1
    for key in ("actor_rollout_ref.actor.strategy", "critic.strategy", "actor_rollout_ref.ref.strategy"):
        for backend in ("fsdp", "fsdp2"):
            message = error_of(DEMO, [f"{key}={backend}"])
            assert f"{key}='{backend}'" in message and "only training backend is Megatron" in message
    path = write(tmp_path, MINIMAL.replace("  actor:\n", "  actor:\n    strategy: fsdp\n"))
    assert "actor_rollout_ref.actor.strategy='fsdp'" in error_of(path)


def test_the_seed_recipes_checkpoint_interval_is_save_freq(tmp_path):
    assert load_config(DEMO, ["trainer.checkpoint.every_n_steps=7"]).trainer.save_freq == 7
    path = write(tmp_path, MINIMAL + "trainer:\n  checkpoint:\n    every_n_steps: 5\n")
    assert load_config(path, world_size=8).trainer.save_freq == 5
    both = write(tmp_path, MINIMAL + "trainer:\n  save_freq: 3\n  checkpoint:\n    every_n_steps: 5\n")
    message = error_of(both, world_size=8)
    assert "trainer.checkpoint.every_n_steps=5" in message and "trainer.save_freq=3" in message
    # any other key under trainer.checkpoint is refused, naming the keys there are
    message = error_of(DEMO, ["trainer.checkpoint.keep=3"])
    assert "Unknown config key 'trainer.checkpoint.keep'" in message and "under 'trainer.checkpoint': async_save" in message
    assert load_config(DEMO, ["trainer.checkpoint.async_save=true", "trainer.checkpoint.every_n_steps=2"]).trainer \
        .checkpoint.async_save


def test_verls_actor_and_critic_checkpoint_counts_are_the_number_of_checkpoints_kept():
    assert load_config(DEMO, ["trainer.max_actor_ckpt_to_keep=2"]).trainer.max_ckpt_to_keep == 2
    assert load_config(DEMO, ["trainer.max_critic_ckpt_to_keep=3"]).trainer.max_ckpt_to_keep == 3
    both = ["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=2"]
    assert load_config(DEMO, both).trainer.max_ckpt_to_keep == 2
    # one override sets both spellings of one setting to different numbers: refused, saying why
    message = error_of(DEMO, ["trainer={max_actor_ckpt_to_keep: 2, max_critic_ckpt_to_keep: 5}"])
    assert "trainer.max_critic_ckpt_to_keep=5 and trainer.max_actor_ckpt_to_keep=2" in message, message
    assert "holds the actor and the critic together" in message


def test_sglang_missing_from_the_venv_says_how_to_install_it(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else find_spec(name, *a))
    message = error_of(DEMO, ["actor_rollout_ref.rollout.name=sglang"])
    assert "actor_rollout_ref.rollout.name='sglang'" in message and "not installed" in message
    assert "pip install -e '.[gpu]'" in message and "make sglang" in message
    load_config(DEMO)  # the embedded engine needs no SGLang


def test_prompts_must_split_over_data_parallel_ranks_not_only_their_samples():
    """1 prompt x 4 samples on 2 data-parallel ranks: the sampler splits prompts, so it is refused
    here with the numbers, not at the first step with a traceback."""
    message = error_of(DEMO, ["data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                              "critic.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.n=4",
                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                              "critic.ppo_micro_batch_size_per_gpu=2"])
    assert "data.train_batch_size=1 prompts must split evenly" in message and "dp = 2" in message


def test_weight_sync_modes_are_checked_by_name():
    assert "weight_sync_target='shard' is not a valid choice. Did you mean 'sharded'?" in error_of(
        DEMO, ["actor_rollout_ref.rollout.weight_sync_target=shard"])
    assert "lora_sync='adapter' is not a valid choice. Did you mean 'adapters'?" in error_of(
        DEMO, ["actor_rollout_ref.rollout.lora_sync=adapter"])
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.lora_sync=adapters"]
    assert "lora_sync='adapters': must be merged without LoRA" in error_of(
        DEMO, ["actor_rollout_ref.rollout.lora_sync=adapters"])
    assert "with actor_rollout_ref.rollout.name='torch-process'" in error_of(
        DEMO, [*lora, "actor_rollout_ref.rollout.name=torch-process"])
    assert "servers of their own (mode=disaggregated)" in error_of(
        DEMO, [*lora, "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.mode=disaggregated",
               "actor_rollout_ref.rollout.num_gpus=1"])


# ----------------------------------------------------------------------------- context parallelism

ULYSSES = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
CP = "actor_rollout_ref.actor.megatron.context_parallel_size"
COMM = "actor_rollout_ref.actor.megatron.cp_comm_type"


def test_the_ulysses_key_is_context_parallelism_with_the_all_to_all():
    config = load_config(DEMO, [f"{ULYSSES}=2"])
    for megatron in (config.actor_rollout_ref.actor.megatron, config.critic.megatron, config.reward_model.megatron):
        assert (megatron.context_parallel_size, megatron.cp_comm_type) == (2, "a2a")
    assert load_config(DEMO, [f"{ULYSSES}=2", f"{CP}=2"]).actor_rollout_ref.actor.megatron.cp_comm_type == "a2a"
    message = error_of(DEMO, [f"{ULYSSES}=2", f"{CP}=4"])
    assert f"{ULYSSES}=2" in message and f"{CP}" in message and "set to 4" in message
    message = error_of(DEMO, [f"{ULYSSES}=2", f"{COMM}=all_gather"])
    assert f"{ULYSSES}=2" in message and COMM in message and "all_gather" in message


def test_context_parallel_settings_the_model_or_machine_cannot_run_are_refused(model_dir):
    # 9 heads, 3 key/value heads: the all-to-all cannot split 3 heads over 2 ranks.
    model = model_dir
    message = error_of(DEMO, [f"actor_rollout_ref.model.path={model}", f"{ULYSSES}=2"])
    assert COMM in message and "a2a" in message and "3 key/value heads" in message and ULYSSES in message
    # (the demo's rows are padded: use_remove_padding false)
    assert load_config(DEMO, [f"actor_rollout_ref.model.path={model}", f"{CP}=2", f"{COMM}=all_gather"])
    # Packed (THD) rows under all_gather: Transformer Engine 2.11 asserts qkv_format != "thd" there
    # (context_parallel.py:2842), so every machine refuses it (issue 45, defect 2).
    packed = ["actor_rollout_ref.model.use_remove_padding=true", "critic.model.use_remove_padding=true"]
    message = error_of(DEMO, [f"actor_rollout_ref.model.path={model}", f"{CP}=2", f"{COMM}=all_gather", *packed])
    assert f"{COMM}=all_gather with actor_rollout_ref.model.use_remove_padding=true" in message
    assert "p2p or a2a" in message and "use_remove_padding=false" in message
    message = error_of(DEMO, [f"actor_rollout_ref.model.path={model}", f"{CP}=2", f"{COMM}=all_gather", packed[1]])
    assert "critic.megatron.cp_comm_type=all_gather with critic.model.use_remove_padding=true" in message
    # p2p and a2a+p2p run inside Transformer Engine's attention, which CPU machines lack.
    message = error_of(DEMO, [f"{CP}=2"])
    assert "cp_comm_type=p2p" in message and "Transformer Engine" in message and "all_gather or a2a" in message
    message = error_of(DEMO, [f"{CP}=2", f"{COMM}=ring"])
    assert "ring" in message and "a2a+p2p" in message
    # Under CP a GPU holds 1/CP of each sequence: the token budget counts that share.
    dynamic = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40"]
    assert "ppo_max_token_len_per_gpu=40" in error_of(DEMO, dynamic)
    assert load_config(DEMO, [*dynamic, f"{ULYSSES}=2"])


def test_the_seed_recipe_with_ulysses_passes_check(demo_model, capsys):
    import launch.cli

    assert launch.cli.main([str(DEMO), f"{ULYSSES}=2", "trainer.checkpoint.every_n_steps=5", "--check"]) == 0
    assert "usable" in capsys.readouterr().out


def test_multi_turn_keys_are_refused_where_they_would_be_ignored_or_cannot_run(tmp_path):
    key = "actor_rollout_ref.rollout.multi_turn"
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: engine.rollout.agentic.tools.CalculatorTool\n")
    assert f"{key}.tool_config_path=" in error_of(DEMO, [f"{key}.tool_config_path={tools}"])
    assert "with neither there is nothing to answer the model" in error_of(DEMO, [f"{key}.enable=true"])
    on = [f"{key}.enable=true", f"{key}.tool_config_path={tools}"]
    load_config(DEMO, on)
    assert f"{key}.format='json'" in error_of(DEMO, [*on, f"{key}.format=json"])
    assert "max_assistant_turns=0" in error_of(DEMO, [*on, f"{key}.max_assistant_turns=0"])
    assert "moe_router_replay" in error_of(DEMO, [*on, "actor_rollout_ref.actor.megatron.moe_router_replay=true"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - class_name: engine.rollout.agentic.tools.Calculator\n")
    message = error_of(DEMO, [f"{key}.enable=true", f"{key}.tool_config_path={bad}"])
    assert str(bad) in message and "Calculator" in message
    missing = tmp_path / "missing.yaml"
    assert str(missing) in error_of(DEMO, [f"{key}.enable=true", f"{key}.interaction_config_path={missing}"])
