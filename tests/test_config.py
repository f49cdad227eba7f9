"""engine.config: the yaml/ experiments load, overrides merge, the resolved config round-trips."""
import json
import logging
import os
import sys
from pathlib import Path

import pytest
import yaml

from engine.config import ConfigError, ExperimentConfig, load_config, to_yaml
from engine.config.loader import all_keys

REPO = Path(__file__).resolve().parents[1]
YAML_DIR = REPO / "yaml"
EXPERIMENTS = sorted(YAML_DIR.glob("*.yaml"))
# The world size each experiment file is written for.
TARGET_WORLD_SIZE = {"demo_cpu.yaml": 2, "qwen2.5-0.5b_gsm8k.yaml": 8, "qwen2.5-7b_gsm8k.yaml": 8}
# Shapes from the published HF config.json files of the models the GPU experiments name.
QWEN_SHAPES = {
    "qwen2.5-0.5b_gsm8k.yaml": dict(num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24),
    "qwen2.5-7b_gsm8k.yaml": dict(num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28),
}
# launch.prepare_demo_model's Llama.
DEMO_SHAPE = dict(num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4)


def write_hf_config(folder: Path, **shape) -> str:
    """A model folder holding only the HF config.json keys the validator reads."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **shape}))
    return str(folder)


def test_yaml_dir_holds_the_owned_experiments():
    assert set(TARGET_WORLD_SIZE) <= {path.name for path in EXPERIMENTS}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda path: path.name)
def test_every_experiment_loads_and_round_trips(path, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="engine.config")
    # The files written for one node give their world size; the others are checked against
    # trainer.nnodes * trainer.n_gpus_per_node.
    world_size = TARGET_WORLD_SIZE.get(path.name)
    config = load_config(path, world_size=world_size)
    assert isinstance(config, ExperimentConfig)
    if world_size is not None:
        assert config.trainer.nnodes * config.trainer.n_gpus_per_node == world_size
    if path.name == "demo_cpu.yaml":
        assert config.actor_rollout_ref.rollout.name == "torch"
    elif path.name in QWEN_SHAPES:
        assert config.actor_rollout_ref.rollout.name == "sglang"
    if not Path(config.actor_rollout_ref.model.path).exists():
        # A model that is not on this machine: the head checks are skipped, said only in a debug log.
        skipped = [r for r in caplog.records if "skipping the head/layer" in r.getMessage()]
        assert skipped and all(r.levelno == logging.DEBUG for r in skipped)

    # The resolved config round-trips: to_yaml, load again, same dataclasses, same text.
    text = to_yaml(config)
    assert "${" not in text
    written = tmp_path / "config.yaml"
    written.write_text(text)
    again = load_config(written, world_size=world_size)
    assert again == config
    assert to_yaml(again) == text


@pytest.mark.parametrize("name", sorted(QWEN_SHAPES))
def test_gpu_layouts_fit_the_real_qwen_shapes(name, tmp_path):
    model = write_hf_config(tmp_path / "model", **QWEN_SHAPES[name])
    config = load_config(YAML_DIR / name, [f"actor_rollout_ref.model.path={model}"], world_size=8)
    assert config.critic.model.path == model  # the critic follows the actor's checkpoint
    # The same file is rejected when a layout cannot split this model, so the check really ran.
    with pytest.raises(ConfigError, match="num_attention_heads"):
        load_config(YAML_DIR / name, [f"actor_rollout_ref.model.path={model}",
                                      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8",
                                      "actor_rollout_ref.rollout.tensor_model_parallel_size=1"], world_size=8)


def test_demo_layout_fits_the_demo_model(tmp_path):
    model = write_hf_config(tmp_path / "demo-arith", **DEMO_SHAPE)
    config = load_config(YAML_DIR / "demo_cpu.yaml", [f"actor_rollout_ref.model.path={model}"], world_size=2)
    assert config.actor_rollout_ref.actor.megatron.data_parallel_size(2) == 2


def test_world_size_defaults_to_nnodes_times_gpus_per_node():
    load_config(YAML_DIR / "qwen2.5-7b_gsm8k.yaml")  # 1 x 8: valid
    with pytest.raises(ConfigError, match=r"world size 12 = trainer.nnodes \(1\) x trainer.n_gpus_per_node \(12\)"):
        load_config(YAML_DIR / "qwen2.5-7b_gsm8k.yaml", ["trainer.n_gpus_per_node=12",
                                                          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8"])
    # A launch of another size is refused, naming both numbers and the fix.
    with pytest.raises(ConfigError, match=r"launched with 6 ranks.*world size 8 = trainer.nnodes \(1\) x "
                                          r"trainer.n_gpus_per_node \(8\).*trainer.n_gpus_per_node=6"):
        load_config(YAML_DIR / "qwen2.5-7b_gsm8k.yaml", world_size=6)


def test_overrides_of_nested_keys_lists_and_booleans():
    overrides = [
        "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",
        "data.shuffle=false",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.5",
        "data.train_files=[a.parquet,b.parquet]",
        "actor_rollout_ref.actor.optim.lr=3e-6",
        "trainer.logger=[console]",
        "trainer.total_training_steps=null",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",  # the later override wins
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    ]
    config = load_config(YAML_DIR / "demo_cpu.yaml", overrides, world_size=2)
    actor = config.actor_rollout_ref.actor
    assert actor.optim.betas == [0.9, 0.95]
    assert config.data.shuffle is False
    assert config.actor_rollout_ref.rollout.val_kwargs.temperature == 0.5
    assert config.data.train_files == ["a.parquet", "b.parquet"]
    assert actor.optim.lr == pytest.approx(3e-6) and isinstance(actor.optim.lr, float)
    assert config.trainer.logger == ["console"]
    assert config.trainer.total_training_steps is None
    assert actor.ppo_mini_batch_size == 32
    # Interpolated defaults follow the actor: critic epochs/mini-batch, ref and rollout log-prob batches.
    assert config.critic.ppo_mini_batch_size == 32
    assert config.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
    assert config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 4
    # Values the YAML sets explicitly do not follow.
    assert config.critic.ppo_micro_batch_size_per_gpu == 8


def test_single_file_string_paths_and_home_expansion():
    config = load_config(YAML_DIR / "demo_cpu.yaml", ["data.train_files=~/gsm8k/train.parquet",
                                                      "data.val_files=null",
                                                      "actor_rollout_ref.model.path=~/models/m"], world_size=2)
    home = os.path.expanduser("~")
    assert config.data.train_files == [f"{home}/gsm8k/train.parquet"]
    assert config.data.val_files == []
    assert config.actor_rollout_ref.model.path == f"{home}/models/m"
    assert config.actor_rollout_ref.model.tokenizer_path == f"{home}/models/m"
    assert config.critic.model.path == f"{home}/models/m"


def test_run_directory_interpolates_names():
    config = load_config(YAML_DIR / "qwen2.5-0.5b_gsm8k.yaml", ["trainer.experiment_name=try3"], world_size=8)
    assert config.trainer.default_local_dir == "runs/trident_gsm8k/try3"


def test_to_yaml_writes_every_schema_key_and_overrides():
    config = load_config(YAML_DIR / "demo_cpu.yaml", ["actor_rollout_ref.actor.optim.betas=[0.9,0.95]"], world_size=2)
    tree = yaml.safe_load(to_yaml(config))
    for key in all_keys():
        node = tree
        for part in key.split("."):
            node = node[part]
    assert tree["actor_rollout_ref"]["actor"]["optim"]["betas"] == [0.9, 0.95]
    assert tree["critic"]["model"]["path"] == config.actor_rollout_ref.model.path


def test_sections_are_the_components_own_settings():
    config = load_config(YAML_DIR / "qwen2.5-7b_gsm8k.yaml",
                         ["actor_rollout_ref.actor.clip_ratio_high=0.28", "algorithm.lam=0.95",
                          "algorithm.kl_ctrl.type=adaptive"], world_size=8)
    actor = config.actor_rollout_ref.actor
    assert (actor.epsilon_low, actor.epsilon_high, actor.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert (config.algorithm.adv_estimator, config.algorithm.gamma, config.algorithm.lam) == ("gae", 1.0, 0.95)
    assert config.algorithm.kl_ctrl.type == "adaptive"
    assert (config.data.train_batch_size, config.data.max_prompt_length) == (1024, 512)
    layout = actor.megatron
    assert layout.tensor_model_parallel_size == 4 and layout.sequence_parallel
    assert layout.data_parallel_size(8) == 2
    assert config.reward_model.num_workers == 8
    # Cross-section defaults: the critic takes the actor's layout and batching, the reference and
    # the old-log-prob pass the actor's micro-batching.
    critic = config.critic
    assert critic.megatron.describe() == layout.describe() and critic.model.path == config.actor_rollout_ref.model.path
    assert (critic.ppo_mini_batch_size, critic.use_dynamic_bsz) == (actor.ppo_mini_batch_size, actor.use_dynamic_bsz)
    assert critic.forward_max_token_len_per_gpu == critic.ppo_max_token_len_per_gpu == 16384
    assert config.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == actor.ppo_max_token_len_per_gpu
    # The optimizer's warm-up: negative steps use the ratio of the run's optimizer steps.
    warm = load_config(YAML_DIR / "qwen2.5-7b_gsm8k.yaml", ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1"])
    assert warm.actor_rollout_ref.actor.optim.warmup_steps(200) == 20
    # sequence_parallel only takes effect with TP > 1.
    demo = load_config(YAML_DIR / "demo_cpu.yaml", world_size=2)
    assert demo.actor_rollout_ref.actor.megatron.sequence_parallel
    assert not demo.actor_rollout_ref.actor.megatron.uses_sequence_parallel


def test_importing_the_package_does_not_import_torch():
    import subprocess

    code = "import sys, engine.config; print('torch' in sys.modules, 'megatron' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.split() == ["False", "False"]
