"""Worker: the actor and critic updates at several layouts of one torchrun world.

For each ``--layouts`` entry (tp,pp,vpp,sp,packing,dynamic[,ep]) the worker re-initialises megatron's
parallel state, loads the tiny HF Llama from --hf-dir into an actor and a critic, and runs on a
fixed batch (built from --seed, identical on every rank and in every launch):

- actor: old log-probs + entropy (forward-only), one PPO update (2 mini-batches; use_kl_loss and
  an entropy bonus on) -> metrics, then the exported HF weights;
- critic: values (forward-only), one clipped value-loss update -> metrics, exported weights.

Rank 0 writes ``{layout: {...}}`` to --out (JSON) and the weights to --out-dir/<layout>.pt; the
pytest side compares layouts. ``--check-vocab-parallel`` additionally checks the vocab-parallel
log-prob/entropy (values and gradients) against a float64 full-softmax reference at this world's
TP size, ``--check-reference`` compares old log-probs with transformers' forward (float64)
and checks ppo_kl == 0 on the first update, and ``--check-load-balancing`` / ``--check-routing``
check an MoE model's load-balancing loss and its routing-mismatch metric.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch


def make_batch(vocab_size: int, seed: int):
    """8 sequences: left-padded prompts (width 6) + right-padded responses (width 6)."""
    from engine.roles import RolloutBatch

    generator = torch.Generator().manual_seed(seed)
    batch, prompt, response = 8, 6, 6
    input_ids = torch.randint(0, vocab_size, (batch, prompt + response), generator=generator)
    attention_mask = torch.zeros(batch, prompt + response, dtype=torch.long)
    prompt_lengths = [6, 3, 5, 2, 4, 6, 1, 3]
    response_lengths = [6, 2, 4, 6, 1, 5, 3, 6]
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        attention_mask[row, prompt - p: prompt + r] = 1
    response_mask = attention_mask[:, prompt:].clone()
    advantages = torch.randn(batch, response, generator=generator)
    ref_log_probs = -torch.rand(batch, response, generator=generator) * 4
    returns = torch.randn(batch, response, generator=generator)
    return RolloutBatch(input_ids, attention_mask, response_mask, advantages=advantages,
                        ref_log_probs=ref_log_probs, returns=returns)


def parse_layout(text: str) -> dict:
    fields = text.split(",")
    comm = fields.pop() if len(fields) == 10 else "p2p"  # the CP comm type, a name
    values = [int(x) for x in fields]
    tp, pp, vpp, sp, packing, dynamic, ep, etp, cp = values + [1, 0, 1][len(values) - 6:]
    return dict(tp=tp, pp=pp, vpp=vpp or None, sp=bool(sp), packing=bool(packing), dynamic=bool(dynamic), ep=ep,
                etp=etp or None, cp=cp, comm=comm)


def use_layout(spec: dict):
    from megatron.core import parallel_state

    from parallel.layout import ParallelLayout
    from parallel.state import initialize_model_parallel

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    layout = ParallelLayout(spec["tp"], spec["pp"], spec["vpp"], sequence_parallel=spec["sp"],
                            context_parallel_size=spec.get("cp", 1), cp_comm_type=spec.get("comm", "p2p"),
                            expert_model_parallel_size=spec.get("ep", 1),
                            expert_tensor_parallel_size=spec.get("etp"))
    initialize_model_parallel(layout, seed=5)
    return layout


def set_value_head(chunks, seed: int) -> None:
    """The value head is absent from an LM checkpoint; give it the same weights in every layout."""
    from engine.models.gpt import ValueHead

    for chunk in chunks:
        head = getattr(chunk, "output_layer", None)
        if isinstance(head, ValueHead):
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * 0.05)
                head.bias.fill_(0.1)


def configs(spec: dict, dp_size: int, ppo_mini_batch_size: int = 4, shuffle: bool = True, micro: int | None = None):
    """Actor and critic settings (the experiment's own classes) and the actor's log-prob batching."""
    from engine.config import ActorConfig, CriticConfig, MegatronConfig, OptimConfig
    from engine.roles import MicroBatchConfig

    # 2 micro-batches per mini-batch on every layout: 4 sequences / DP ranks / micro size.
    micro = micro or max(1, ppo_mini_batch_size // dp_size // 2)
    common = dict(ppo_epochs=1, ppo_mini_batch_size=ppo_mini_batch_size, ppo_micro_batch_size_per_gpu=micro,
                  use_dynamic_bsz=spec["dynamic"], ppo_max_token_len_per_gpu=24, shuffle=shuffle,
                  optim=OptimConfig(lr=1e-3, betas=[0.9, 0.95], weight_decay=0.1, max_grad_norm=0.5, lr_warmup_steps=1,
                                    lr_decay_style="cosine", min_lr=1e-4),
                  megatron=MegatronConfig(use_distributed_optimizer=True, param_dtype="float32"))
    actor = ActorConfig(**common, clip_ratio=0.2, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1,
                        kl_loss_type="low_var_kl")
    critic = CriticConfig(**common, forward_micro_batch_size_per_gpu=micro, forward_max_token_len_per_gpu=24,
                          cliprange_value=0.2)
    log_prob_batches = MicroBatchConfig.of(micro, spec["dynamic"], 24)
    return actor, critic, log_prob_batches


TEMPERATURE = 0.8
SEED = 3


def run_layout(spec: dict, hf_dir: Path, seed: int, out_dir: Path, name: str) -> dict:
    from megatron.core import parallel_state

    from engine.models.checkpoint import export_hf_state_dict, load_hf_weights
    from engine.models.gpt import build_model_chunks
    from engine.roles import MegatronActor, MegatronCritic

    layout = use_layout(spec)
    dp_size = parallel_state.get_data_parallel_world_size()
    actor_config, critic_config, log_prob_batches = configs(spec, dp_size)
    result: dict = {"dp": dp_size}

    chunks = build_model_chunks(hf_dir, layout)
    load_hf_weights(chunks, hf_dir)
    batch = make_batch(chunks[0].hf_architecture.vocab_size, seed)
    actor = MegatronActor(chunks, actor_config, log_prob_batches=log_prob_batches, samples_per_prompt=1,
                          total_optimizer_steps=4, seed=SEED, use_remove_padding=spec["packing"])
    old = actor.compute_log_probs(batch, log_prob_batches, TEMPERATURE, compute_entropy=True)
    result["response_mask"] = batch.response_mask.tolist()  # outputs elsewhere are padding garbage
    result["old_log_probs"] = old["log_probs"].tolist()
    result["entropy"] = old["entropy"].tolist()
    result["actor"] = actor.update_policy(replace(batch, old_log_probs=old["log_probs"]), TEMPERATURE)
    # The experiment's defaults: gradient reduce and weight gather overlapped (megatron DDP); the
    # weights read below are the gathered ones only if the update gathered them at its end.
    result["overlap"] = [[chunk.ddp_config.overlap_grad_reduce, chunk.ddp_config.overlap_param_gather]
                         for chunk in actor.ddp_chunks]
    weights = {"actor." + k: v for k, v in export_hf_state_dict(chunks).items()}

    critic_chunks = build_model_chunks(hf_dir, layout, value_head=True)
    load_hf_weights(critic_chunks, hf_dir)
    set_value_head(critic_chunks, seed)
    critic_config.model.use_remove_padding = spec["packing"]
    critic = MegatronCritic(critic_chunks, critic_config, samples_per_prompt=1, total_optimizer_steps=4, seed=SEED)
    values = critic.compute_values(batch)
    result["values"] = values.tolist()
    result["critic"] = critic.update_critic(replace(batch, values=values))
    weights.update({"critic." + k: v for k, v in export_hf_state_dict(critic_chunks).items()})
    if torch.distributed.get_rank() == 0:
        torch.save(weights, out_dir / f"{name}.pt")
    return result


def check_vocab_parallel(results: dict) -> None:
    """Vocab-parallel log-probs/entropy at this world's TP size vs a float64 full softmax."""
    from megatron.core import parallel_state

    from engine.roles.vocab_parallel import vocab_parallel_log_probs

    from parallel.state import init_distributed

    init_distributed()
    use_layout(dict(tp=torch.distributed.get_world_size(), pp=1, vpp=None, sp=False))
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    generator = torch.Generator().manual_seed(0)
    vocab, padded = 37, 40  # 3 padded columns on the last rank must be ignored
    full = torch.randn(3, 5, padded, generator=generator, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (3, 5), generator=generator)
    weights_lp, weights_h = torch.randn(3, 5, generator=generator), torch.randn(3, 5, generator=generator)
    temperature = 0.7
    width = padded // tp_size
    local = full[..., tp_rank * width:(tp_rank + 1) * width].float().clone().requires_grad_(True)
    log_probs, entropy = vocab_parallel_log_probs(
        local, targets, temperature=temperature, vocab_size=vocab,
        tensor_parallel_group=parallel_state.get_tensor_model_parallel_group(), compute_entropy=True)
    ((log_probs * weights_lp).sum() + (entropy * weights_h).sum()).backward()

    reference = full.clone().requires_grad_(True)
    log_softmax = torch.log_softmax(reference[..., :vocab] / temperature, dim=-1)
    ref_lp = log_softmax.gather(-1, targets[..., None])[..., 0]
    ref_h = -(log_softmax.exp() * log_softmax).sum(-1)
    ((ref_lp * weights_lp.double()).sum() + (ref_h * weights_h.double()).sum()).backward()
    ref_grad = reference.grad[..., tp_rank * width:(tp_rank + 1) * width]
    errors = {
        "log_prob": float((log_probs.double() - ref_lp).abs().max()),
        "entropy": float((entropy.double() - ref_h).abs().max()),
        "grad": float((local.grad.double() - ref_grad).abs().max()),
    }
    if any(e > 1e-5 for e in errors.values()):
        raise AssertionError(f"vocab-parallel TP{tp_size} differs from float64: {errors}")
    results["vocab_parallel"] = {"tp": tp_size, **errors}


def check_reference(hf_dir: Path, seed: int, results: dict) -> None:
    """Old log-probs vs transformers (float64) and ppo_kl == 0 on the first update, TP1."""
    from transformers import AutoModelForCausalLM

    from engine.models.checkpoint import load_hf_weights
    from engine.models.gpt import build_model_chunks
    from engine.roles import MegatronActor
    from engine.roles.worker import response_columns

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    out = {}
    for packing in (False, True):
        spec = dict(tp=1, pp=1, vpp=None, sp=False, packing=packing, dynamic=False)
        layout = use_layout(spec)
        actor_config, _, log_prob_batches = configs(spec, 1, ppo_mini_batch_size=8, shuffle=False)
        chunks = build_model_chunks(hf_dir, layout)
        load_hf_weights(chunks, hf_dir)
        batch = make_batch(chunks[0].hf_architecture.vocab_size, seed)
        actor = MegatronActor(chunks, actor_config, log_prob_batches=log_prob_batches, samples_per_prompt=1,
                              total_optimizer_steps=4, seed=SEED, use_remove_padding=packing)
        old = actor.compute_old_log_probs(batch, TEMPERATURE)
        reference = torch.zeros_like(old, dtype=torch.float64)
        with torch.no_grad():
            for row in range(len(batch)):
                valid = batch.attention_mask[row].bool()
                tokens = batch.input_ids[row][valid]
                logits = hf_model(tokens[None]).logits[0] / TEMPERATURE
                log_probs = torch.log_softmax(logits, -1)[:-1].gather(-1, tokens[1:, None])[:, 0]
                full = torch.zeros(batch.input_ids.shape[1], dtype=torch.float64)
                full[valid.nonzero().flatten()[:-1]] = log_probs
                reference[row] = response_columns(full[None], batch.response_length)[0]
        mask = batch.response_mask.bool()
        metrics = actor.update_policy(replace(batch, old_log_probs=old), TEMPERATURE)
        out["packed" if packing else "padded"] = {
            "max_abs_error_vs_hf": float((old.double() - reference)[mask].abs().max()),
            "first_update_ppo_kl": metrics["actor/ppo_kl"],
        }
    results["reference"] = out


def check_load_balancing(hf_dir: Path, seed: int, results: dict) -> None:
    """The MoE load-balancing loss: reported at coefficient 0 as a float64 transformers reference
    computes it, the same when megatron adds it (coefficient 0.5), and the added loss's update the
    same at EP1/DP4 and EP2xTP2+SP/DP2. One optimizer step over the 8 sequences, one sequence per
    micro-batch (the loss is per micro-batch), so the reference is the mean over sequences."""
    from transformers import AutoModelForCausalLM

    from engine.models.checkpoint import export_hf_state_dict, load_hf_weights
    from engine.models.gpt import build_model_chunks
    from engine.roles import MegatronActor

    # transformers' grouped-GEMM experts have no float64 kernel; its per-expert loop does.
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, experts_implementation="eager").eval()
    batch = make_batch(hf_model.config.vocab_size, seed)
    experts, k = hf_model.config.num_experts, hf_model.config.num_experts_per_tok
    per_sequence = []
    with torch.no_grad():
        for row in range(len(batch)):
            tokens = batch.input_ids[row][batch.attention_mask[row].bool()]
            layers = hf_model(tokens[None], output_router_logits=True).router_logits
            losses = []
            for logits in layers:  # Switch Transformer: E * sum_i f_i * P_i
                probs = torch.softmax(logits, -1)
                chosen = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=-1).indices, 1.0)
                losses.append(experts * (chosen.mean(0) / k * probs.mean(0)).sum())
            per_sequence.append(torch.stack(losses).mean())
    out = {"reference": float(torch.stack(per_sequence).mean())}

    for name, spec, coeff in (("ep1", dict(ep=1), 0.0), ("ep1_added", dict(ep=1), 0.5),
                              ("ep2_tp2_added", dict(ep=2, tp=2, sp=True), 0.5)):
        spec = dict(dict(tp=1, pp=1, vpp=None, sp=False, packing=False, dynamic=False), **spec)
        layout = use_layout(spec)
        from megatron.core import parallel_state

        actor_config, _, log_prob_batches = configs(spec, parallel_state.get_data_parallel_world_size(),
                                                    ppo_mini_batch_size=8, shuffle=False, micro=1)
        actor_config.megatron.moe_aux_loss_coeff = coeff
        chunks = build_model_chunks(hf_dir, layout, moe_aux_loss_coeff=coeff)
        load_hf_weights(chunks, hf_dir)
        actor = MegatronActor(chunks, actor_config, log_prob_batches=log_prob_batches, samples_per_prompt=1,
                              total_optimizer_steps=4, seed=SEED)
        old = actor.compute_old_log_probs(batch, TEMPERATURE)
        metrics = actor.update_policy(replace(batch, old_log_probs=old), TEMPERATURE)
        weights = export_hf_state_dict(chunks)  # collective; {} off rank 0
        out[name] = {"loss": metrics["actor/moe_load_balancing_loss"], "grad_norm": metrics["actor/grad_norm"],
                     "routers": {key: value.tolist() for key, value in weights.items() if key.endswith("mlp.gate.weight")}}
    results["load_balancing"] = out


def forced_routing_log_probs(hf_model, batch, routing: torch.Tensor | None) -> torch.Tensor:
    """float64 log pi of ``batch``'s response tokens (``[B, R]``, 0 on padding) by transformers, with
    each token's experts forced to ``routing`` (``[B, S, L, k]``, -1: the router's own) through a hook
    on its routers: the mixing weights are the router's softmax at the forced experts, renormalised
    as Qwen3-MoE does (an engine that routed so, independently of megatron's replay)."""
    routers = [m for m in hf_model.modules() if type(m).__name__.endswith("TopKRouter")]
    forced: list[torch.Tensor | None] = [None]

    def hook(layer: int):
        def force(router, args, output):
            logits, scores, indices = output
            if forced[0] is None:
                return output
            wanted = forced[0][:, layer].long()
            reported = (wanted >= 0).all(dim=-1, keepdim=True)
            indices = torch.where(reported, wanted, indices)
            scores = torch.softmax(logits, dim=-1).gather(1, indices)
            if router.norm_topk_prob:
                scores = scores / scores.sum(dim=-1, keepdim=True)
            return logits, scores.to(logits.dtype), indices
        return force

    handles = [router.register_forward_hook(hook(layer)) for layer, router in enumerate(routers)]
    rows, width = batch.input_ids.shape
    response = batch.response_length
    out = torch.zeros(rows, response, dtype=torch.float64)
    try:
        with torch.no_grad():
            for row in range(rows):
                columns = batch.attention_mask[row].nonzero().flatten()
                forced[0] = None if routing is None else routing[row, columns]
                logits = hf_model(batch.input_ids[row, columns][None]).logits[0] / TEMPERATURE
                log_probs = torch.log_softmax(logits, -1)[:-1].gather(-1, batch.input_ids[row, columns][1:, None])[:, 0]
                targets = columns[1:]  # the log-prob of the token at each column after the first
                for position, column in enumerate(targets.tolist()):
                    if column >= width - response:
                        out[row, column - (width - response)] = log_probs[position]
    finally:
        for handle in handles:
            handle.remove()
    return out * batch.response_mask


def check_routing_mismatch(hf_dir: Path, seed: int, results: dict) -> None:
    """``rollout/routed_experts_mismatch`` of the old-log-prob pass at several layouts, against the
    routing transformers computes (float64) for every token but each row's last: 0 differing pairs,
    and exactly the corrupted share after replacing a quarter of layer 0's expert sets with others.
    With router replay (R3, ``megatron.moe_router_replay``) on the corrupted routing: 0 differing
    pairs, and the log-probs of a transformers forward forced to that routing (float64) within the
    dense models' tolerance; and an update that replays it."""
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from engine.models.checkpoint import export_hf_state_dict, load_hf_weights
    from engine.models.gpt import build_model_chunks
    from engine.roles import MegatronActor

    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64, experts_implementation="eager").eval()
    batch = make_batch(hf_model.config.vocab_size, seed)
    k = hf_model.config.num_experts_per_tok
    rows, width = batch.input_ids.shape
    layers = hf_model.config.num_hidden_layers - len(hf_model.config.mlp_only_layers)
    routed = torch.full((rows, width, layers, k), -1, dtype=torch.int16)
    with torch.no_grad():
        for row in range(rows):
            columns = batch.attention_mask[row].nonzero().flatten()
            logits = hf_model(batch.input_ids[row, columns][None], output_router_logits=True).router_logits
            chosen = torch.stack([layer.softmax(-1).topk(k).indices for layer in logits], dim=1)  # [T, L, k]
            routed[row, columns[:-1]] = chosen[:-1].to(torch.int16)  # an engine never feeds the last token
    corrupted = routed.clone()
    pairs = (corrupted[:, :, 0, 0] >= 0).nonzero()[::4]  # every 4th reported token, layer 0
    experts = hf_model.config.num_experts
    for row, column in pairs.tolist():
        others = [e for e in range(experts) if e not in corrupted[row, column, 0].tolist()]
        corrupted[row, column, 0] = torch.tensor(others[:k], dtype=torch.int16)
    natural_reference = forced_routing_log_probs(hf_model, batch, None)
    forced_reference = forced_routing_log_probs(hf_model, batch, corrupted)
    out = {"compared": int((routed[..., 0] >= 0).sum()), "corrupted": len(pairs),
           "forced_vs_natural": float((forced_reference - natural_reference).abs().max())}
    # tp,pp,vpp,sp,packing,dynamic,ep
    for text in ("1,1,0,0,0,0,2", "2,1,0,1,1,0,2", "1,2,0,0,0,1,2", "2,2,0,1,1,0,1"):
        spec = parse_layout(text)
        layout = use_layout(spec)
        actor_config, _, log_prob_batches = configs(spec, parallel_state.get_data_parallel_world_size())
        chunks = build_model_chunks(hf_dir, layout)
        load_hf_weights(chunks, hf_dir)
        measured = {}
        actor = MegatronActor(chunks, actor_config, log_prob_batches=log_prob_batches, samples_per_prompt=1,
                              total_optimizer_steps=4, seed=SEED, use_remove_padding=spec["packing"])
        for replay in (False, True):  # one actor (one DDP wrap of the chunks), the switch flipped
            actor.config = replace(actor_config, megatron=replace(actor_config.megatron, moe_router_replay=replay))
            for name, routing in (("same", routed), ("corrupted", corrupted)):
                metrics: dict = {}
                log_probs = actor.compute_old_log_probs(replace(batch, routed_experts=routing), TEMPERATURE, metrics)
                label = f"{'replayed_' if replay else ''}{name}"
                measured[label] = metrics["rollout/routed_experts_mismatch"]
                for reference_name, reference in (("natural", natural_reference), ("forced", forced_reference)):
                    gap = (log_probs.double() - reference) * batch.response_mask
                    measured[f"{label}_vs_{reference_name}"] = float(gap.abs().max())
        if text == "2,1,0,1,1,0,2":  # an update with the corrupted routing replayed: the routers still learn
            before = {key: value.clone() for key, value in export_hf_state_dict(chunks).items() if "mlp.gate." in key}
            update_batch = replace(batch, routed_experts=corrupted, old_log_probs=forced_reference.float())
            metrics = actor.update_policy(update_batch, TEMPERATURE)
            after = export_hf_state_dict(chunks)
            measured["update_grad_norm"] = metrics["actor/grad_norm"]
            measured["routers_changed"] = [bool((after[key] - value).abs().max() > 0) for key, value in before.items()]
        out[text] = measured
    results["routing"] = out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, required=True)
    parser.add_argument("--layouts", nargs="*", default=[], help="tp,pp,vpp,sp,packing,dynamic[,ep[,etp[,cp,comm]]] (etp 0 = tp; comm: a cp_comm_type)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-vocab-parallel", action="store_true")
    parser.add_argument("--check-reference", action="store_true")
    parser.add_argument("--check-load-balancing", action="store_true")
    parser.add_argument("--check-routing", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--out-dir", type=Path, required=True)
    args = parser.parse_args()

    from parallel.state import destroy_model_parallel

    results: dict = {"layouts": {}}
    if args.check_vocab_parallel:
        check_vocab_parallel(results)
    if args.check_reference:
        check_reference(args.hf_dir, args.seed, results)
    if args.check_load_balancing:
        check_load_balancing(args.hf_dir, args.seed, results)
    if args.check_routing:
        check_routing_mismatch(args.hf_dir, args.seed, results)
    for text in args.layouts:
        results["layouts"][text] = run_layout(parse_layout(text), args.hf_dir, args.seed, args.out_dir,
                                              text.replace(",", "_"))
    if torch.distributed.get_rank() == 0:
        args.out.write_text(json.dumps(results))
    destroy_model_parallel()


if __name__ == "__main__":
    main()
