"""The inputs users get wrong are refused by the ``trident`` command before anything starts.

Each case breaks one input of the demo experiment (a copy of the demo model folder, a Parquet file,
a reward function file) and runs ``launch.cli.main`` as the ``trident`` command does: it must exit
2 with one ``[trident] error:`` line that names the key or path and the problem, no traceback, and
must not have started torchrun (``launch.cli.launch`` fails the test if called) or created the
run folder. One case goes through a real process end to end; errors that can only show after
start-up (a reward function that fails on every response) are checked on a 2-rank job.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import launch.cli
from tests.distributed import REPO_ROOT

DEMO = "yaml/demo_cpu.yaml"


def demo_copy(demo_model, tmp_path: Path, *, without: tuple[str, ...] = ()) -> Path:
    """A copy of the demo model folder (weights linked, not copied) lacking the named files."""
    folder = tmp_path / "model"
    folder.mkdir()
    for file in demo_model.model_dir.iterdir():
        if file.is_file() and file.name not in without:
            (folder / file.name).symlink_to(file.resolve())
    return folder


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def demo_rows(demo_model, count: int) -> list[dict]:
    return pq.read_table(demo_model.train_file).slice(0, count).to_pylist()


def trident_error(tmp_path: Path, monkeypatch, capsys, overrides: list[str]) -> str:
    """Run the trident command on the demo with the overrides; return its one error line."""
    def must_not_start(*args, **kwargs):
        raise AssertionError("torchrun was started for an unusable input")

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(launch.cli, "launch", must_not_start)
    run_dir = tmp_path / "run"
    status = launch.cli.main([DEMO, f"trainer.default_local_dir={run_dir}", *overrides])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("[trident] error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert not run_dir.exists()
    return err


# ------------------------------------------------------------------- model and tokenizer

def test_model_folder_missing(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, [f"actor_rollout_ref.model.path={tmp_path}/nope"])
    assert f"actor_rollout_ref.model.path={tmp_path}/nope: no such folder" in err


def test_not_a_model_folder(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, [f"actor_rollout_ref.model.path={tmp_path}"])
    assert f"actor_rollout_ref.model.path={tmp_path}: not a Hugging Face model folder (no config.json)" in err


def test_model_folder_without_weights(demo_model, tmp_path, monkeypatch, capsys):
    folder = demo_copy(demo_model, tmp_path, without=("model.safetensors",))
    err = trident_error(tmp_path, monkeypatch, capsys, [f"actor_rollout_ref.model.path={folder}"])
    assert f"actor_rollout_ref.model.path={folder}: no *.safetensors weights" in err


def test_unsupported_architecture(demo_model, tmp_path, monkeypatch, capsys):
    folder = demo_copy(demo_model, tmp_path, without=("config.json",))
    config = json.loads((demo_model.model_dir / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(config))
    err = trident_error(tmp_path, monkeypatch, capsys, [f"actor_rollout_ref.model.path={folder}"])
    assert f"actor_rollout_ref.model.path={folder}: model_type 'gpt2' is not supported (supported: llama" in err


def test_expert_parallelism_on_a_dense_model(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, ["actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"])
    assert "actor_rollout_ref.actor.megatron: expert_model_parallel_size=2 needs a Mixture-of-Experts model" in err


def test_expert_tensor_parallelism_on_a_dense_model(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, ["actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1"])
    assert "actor_rollout_ref.actor.megatron: expert_tensor_parallel_size=1 needs a Mixture-of-Experts model" in err


def test_load_balancing_loss_on_a_dense_model(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, ["critic.megatron.moe_aux_loss_coeff=0.01"])
    assert "critic.megatron.moe_aux_loss_coeff=0.01: the load-balancing loss needs a Mixture-of-Experts model" in err


def test_router_replay_on_a_dense_model(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, ["actor_rollout_ref.actor.megatron.moe_router_replay=true"])
    assert "actor_rollout_ref.actor.megatron.moe_router_replay=true: router replay needs a Mixture-of-Experts model" in err


def test_moe_model_at_tensor_parallel_without_sequence_parallel(demo_model, tmp_path, monkeypatch, capsys):
    from engine.models.char_tokenizer import build_char_tokenizer
    from launch.rehearse import write_tiny_model

    folder = write_tiny_model(dict(
        model_type="qwen3_moe", vocab_size=len(build_char_tokenizer()), hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128), tmp_path / "moe")
    capsys.readouterr()  # save_pretrained's progress bar
    err = trident_error(tmp_path, monkeypatch, capsys, [
        f"actor_rollout_ref.model.path={folder}", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.sequence_parallel=false"])
    assert "actor_rollout_ref.actor.megatron.sequence_parallel=false: megatron-core trains the MoE layers" in err
    # LoRA adapts dense layers only: all-linear would reach the experts.
    err = trident_error(tmp_path, monkeypatch, capsys, [f"actor_rollout_ref.model.path={folder}",
                                                        "actor_rollout_ref.model.lora_rank=8"])
    assert "actor_rollout_ref.model.target_modules=all-linear: LoRA on the expert layers of qwen3_moe is not built" in err


def test_critic_model_folder_is_checked_too(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, [f"critic.model.path={tmp_path}/nope"])
    assert f"critic.model.path={tmp_path}/nope: no such folder" in err


def test_tokenizer_that_cannot_load(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, [f"actor_rollout_ref.model.tokenizer_path={tmp_path}"])
    assert f"actor_rollout_ref.model.tokenizer_path={tmp_path}: cannot load a tokenizer" in err


def test_tokenizer_without_chat_template(demo_model, tmp_path, monkeypatch, capsys):
    folder = demo_copy(demo_model, tmp_path, without=("chat_template.jinja",))
    err = trident_error(tmp_path, monkeypatch, capsys, [f"actor_rollout_ref.model.path={folder}"])
    assert f"actor_rollout_ref.model.tokenizer_path={folder}: the tokenizer has no chat template" in err


# ------------------------------------------------------------------- prompt files

def test_prompt_file_missing(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, [f"data.train_files={tmp_path}/train.parquet"])
    assert f"{tmp_path}/train.parquet: file not found (listed in data.train_files)" in err


def test_prompt_file_without_the_prompt_column(demo_model, tmp_path, monkeypatch, capsys):
    rows = [{key: value for key, value in row.items() if key != "prompt"} for row in demo_rows(demo_model, 8)]
    path = write_parquet(tmp_path / "train.parquet", rows)
    err = trident_error(tmp_path, monkeypatch, capsys, [f"data.train_files={path}"])
    assert str(path) in err and "key 'prompt'" in err and "missing column (data.prompt_key)" in err


def test_malformed_row_deep_in_the_file_is_located(demo_model, tmp_path, monkeypatch, capsys):
    rows = demo_rows(demo_model, 300)
    rows[257]["prompt"] = [{"role": "user"}]  # no content
    path = write_parquet(tmp_path / "train.parquet", rows)
    err = trident_error(tmp_path, monkeypatch, capsys, [f"data.train_files={path}"])
    assert str(path) in err and "row 257" in err


def test_every_prompt_filtered_out(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, ["data.max_prompt_length=4"])
    assert "train.parquet" in err and "no prompt is left" in err


def test_prompts_over_the_length_limit(demo_model, tmp_path, monkeypatch, capsys):
    err = trident_error(tmp_path, monkeypatch, capsys, ["data.filter_overlong_prompts=false",
                                                        "data.max_prompt_length=10"])
    assert "train.parquet, row 0, key 'prompt': prompt has 18 tokens" in err and "data.max_prompt_length=10" in err


# ------------------------------------------------------------------- reward function

def reward_file(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(source)
    return path


def test_reward_function_that_cannot_import(demo_model, tmp_path, monkeypatch, capsys):
    path = reward_file(tmp_path, "import package_that_is_not_installed\n")
    err = trident_error(tmp_path, monkeypatch, capsys, [f"reward_model.custom_reward_function.path={path}"])
    assert str(path) in err and "package_that_is_not_installed" in err


def test_reward_function_not_in_the_file(demo_model, tmp_path, monkeypatch, capsys):
    path = reward_file(tmp_path, "def score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n")
    err = trident_error(tmp_path, monkeypatch, capsys, [f"reward_model.custom_reward_function.path={path}"])
    assert str(path) in err and "compute_score" in err


def test_reward_function_with_the_wrong_signature(demo_model, tmp_path, monkeypatch, capsys):
    path = reward_file(tmp_path, "def compute_score(response):\n    return 1.0\n")
    err = trident_error(tmp_path, monkeypatch, capsys, [f"reward_model.custom_reward_function.path={path}"])
    assert str(path) in err and "(data_source, solution_str, ground_truth, extra_info)" in err


def test_data_source_without_a_scorer(demo_model, tmp_path, monkeypatch, capsys):
    rows = demo_rows(demo_model, 8)
    for row in rows:
        row["data_source"] = "my/private_task"
    path = write_parquet(tmp_path / "train.parquet", rows)
    err = trident_error(tmp_path, monkeypatch, capsys, [f"data.train_files={path}"])
    assert "'my/private_task'" in err and "reward_model.custom_reward_function.path" in err


# ------------------------------------------------------------------- through real processes

def test_the_command_refuses_before_starting_anything(demo_model, tmp_path):
    """The real process: exit 2, one line, no rank logs (torchrun never ran)."""
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "launch.cli", DEMO, f"trainer.default_local_dir={run_dir}",
                             f"actor_rollout_ref.model.path={tmp_path}/nope"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr == f"[trident] error: actor_rollout_ref.model.path={tmp_path}/nope: no such folder\n"
    assert result.stdout == "" and not run_dir.exists()


@pytest.mark.dist
def test_a_reward_function_failing_after_start_up_is_one_message(demo_model, tmp_path):
    """Every response fails to score: each rank stops at step 1 (max_failed_steps=1) with the same
    error, which the command prints once, naming both ranks, without a traceback."""
    path = reward_file(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
                                 "    raise KeyError('answer')\n")
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "launch.cli", DEMO, f"trainer.default_local_dir={run_dir}",
                             f"reward_model.custom_reward_function.path={path}", "reward_model.max_failed_steps=1",
                             "trainer.val_before_train=false", "trainer.total_training_steps=3"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("[trident] error")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith("[trident] error (ranks 0, 1): the reward function failed on 64 of 64 responses")
    assert "KeyError" in errors[0] and "Traceback" not in result.stderr
    assert (run_dir / "logs").is_dir()
