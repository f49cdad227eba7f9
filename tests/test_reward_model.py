"""The learned reward model: HF parity on the Megatron mesh, combining with rule scores, config errors."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import ConfigError, load_config
from engine.config.reward_model import RewardCombineConfig
from engine.models.char_tokenizer import VOCAB_SIZE, build_char_tokenizer
from engine.rewards.combine import RewardScores, combine_rewards
from tests.distributed import read_metrics, run_main_job, run_torchrun
from tests.test_models_parity import away_from_init

# A reward model's own chat template, unlike the policy's (engine.models.char_tokenizer.CHAT_TEMPLATE).
OTHER_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | upper }}: {{ message['content'] }}\n"
    "{%- endfor -%}"
    "<|im_end|>"
)
# DP2, TP2, PP2, TP2 with sequence parallelism, and context parallelism 2 with each comm type of the CPU
# attention: packed under a2a, then left-aligned under all_gather (the worker alternates; all_gather takes
# no packed rows, as in Transformer Engine).
LAYOUTS = ["1,1,0", "2,1,0", "1,2,0", "2,1,0,1", "1,1,0,0,1,0,2,a2a", "1,1,0,0,1,0,2,all_gather"]


def save_tiny_reward_models(root) -> list:
    """Random one-label Llama (GQA, untied) and Qwen2 (QKV bias) sequence classifiers over the
    character vocabulary, each with a tokenizer whose chat template differs from the policy's."""
    from transformers import LlamaConfig, LlamaForSequenceClassification, Qwen2Config, Qwen2ForSequenceClassification

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                  pad_token_id=0)
    models = {"llama_rm": LlamaForSequenceClassification(LlamaConfig(**common, tie_word_embeddings=False)),
              "qwen2_rm": Qwen2ForSequenceClassification(Qwen2Config(**common, tie_word_embeddings=False))}
    torch.manual_seed(0)
    dirs = []
    for name, model in models.items():
        away_from_init(model)
        tokenizer = build_char_tokenizer()
        tokenizer.chat_template = OTHER_TEMPLATE
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs.append(root / name)
    return dirs


@pytest.mark.dist
def test_reward_model_scores_equal_hf_at_every_layout(tmp_path):
    dirs = save_tiny_reward_models(tmp_path)
    build_char_tokenizer().save_pretrained(tmp_path / "policy_tokenizer")
    out = tmp_path / "results.json"
    run_torchrun("reward_model_parity.py", 2, ["--rm-dirs", *map(str, dirs), "--policy-tokenizer",
                                               str(tmp_path / "policy_tokenizer"), "--layouts", *LAYOUTS,
                                               "--out", str(out)])
    results = json.loads(out.read_text())
    for family in ("llama_rm", "qwen2_rm"):
        for layout in LAYOUTS:
            for inputs in ("retokenized", "policy_tokens"):
                entry = results[family][f"{layout}/{inputs}"]
                assert entry["max_abs_diff"] <= 1e-4, (family, layout, inputs, entry)
                assert entry["score_spread"] > 0.1, "the scores must differ between conversations to mean anything"
            print(family, layout, results[family][f"{layout}/retokenized"])


def test_combine_rewards_follows_the_formula():
    rule = torch.tensor([1.0, 0.0, 1.0, 0.1])
    model = torch.tensor([2.0, -1.0, 0.5, 3.0])
    judge = torch.tensor([0.9, 0.2, 0.4, 0.0])
    plain = RewardCombineConfig(rule_weight=0.5, model_weight=2.0, judge_weight=3.0)
    reward, metrics = combine_rewards(RewardScores(rule, model, judge), plain)
    torch.testing.assert_close(reward, 0.5 * rule + 2.0 * model + 3.0 * judge)
    assert metrics == pytest.approx({"reward/rule/mean": 0.525, "reward/model/mean": 1.125, "reward/judge/mean": 0.375})

    gated = RewardCombineConfig(mode="gated", gate_threshold=1.0)
    reward, metrics = combine_rewards(RewardScores(rule, model, judge), gated)
    open_ = torch.tensor([1.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(reward, rule + open_ * (model + judge))
    assert metrics["reward/gate/open_fraction"] == 0.5

    whitened = RewardCombineConfig(rule_weight=0.0, normalize_model_score=True, model_score_clip=1.0, reward_clip=0.8)
    reward, _ = combine_rewards(RewardScores(rule, model), whitened)
    m = model.double()
    expected = ((m - m.mean()) / (m.std(unbiased=False) + 1e-6)).clamp(-1, 1).clamp(-0.8, 0.8)
    torch.testing.assert_close(reward, expected.float())

    # A batch of equal model scores whitens to zeros, not NaN.
    reward, _ = combine_rewards(RewardScores(model=torch.full((3,), 2.0)), whitened)
    assert torch.equal(reward, torch.zeros(3))
    with pytest.raises(ValueError, match="gated"):
        combine_rewards(RewardScores(model=model), gated)


def test_reward_model_config_errors(demo_model, tmp_path):
    base = ["trainer.n_gpus_per_node=1"]
    with pytest.raises(ConfigError, match="reward_model.enable=true needs reward_model.model.path"):
        load_config("yaml/demo_cpu.yaml", [*base, "reward_model.enable=true"], world_size=1)
    with pytest.raises(ConfigError, match="LlamaForCausalLM.*not a \\*ForSequenceClassification"):
        load_config("yaml/demo_cpu.yaml", [*base, "reward_model.enable=true",
                                           f"reward_model.model.path={demo_model.model_dir}"], world_size=1)
    rm_dir = save_tiny_reward_models(tmp_path)[0]
    with pytest.raises(ConfigError, match="reward_model.megatron's layout"):
        load_config("yaml/demo_cpu.yaml", ["reward_model.enable=true", f"reward_model.model.path={rm_dir}",
                                           "reward_model.megatron.tensor_model_parallel_size=2"], world_size=2)
    with pytest.raises(ConfigError, match="rule_weight=0 with neither"):
        load_config("yaml/demo_cpu.yaml", [*base, "reward_model.combine.rule_weight=0"], world_size=1)
    with pytest.raises(ConfigError, match="reward_model.combine.mode='product'"):
        load_config("yaml/demo_cpu.yaml", [*base, "reward_model.combine.mode=product"], world_size=1)
    config = load_config("yaml/demo_cpu.yaml", [*base, "reward_model.enable=true", f"reward_model.model.path={rm_dir}"],
                         world_size=1)
    assert config.reward_model.model.tokenizer_path == str(rm_dir)
    assert config.reward_model.megatron.param_dtype == config.actor_rollout_ref.actor.megatron.param_dtype


@pytest.mark.dist
@pytest.mark.slow
def test_ppo_on_the_reward_model_alone_raises_its_score_and_the_accuracy(demo_model, tmp_path):
    """40 PPO iterations (2 ranks) whose reward is the tiny Bradley-Terry reward model's score only
    (``rule_weight: 0``; the rule score is logged, not trained on), on the 64 questions the reward
    model was fit on. The score is whitened per batch and the KL penalty is 0.3: at the demo's 0.05,
    unwhitened, the policy drifts to wrong answers the reward model overrates (measured with an
    earlier fit of this kind, 0.93 pairwise: score -1.76 -> 1.74, accuracy 0.22 -> 0.20 over steps
    1-5 -> 36-40; reward hacking).

    Measured with trainer.seed 1/2/3 (first 5 steps -> last 10; this reward model's fit, packed rows
    by cu_seqlens): reward-model score -4.20/-4.45/-4.36 -> -2.82/-2.41/-2.48 (+1.38/+2.04/+1.88);
    sampled accuracy 0.275/0.269/0.265 -> 0.286/0.319/0.334 (+0.011/+0.051/+0.069); greedy accuracy
    on the 64 questions 0.344 -> 0.422/0.438/0.453 at step 40. Asked: +1.0 score, a sampled accuracy
    above the start's, and a greedy accuracy 0.05 above the start's (the sampled one moves by as
    little as +0.011 on seed 1, the default; it was +0.022 there before packed rows ran by cu_seqlens,
    the same run up to float round-off).

    The 40 steps take ~65 s on the 2-core machine, past the 60 s asked of a learning run: the numbers
    above are 40-step ones, and no shorter run has been measured over seeds. A fresh clone also
    fits the reward model first (~290 s, once; cached in .cache/models/demo-arith-reward)."""
    from tests.reward_model_fit import fit_demo_reward_model

    reward_model = fit_demo_reward_model(demo_model)
    assert reward_model.pairwise_accuracy > 0.8, reward_model
    run_dir = tmp_path / "run"
    run_main_job("yaml/demo_cpu.yaml", [
        f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=40", "trainer.save_freq=-1",
        "trainer.test_freq=40", "trainer.export_hf_at_end=false", f"data.train_files={reward_model.train_file}",
        f"data.val_files={reward_model.train_file}", "reward_model.enable=true",
        f"reward_model.model.path={reward_model.path}", "reward_model.combine.rule_weight=0",
        "reward_model.combine.normalize_model_score=true", "algorithm.kl_ctrl.kl_coef=0.3"])
    everything = read_metrics(run_dir)
    rows = [r for r in everything if "reward/model/mean" in r]
    assert len(rows) == 40
    model = [r["reward/model/mean"] for r in rows]
    rule = [r["reward/rule/mean"] for r in rows]
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    print(f"reward model {mean(model[:5]):.3f} -> {mean(model[-10:]):.3f}, accuracy {mean(rule[:5]):.3f} -> "
          f"{mean(rule[-10:]):.3f}")
    assert mean(model[-10:]) - mean(model[:5]) > 1.0
    assert mean(rule[-10:]) > mean(rule[:5])
    greedy = [r["val/accuracy"] for r in everything if "val/accuracy" in r]
    assert len(greedy) == 2 and greedy[1] - greedy[0] >= 0.05, greedy
    # Whitened scores are the reward: their batch mean is 0 whatever the raw scores are.
    assert abs(rows[-1]["critic/score/mean"]) < 1e-5
