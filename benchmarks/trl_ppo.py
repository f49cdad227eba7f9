"""TRL's PPO trainer (trl 1.12.0, ``trl.experimental.ppo``) on the suite's workload, as a peer.

    python -m benchmarks.trl_ppo --model DIR --data FILE.parquet --metrics OUT.jsonl --work DIR [--steps 8]

Needs the optional tier ``requirements/trl.txt``. The same model, prompts (rendered with the model's
chat template), sampling, batch shape and PPO hyper-parameters as ``benchmarks.plain_ppo``:
32 prompts per step as 4 gradient-accumulation micro-batches of 8, 2 PPO epochs of one mini-batch,
GAE, KL penalty in the reward, clipped policy and value losses. Differences that are TRL's design,
not ours: its PPO needs a reward *model* (a ``LlamaForSequenceClassification`` on the same backbone
here: one more forward pass per step than a rule reward), and it updates policy and value head in
one backward pass with one optimizer. Each step writes a JSON line with ``timing_s/step`` (wall time
between TRL's step-end callbacks), ``perf/total_num_tokens`` (prompt + response tokens up to the
stop token; prompts counted at their mean length, as TRL's loader shuffles them), the keys the suite
summarises. Its reward model is untrained, so TRL's scores say nothing and are not reported.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch
import transformers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="TRL's output_dir (nothing is saved there)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-response-length", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    import datasets
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo_module

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, padding_side="left")
    rows = pq.read_table(args.data).to_pylist()[: args.prompts * args.steps]
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    dataset = datasets.Dataset.from_dict(
        {"input_ids": [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]})
    micro = 8
    config = PPOConfig(
        output_dir=str(args.work / "trl"), report_to=[], logging_steps=1, save_strategy="no", seed=args.seed,
        use_cpu=not torch.cuda.is_available(), per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.prompts // micro, num_mini_batches=1, num_ppo_epochs=2,
        local_rollout_forward_batch_size=micro, total_episodes=args.prompts * args.steps,
        response_length=args.max_response_length, stop_token="eos", temperature=1.0, learning_rate=1e-4,
        kl_coef=0.05, cliprange=0.2, cliprange_value=0.5, gamma=1.0, lam=0.95, num_sample_generations=0,
        max_grad_norm=1.0, dataloader_drop_last=True,
    )
    policy = transformers.AutoModelForCausalLM.from_pretrained(args.model)
    reference = transformers.AutoModelForCausalLM.from_pretrained(args.model)
    value_model = transformers.AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    reward_model = transformers.AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)

    tokens_per_step: list[int] = []
    truncate = trl_ppo_module.truncate_response

    def counting_truncate(stop_token_id, pad_token_id, responses):
        # Count the tokens TRL keeps (response up to its stop token) beside the prompt's, per step.
        out = truncate(stop_token_id, pad_token_id, responses)
        tokens_per_step.append(int((out != pad_token_id).sum()))
        return out

    trl_ppo_module.truncate_response = counting_truncate
    # TRL's dataloader shuffles, so a step's prompts are not known here: count them at the mean length.
    prompt_tokens = sum(len(ids) for ids in dataset["input_ids"]) / len(dataset) * args.prompts
    metrics_file = args.metrics.open("w")

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.last = None
            self.step = 0

        def on_train_begin(self, *_a, **_k):
            self.last = time.perf_counter()

        def on_step_end(self, *_a, **_k):
            now = time.perf_counter()
            tokens = prompt_tokens + sum(tokens_per_step)
            tokens_per_step.clear()
            self.step += 1
            metrics_file.write(json.dumps({"step": self.step, "timing_s/step": now - self.last,
                                           "perf/total_num_tokens": float(tokens)}) + "\n")
            metrics_file.flush()
            self.last = now

    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=reference,
                         reward_model=reward_model, train_dataset=dataset, value_model=value_model,
                         callbacks=[StepTimer()])
    trainer.train()
    metrics_file.close()


if __name__ == "__main__":
    main()
