"""The learned reward model: HF parity on the Megatron mesh, combining with rule scores, config errors."""
from __future__ import annotations

import json

import pytest
import torch

from engine.config import ConfigError, load_config
from engine.config.reward_model import RewardCombineConfig
from engine.models.char_tokenizer import VOCAB_SIZE, build_char_tokenizer
from engine.rewards.combine import RewardScores, combine_rewards
from tests.distributed import run_torchrun

# A reward model's own chat template, unlike the policy's (engine.models.char_tokenizer.CHAT_TEMPLATE).
OTHER_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] | upper }}: {{ message['content'] }}\n"
    "{%- endfor -%}"
    "<|im_end|>"
)
LAYOUTS = ["1,1,0", "2,1,0", "1,2,0", "2,1,0,1"]  # DP2, TP2, PP2, TP2 with sequence parallelism


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
        with torch.no_grad():  # away from init values: norms != 1, biases != 0, a score head that spreads
            for param_name, param in model.named_parameters():
                if param_name.endswith("bias"):
                    param.normal_(0, 0.5)
                elif param.dim() == 1:
                    param.uniform_(0.5, 1.5)
                else:
                    param.normal_(0, 0.2)
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
