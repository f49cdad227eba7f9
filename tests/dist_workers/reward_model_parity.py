"""Worker: HF ``*ForSequenceClassification`` reward models on the Megatron mesh, against transformers.

For each reward-model folder and each layout (tp,pp,vpp[,sp]) in one torchrun world:
- the same conversations as policy rollouts (prompt in the policy's chat template + response
  tokens), scored through ``RewardModelScorer``:
  - with the reward model's own tokenizer, whose chat template differs from the policy's: the
    conversations are re-rendered and re-tokenized; scores vs ``AutoModelForSequenceClassification``
    on the reward model's rendering of each conversation;
  - with the policy's tokenizer (same template): the policy's token ids as they are, vs HF on them.
Rank 0 writes the largest differences to --out; every rank asserts them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tests.dist_workers.models_parity import parse_layout, use_layout

CONVERSATIONS = [
    ([{"role": "user", "content": "Calculate 5 + 3."}], "8"),
    ([{"role": "user", "content": "Calculate 85 + 60."}], "145"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Calculate 7 + 70."}], "I think 77"),
    ([{"role": "user", "content": "Calculate 1 + 1."}], ""),
    ([{"role": "user", "content": "Calculate 12 + 30."}], "42, because 12 + 30 = 42"),
    ([{"role": "user", "content": "What is 9 + 9?"}], "19"),
]


def policy_batch(tokenizer):
    """The conversations as the trainer holds them: left-padded prompts, right-padded responses
    ending in <|im_end|>."""
    from engine.rollout.agentic.trajectory import Trajectory
    from engine.trainer.rollout import to_rollout_batch

    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
               for m, _ in CONVERSATIONS]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for _, r in CONVERSATIONS]
    responses = [Trajectory(ids, [0.0] * len(ids), [1] * len(ids)) for ids in responses]
    return to_rollout_batch(prompts, responses, max(len(t.token_ids) for t in responses), tokenizer.pad_token_id)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rm-dirs", nargs="+", required=True)
    parser.add_argument("--policy-tokenizer", required=True)
    parser.add_argument("--layouts", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from engine.config.reward_model import RewardConfig, RewardModelCheckpointConfig
    from engine.models.checkpoint import load_hf_weights
    from engine.models.gpt import build_model_chunks
    from engine.rewards.reward_model import RewardModelInputs, RewardModelScorer
    from engine.roles.reward_model import MegatronRewardModel

    policy_tokenizer = AutoTokenizer.from_pretrained(args.policy_tokenizer)
    batch = policy_batch(policy_tokenizer)
    messages = [m for m, _ in CONVERSATIONS]
    responses = [r for _, r in CONVERSATIONS]
    results: dict = {}
    for rm_dir in map(Path, args.rm_dirs):
        hf = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32).eval()
        rm_tokenizer = AutoTokenizer.from_pretrained(rm_dir)
        assert rm_tokenizer.chat_template != policy_tokenizer.chat_template
        retokenizing = RewardModelInputs(policy_tokenizer, rm_tokenizer)
        as_is = RewardModelInputs(policy_tokenizer, policy_tokenizer)
        assert retokenizing.retokenize and not as_is.retokenize
        with torch.no_grad():
            expected = {
                "retokenized": torch.stack([hf(torch.tensor([ids])).logits[0, 0] for ids in
                                            retokenizing.sequences(batch, messages, responses)]),
                "policy_tokens": torch.stack([hf(torch.tensor([ids])).logits[0, 0] for ids in
                                              as_is.sequences(batch, messages, responses)]),
            }
        family = results.setdefault(rm_dir.name, {})
        for index, text in enumerate(args.layouts):
            layout = parse_layout(text)
            use_layout(layout)
            chunks = build_model_chunks(rm_dir, layout, value_head=True)
            # HF's score head has no bias: ours stays at its initial 0.
            missing = load_hf_weights(chunks, rm_dir)
            assert "output_layer.weight" not in missing, missing
            # Packed (THD) and left-aligned inputs alternate over the layouts.
            config = RewardConfig(micro_batch_size_per_gpu=2,
                                  model=RewardModelCheckpointConfig(use_remove_padding=index % 2 == 0))
            model = MegatronRewardModel(chunks, config)
            for name, inputs in (("retokenized", retokenizing), ("policy_tokens", as_is)):
                scores, metrics = RewardModelScorer(model, inputs).score(batch, messages, responses)
                diff = (scores - expected[name]).abs().max().item()
                family[f"{text}/{name}"] = {"max_abs_diff": diff, "retokenize_s": metrics["reward/model/retokenize_s"],
                                            "score_spread": (expected[name].max() - expected[name].min()).item()}
                assert diff <= 1e-4, f"{rm_dir.name} at {text} ({name}): max |megatron - HF| = {diff}"
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
