"""A tiny learned reward model for the demo task, fit by Bradley-Terry on generated preference pairs.

Training reward models is not Trident's job; the tests need a meaningful one. The demo's SFT'd Llama
samples answers to arithmetic questions of the task generator (not those of the PPO Parquet files);
each wrong sample is paired with the right answer (chosen) and a ``LlamaForSequenceClassification``
started from the demo model's body is fit on -log sigmoid(r_chosen - r_rejected) (Bradley & Terry
1952; Ouyang et al. 2022), so that a higher score means a better answer. Its pairwise accuracy on
pairs from the validation questions is recorded beside it. The folder is cached under ``.cache`` by
a hash of the recipe and the demo model's, like the demo model.
"""
from __future__ import annotations

import dataclasses
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
    samples_per_question: int = 4
    temperature: float = 1.0
    steps: int = 400
    pairs_per_step: int = 64
    learning_rate: float = 1e-3
    seed: int = 0


@dataclass
class FittedRewardModel:
    path: Path
    pairwise_accuracy: float  # fresh pairs of the training questions ranked right
    unseen_question_accuracy: float  # pairs of the validation questions ranked right
    train_pairs: int


def _sample_answers(model, tokenizer, questions: list[str], recipe: RewardFitRecipe) -> list[list[str]]:
    """``samples_per_question`` sampled answers per question from the demo policy."""
    answers: list[list[str]] = []
    tokenizer.padding_side = "left"
    for start in range(0, len(questions), 512):
        chunk = questions[start:start + 512]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False) for q in chunk]
        batch = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=recipe.temperature, top_k=0, max_new_tokens=8,
                                 num_return_sequences=recipe.samples_per_question, eos_token_id=EOS_TOKEN_ID,
                                 pad_token_id=PAD_TOKEN_ID)
        decoded = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        n = recipe.samples_per_question
        answers += [decoded[i:i + n] for i in range(0, len(decoded), n)]
    return answers


def preference_pairs(model, tokenizer, questions: list[str], truths: list[str], recipe: RewardFitRecipe
                     ) -> list[tuple[list[int], list[int]]]:
    """(chosen, rejected) token ids: the right answer against each distinct wrong sample (the demo's
    answer extraction: the last number of the response)."""
    def encode(question: str, answer: str) -> list[int]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}], tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    pairs = []
    for question, truth, samples in zip(questions, truths, _sample_answers(model, tokenizer, questions, recipe)):
        for wrong in sorted({s for s in samples if re.findall(r"-?\d+", s)[-1:] != [truth]}):
            pairs.append((encode(question, truth), encode(question, wrong)))
    return pairs


def _scores(model, sequences: list[list[int]]) -> torch.Tensor:
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), PAD_TOKEN_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(sequences):  # right padding: HF pools the last non-pad token
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    return model(input_ids=ids, attention_mask=mask).logits[:, 0]


def pairwise_accuracy(model, pairs) -> float:
    with torch.no_grad():
        chosen = _scores(model, [c for c, _ in pairs])
        rejected = _scores(model, [r for _, r in pairs])
    return (chosen > rejected).float().mean().item()


def fit_demo_reward_model(demo_model, recipe: RewardFitRecipe = RewardFitRecipe()) -> FittedRewardModel:
    """The demo task's reward model folder (``LlamaForSequenceClassification``, the demo tokenizer),
    built once per recipe and demo model."""
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
            tokenizer = AutoTokenizer.from_pretrained(demo_model.model_dir)
            policy = AutoModelForCausalLM.from_pretrained(demo_model.model_dir, dtype=torch.float32).eval()

            def pairs_of(records):
                return preference_pairs(policy, tokenizer, [r.messages[-1]["content"] for r in records],
                                        [r.ground_truth for r in records], recipe)

            train_records = read_prompt_file(demo_model.train_file)
            train, fresh, unseen = pairs_of(train_records), pairs_of(train_records[::10]), pairs_of(
                read_prompt_file(demo_model.val_file))
            model = LlamaForSequenceClassification.from_pretrained(demo_model.model_dir, num_labels=1,
                                                                   dtype=torch.float32)
            model.config.pad_token_id = PAD_TOKEN_ID
            optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate)
            order = random.Random(recipe.seed)
            model.train()
            for _ in range(recipe.steps):
                batch = order.sample(train, min(recipe.pairs_per_step, len(train)))
                chosen = _scores(model, [c for c, _ in batch])
                rejected = _scores(model, [r for _, r in batch])
                loss = -torch.nn.functional.logsigmoid(chosen - rejected).mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            model.eval()
            with staged_folder(out) as staging:
                model.save_pretrained(staging)
                tokenizer.save_pretrained(staging)
                recorded = {"recipe_hash": recipe_hash, "recipe": dataclasses.asdict(recipe), "train_pairs": len(train),
                            "pairwise_accuracy": pairwise_accuracy(model, fresh),
                            "unseen_question_accuracy": pairwise_accuracy(model, unseen),
                            "build_seconds": round(time.monotonic() - started, 1)}
                (staging / RECIPE_FILE).write_text(json.dumps(recorded, indent=2) + "\n")
    return FittedRewardModel(out, recorded["pairwise_accuracy"], recorded["unseen_question_accuracy"],
                             recorded["train_pairs"])
