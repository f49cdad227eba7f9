"""The floor: a plain single-process PyTorch PPO loop doing the same work as one Trident step.

    python -m benchmarks.plain_ppo --model DIR --data FILE.parquet --metrics OUT.jsonl [--steps 6]

No Trident code on the hot path (only the rule scorer, as the reward): transformers' Llama for
the actor, a frozen copy for the reference, a Llama backbone + linear head for the critic,
``generate`` with KV cache for the rollout, padded batches, ``torch.optim.AdamW``. One iteration is
the classic RLHF recipe (Ouyang et al. 2022): sample, old / reference log-probs, values, rule
reward with the KL penalty in it, GAE (Schulman et al. 2016), then ``ppo_epochs`` x mini-batches of
clipped-surrogate actor and clipped-value critic updates with gradient accumulation over
micro-batches and gradient clipping. Each iteration writes one JSON line with the same
``timing_s/<phase>`` and ``perf/total_num_tokens`` keys as Trident's ``metrics.jsonl``, so the suite
summarises both alike. It is a speed reference, not a trainer: no checkpoints, no validation.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
import transformers

from engine.rewards.registry import default_compute_score


@dataclass
class PlainPPOConfig:
    """The hyper-parameters of ``yaml/demo_cpu.yaml`` that shape the work of one iteration."""

    prompts: int = 32
    max_response_length: int = 8
    ppo_epochs: int = 2
    mini_batch: int = 32
    micro_batch: int = 8
    actor_lr: float = 1e-4
    critic_lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    clip_ratio: float = 0.2
    cliprange_value: float = 0.5
    kl_coef: float = 0.05
    gamma: float = 1.0
    lam: float = 0.95
    max_grad_norm: float = 1.0


class Critic(torch.nn.Module):
    """The actor's backbone with a scalar head: V(s_t) for every position."""

    def __init__(self, actor: transformers.PreTrainedModel):
        super().__init__()
        self.backbone = copy.deepcopy(actor.model)
        self.head = torch.nn.Linear(actor.config.hidden_size, 1)

    def forward(self, input_ids, attention_mask, position_ids):
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return self.head(hidden).squeeze(-1)


def _synchronize() -> None:
    if torch.cuda.is_available():  # a phase ends when its kernels have, not when they were queued
        torch.cuda.synchronize()


@contextmanager
def phase(name: str, timings: dict):
    _synchronize()
    start = time.perf_counter()
    yield
    _synchronize()
    timings[f"timing_s/{name}"] = time.perf_counter() - start


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def token_log_probs(model, input_ids, attention_mask, position_ids, prompt_width):
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, prompt_width - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, prompt_width:, None]).squeeze(-1)


def gae(rewards, values, mask, gamma, lam):
    """A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t (Schulman et al. 2016)."""
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):  # values are 0 past each response's end
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(last)
        last = rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * last
        advantages[:, t] = last
    returns = advantages + values
    mean, var = masked_mean(advantages, mask), masked_mean((advantages - masked_mean(advantages, mask)) ** 2, mask)
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask, returns


def minibatch_updates(cfg: PlainPPOConfig, rows: int, loss_fn, model, optimizer, mask):
    """ppo_epochs x shuffled mini-batches; micro-batch losses summed as the mini-batch's token mean."""
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(rows, device=mask.device)
        for mini in order.split(cfg.mini_batch):
            tokens = mask[mini].sum()
            for micro in mini.split(cfg.micro_batch):
                (loss_fn(micro) / tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def ppo_iteration(cfg, actor, reference, critic, actor_optim, critic_optim, tokenizer, rows) -> dict:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    eos = tokenizer.eos_token_id
    with phase("gen", timings), torch.no_grad():
        texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
        prompt = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(actor.device)
        sequences = actor.generate(**prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                   max_new_tokens=cfg.max_response_length, pad_token_id=tokenizer.pad_token_id,
                                   eos_token_id=eos)
    width = prompt["input_ids"].shape[1]
    response = sequences[:, width:]
    after_eos = (response == eos).long().cumsum(1) - (response == eos).long()  # tokens after the first EOS
    mask = (after_eos == 0).float()
    attention_mask = torch.cat([prompt["attention_mask"], mask.long()], 1)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    inputs = (sequences, attention_mask, position_ids)
    micro_batches = torch.arange(len(rows)).split(cfg.micro_batch)  # forward passes batched like the updates

    def forward(fn):
        return torch.cat([fn(*(x[micro] for x in inputs)) for micro in micro_batches])

    with phase("old_log_prob", timings), torch.no_grad():
        old_log_probs = forward(lambda *x: token_log_probs(actor, *x, width))
    with phase("ref", timings), torch.no_grad():
        ref_log_probs = forward(lambda *x: token_log_probs(reference, *x, width))
    with phase("values", timings), torch.no_grad():
        values = forward(critic).float()[:, width - 1:-1] * mask
    with phase("reward", timings):
        answers = tokenizer.batch_decode(response.masked_fill(mask == 0, tokenizer.pad_token_id), skip_special_tokens=True)
        scores = torch.tensor([float(default_compute_score(r["data_source"], a, r["reward_model"]["ground_truth"], r["extra_info"]))
                               for r, a in zip(rows, answers)], device=actor.device)
    with phase("adv", timings):
        last = (mask.sum(1).long() - 1).clamp(min=0)
        rewards = -cfg.kl_coef * (old_log_probs - ref_log_probs) * mask
        rewards[torch.arange(len(rows), device=actor.device), last] += scores
        advantages, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)

    def value_loss(micro):
        new = critic(*(x[micro] for x in inputs)).float()[:, width - 1:-1]
        clipped = values[micro] + (new - values[micro]).clamp(-cfg.cliprange_value, cfg.cliprange_value)
        loss = torch.max((new - returns[micro]) ** 2, (clipped - returns[micro]) ** 2)
        return 0.5 * (loss * mask[micro]).sum()

    def policy_loss(micro):
        ratio = torch.exp(token_log_probs(actor, *(x[micro] for x in inputs), width) - old_log_probs[micro])
        surrogate = torch.max(-advantages[micro] * ratio,
                              -advantages[micro] * ratio.clamp(1 - cfg.clip_ratio, 1 + cfg.clip_ratio))
        return (surrogate * mask[micro]).sum()

    with phase("update_critic", timings):
        minibatch_updates(cfg, len(rows), value_loss, critic, critic_optim, mask)
    with phase("update_actor", timings):
        minibatch_updates(cfg, len(rows), policy_loss, actor, actor_optim, mask)
    timings["timing_s/step"] = time.perf_counter() - start
    memory = ({"perf/max_memory_allocated_gb/step": torch.cuda.max_memory_allocated() / 2**30} if torch.cuda.is_available()
              else {"perf/max_rss_gb/step": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    return {**timings, **memory, "perf/total_num_tokens": float(attention_mask.sum()),
            "critic/score/mean": float(scores.mean()), "response_length/mean": float(mask.sum(1).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="HF Llama folder (actor, reference and critic init)")
    parser.add_argument("--data", type=Path, required=True, help="Trident-schema Parquet file of prompts")
    parser.add_argument("--metrics", type=Path, required=True, help="JSONL file, one line per iteration")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=PlainPPOConfig.prompts)
    parser.add_argument("--max-response-length", type=int, default=PlainPPOConfig.max_response_length)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    cfg = PlainPPOConfig(prompts=args.prompts, max_response_length=args.max_response_length,
                         mini_batch=min(PlainPPOConfig.mini_batch, args.prompts))
    torch.manual_seed(args.seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model, padding_side="left")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    actor = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device)
    reference = copy.deepcopy(actor).eval().requires_grad_(False)
    critic = Critic(actor).to(device, getattr(torch, args.dtype))
    actor_optim = torch.optim.AdamW(actor.parameters(), lr=cfg.actor_lr, betas=cfg.betas)
    critic_optim = torch.optim.AdamW(critic.parameters(), lr=cfg.critic_lr, betas=cfg.betas)
    table = pq.read_table(args.data).to_pylist()
    args.metrics.parent.mkdir(parents=True, exist_ok=True)
    with args.metrics.open("w") as out:
        for step in range(args.steps):
            rows = [table[(step * cfg.prompts + i) % len(table)] for i in range(cfg.prompts)]
            row = ppo_iteration(cfg, actor, reference, critic, actor_optim, critic_optim, tokenizer, rows)
            out.write(json.dumps({"step": step + 1, **row}) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
