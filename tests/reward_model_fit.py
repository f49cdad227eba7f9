"""A tiny learned reward model for the demo task, fit by Bradley-Terry on generated preference pairs.

Training reward models is not Trident's job; the tests need a meaningful one. For the first
``questions`` prompts of the PPO training file, the demo's SFT'd Llama samples answers; each step
pairs a question's right answer (chosen) with wrong ones (rejected): two of the policy's own wrong
samples and fresh perturbations of the answer (near misses and other numbers of the answer range),
and a ``LlamaForSequenceClassification`` started from the demo model's body is fit on
-log sigmoid(r_chosen - r_rejected) (Bradley & Terry 1952; Ouyang et al. 2022), so that a higher
score means a better answer. A 1M-parameter model learns these questions' answers rather than
addition, so the PPO test trains on the same prompts (the reward model's prompt distribution, as in
RLHF). Recorded beside it: pairwise accuracy on fresh policy samples of those questions. The folder is
cached under ``.cache`` by a hash of the recipe and the demo model's, like the demo model.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.models.char_tokenizer import EOS_TOKEN_ID, PAD_TOKEN_ID
from engine.models.model_folder import exclusive_lock, staged_folder
from tests.distributed import REPO_ROOT

RECIPE_FILE = "reward_recipe.json"


@dataclass(frozen=True)
class RewardFitRecipe:
    questions: int = 64  # the first rows of the PPO training file
    samples_per_question: int = 4
    temperature: float = 1.0
    steps: int = 450  # 300 gave a pairwise accuracy of 0.785 (< the 0.8 the PPO test needs) on a 2-core EPYC; 450: 0.94
    questions_per_step: int = 16
    rejected_per_question: int = 6  # per step: up to 2 of the policy's wrong samples, the rest perturbations
    learning_rate: float = 1e-3
    seed: int = 0


@dataclass
class FittedRewardModel:
    path: Path
    pairwise_accuracy: float  # fresh (right answer, wrong policy sample) pairs of the questions ranked right
    train_file: Path  # the questions, as a PPO training file


def _sample_answers(model, tokenizer, questions: list[str], recipe: RewardFitRecipe) -> list[list[str]]:
    """``samples_per_question`` sampled answers per question from the demo policy."""
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, temperature=recipe.temperature, top_k=0, max_new_tokens=8,
                             num_return_sequences=recipe.samples_per_question, eos_token_id=EOS_TOKEN_ID,
                             pad_token_id=PAD_TOKEN_ID)
    decoded = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    n = recipe.samples_per_question
    return [decoded[i:i + n] for i in range(0, len(decoded), n)]


def _is_right(answer: str, truth: str) -> bool:
    return re.findall(r"-?\d+", answer)[-1:] == [truth]  # the demo's extraction: the last number


def _scores(model, sequences: list[list[int]]) -> torch.Tensor:
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(sequences):  # right padding: HF pools the last non-pad token
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def _rejected(truth: int, sampled: list[str], count: int, rng: random.Random) -> list[str]:
    """Up to 2 of the policy's wrong samples, then near misses (+-1..20) and other numbers (0-199)."""
    wrong = set(rng.sample(sampled, min(2, len(sampled))))
    while len(wrong) < count:
        number = truth + rng.choice([d for d in range(-20, 21) if d]) if rng.random() < 0.5 else rng.randrange(200)
        if number >= 0 and number != truth:
            wrong.add(str(number))
    return sorted(wrong)


def fit_demo_reward_model(demo_model, recipe: RewardFitRecipe = RewardFitRecipe()) -> FittedRewardModel:
    """The demo task's reward model folder (``LlamaForSequenceClassification``, the demo tokenizer),
    built once per recipe and demo model."""
    import pyarrow.parquet as pq
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForSequenceClassification

    from engine.data.schema import read_prompt_file
    from launch.prepare_demo_model import read_recipe_file

    demo_hash = read_recipe_file(demo_model.model_dir)["recipe_hash"]
    recipe_hash = hashlib.sha256(json.dumps([dataclasses.asdict(recipe), demo_hash]).encode()).hexdigest()[:16]
    out = REPO_ROOT / ".cache" / "models" / "demo-arith-reward"
    with exclusive_lock(out):
        recorded = json.loads((out / RECIPE_FILE).read_text()) if (out / RECIPE_FILE).is_file() else {}
        if recorded.get("recipe_hash") != recipe_hash:
            started = time.monotonic()
            torch.manual_seed(recipe.seed)
            rng = random.Random(recipe.seed)
            tokenizer = AutoTokenizer.from_pretrained(demo_model.model_dir)
            policy = AutoModelForCausalLM.from_pretrained(demo_model.model_dir, dtype=torch.float32).eval()
            records = read_prompt_file(demo_model.train_file)[:recipe.questions]
            questions = [r.messages[-1]["content"] for r in records]
            truths = [r.ground_truth for r in records]

            @functools.cache  # a question's answers repeat across the steps; the chat template is slow
            def encode(question: str, answer: str) -> list[int]:
                text = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                                      {"role": "assistant", "content": answer}], tokenize=False)
                return tokenizer(text, add_special_tokens=False)["input_ids"]

            wrong_samples = [[s for s in samples if not _is_right(s, truth)] for samples, truth in
                             zip(_sample_answers(policy, tokenizer, questions, recipe), truths)]
            model = LlamaForSequenceClassification.from_pretrained(demo_model.model_dir, num_labels=1,
                                                                   dtype=torch.float32)
            model.config.pad_token_id = PAD_TOKEN_ID
            optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
            model.train()
            for _ in range(recipe.steps):
                sequences, groups = [], []
                for index in rng.sample(range(len(questions)), recipe.questions_per_step):
                    rejected = _rejected(int(truths[index]), wrong_samples[index], recipe.rejected_per_question, rng)
                    groups.append((len(sequences), len(rejected)))
                    sequences += [encode(questions[index], truths[index])]
                    sequences += [encode(questions[index], answer) for answer in rejected]
                scores = _scores(model, sequences)
                margins = torch.cat([scores[first] - scores[first + 1:first + 1 + n] for first, n in groups])
                loss = -torch.nn.functional.logsigmoid(margins).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            model.eval()
            fresh = [(encode(q, truth), encode(q, s)) for q, truth, samples in
                     zip(questions, truths, _sample_answers(policy, tokenizer, questions, recipe))
                     for s in sorted(set(samples)) if not _is_right(s, truth)]
            with torch.no_grad():
                accuracy = (_scores(model, [c for c, _ in fresh]) > _scores(model, [r for _, r in fresh])).float().mean()
            with staged_folder(out) as staging:
                model.save_pretrained(staging)
                tokenizer.save_pretrained(staging)
                pq.write_table(pq.read_table(demo_model.train_file).slice(0, recipe.questions),
                               staging / "questions.parquet")
                recorded = {"recipe_hash": recipe_hash, "recipe": dataclasses.asdict(recipe),
                            "pairwise_accuracy": accuracy.item(), "fresh_pairs": len(fresh),
                            "final_loss": loss.item(), "build_seconds": round(time.monotonic() - started, 1)}
                (staging / RECIPE_FILE).write_text(json.dumps(recorded, indent=2) + "\n")
    return FittedRewardModel(out, recorded["pairwise_accuracy"], out / "questions.parquet")
