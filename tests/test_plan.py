"""python -m launch.plan: every experiment in yaml/ validates and fits; undersized plans are refused."""
import json
from pathlib import Path

import pytest

from launch.plan import main, make_plan

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = sorted(str(path.relative_to(REPO)) for path in (REPO / "yaml").glob("*.yaml"))
LARGE = ["yaml/llama3-70b_ppo_8node.yaml", "yaml/llama3-70b_ppo_16node.yaml",
         "yaml/qwen2.5-72b_ppo_8node.yaml", "yaml/qwen2.5-72b_ppo_16node.yaml"]
README_TABLE = [*LARGE, "yaml/qwen3-8b_grpo_gsm8k.yaml"]


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def test_the_70b_experiments_exist():
    assert set(LARGE) <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_validates_and_fits(experiment, capsys, request):
    if experiment == "yaml/demo_cpu.yaml":
        request.getfixturevalue("demo_model")  # its model.path is the folder `make demo` builds
    status = main([experiment])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert "update_actor" in out and "headroom" in out


@pytest.mark.parametrize("experiment", LARGE)
def test_70b_plans_fit_on_their_node_count_with_every_phase(experiment):
    report = make_plan(experiment)
    assert report.world_size == report.nodes * 8 and report.nodes in (8, 16)
    phases = {phase.phase for phase in report.memory.phases}
    assert phases == {"rollout", "weight_sync", "old_log_prob", "ref_log_prob", "values", "update_critic", "update_actor"}
    assert all(phase.fits for phase in report.memory.phases)
    # one generation wave: the KV cache holds every sequence a replica gets per step
    assert report.memory.max_concurrent_sequences >= report.memory.sequences_per_replica


def test_undersized_plan_is_refused_naming_the_phase(capsys):
    # the 16-node layout squeezed onto 8 nodes: the optimizer shards double
    status = main(["yaml/llama3-70b_ppo_16node.yaml", "--nodes", "8"])
    err = capsys.readouterr().err
    assert status == 1
    assert "phase 'rollout'" in err and "over by" in err and "GiB" in err


def test_small_gpus_refuse_the_training_phases_too(capsys):
    status = main(["yaml/llama3-70b_ppo_8node.yaml", "--gpu-mem", "40"])
    err = capsys.readouterr().err
    assert status == 1
    assert "phase 'update_actor'" in err


def test_json_output_and_layout_errors(capsys):
    assert main(["yaml/llama3-70b_ppo_8node.yaml", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["world_size"] == 64
    assert plan["models"]["actor"]["pipeline_model_parallel_size"] == 8
    sync = plan["weight_sync"]
    assert sync["received_bytes_per_gpu"] == pytest.approx((64 - 8) / (8 * 64) * sync["model_bytes"])
    # 4 nodes cannot hold TP8 x PP8: a config error naming the key, status 2
    assert main(["yaml/llama3-70b_ppo_8node.yaml", "--nodes", "4"]) == 2
    assert "actor_rollout_ref.actor.megatron" in capsys.readouterr().err


def test_unknown_architecture_is_a_clear_error(capsys):
    status = main(["yaml/llama3-70b_ppo_8node.yaml", "actor_rollout_ref.model.path=/models/Mystery-9B"])
    err = capsys.readouterr().err
    assert status == 2 and "actor_rollout_ref.model.path=/models/Mystery-9B" in err and "config.json" in err


def test_moe_models_are_refused_until_the_planner_models_them(tmp_path, capsys):
    from transformers import Qwen3MoeConfig

    folder = tmp_path / "Qwen3-30B-A3B"
    Qwen3MoeConfig(num_hidden_layers=4).save_pretrained(folder)
    status = main(["yaml/qwen2.5-7b_gsm8k.yaml", f"actor_rollout_ref.model.path={folder}"])
    err = capsys.readouterr().err
    assert status == 2 and "qwen3_moe is a Mixture-of-Experts model" in err and "actor_rollout_ref.model.path" in err


def test_disaggregated_rollout_is_not_estimated(capsys):
    status = main(["yaml/qwen2.5-7b_gsm8k.yaml", "actor_rollout_ref.rollout.mode=disaggregated",
                   "actor_rollout_ref.rollout.num_gpus=2"])
    err = capsys.readouterr().err
    assert status == 2 and "the planner models colocated rollout only" in err


def test_config_json_beats_the_table(tmp_path, capsys):
    folder = tmp_path / "Meta-Llama-3-70B-Instruct"
    folder.mkdir()
    hf = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
          "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 4096, "tie_word_embeddings": False, "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(hf))
    report = make_plan("yaml/llama3-70b_ppo_8node.yaml", [f"actor_rollout_ref.model.path={folder}"])
    assert report.architecture_source.endswith("config.json") and report.parameters < 1e9


def test_markdown_snippet_is_in_the_docs():
    from launch.plan import markdown_text

    docs = (REPO / "docs" / "planner.md").read_text()
    for experiment in LARGE:
        assert markdown_text(make_plan(experiment)) in docs, f"regenerate docs/planner.md for {experiment}"


def test_readme_prints_the_current_estimates():
    readme = (REPO / "README.md").read_text().splitlines()
    gib = 2 ** 30
    for experiment in README_TABLE:
        report = make_plan(experiment)
        phases = {phase.phase: phase for phase in report.memory.phases}
        headroom = min(phase.capacity_bytes - phase.total_bytes for phase in report.memory.phases)
        sync = report.memory.sync
        expected = [f"{phases['rollout'].total_bytes / gib:.1f}", f"{phases['update_actor'].total_bytes / gib:.1f}",
                    f"{headroom / gib:.1f}", f"{sync.received_bytes / gib:.1f} / {sync.gather_all_bytes / gib:.1f}"]
        row = next(line for line in readme if line.startswith(f"| `{experiment}` |"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[-4:] == expected, f"update README.md's row for {experiment}"
