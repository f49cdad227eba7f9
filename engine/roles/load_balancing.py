"""The MoE load-balancing loss of every update, reported whether or not it is trained on.

Switch Transformer's auxiliary loss (Fedus et al. 2022), per MoE layer, over the ``T`` tokens of a
micro-batch: ``E * sum_i f_i * P_i`` with ``f_i`` the fraction of the ``T * k`` top-k slots routed
to expert ``i`` and ``P_i`` the mean router probability of expert ``i``; 1 when the load is
uniform, ``E / k`` when every token goes to the same ``k`` experts.

With ``moe_aux_loss_coeff > 0`` megatron-core computes it, adds ``coeff *`` it to the loss and
records it (``moe_router_load_balancing_type="aux_loss"``). With 0 megatron computes nothing, so
a forward hook on each router records the same quantity with megatron's own functions, adding
nothing. Either way the reported value is the one whose gradient megatron adds: per micro-batch
(its tokens over the tensor/sequence-parallel group, padding excluded), averaged over micro-batches,
data-parallel ranks and MoE layers.
"""

from __future__ import annotations

import torch

TRACKED = "load_balancing_loss"  # megatron's name in its aux-loss tracker


def record_without_adding(model_chunks) -> None:
    """Record the loss of every router of ``model_chunks`` in training forwards (coefficient 0)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.register_forward_hook(_record, with_kwargs=True)


def _record(router, args, kwargs, output) -> None:
    # megatron's own condition: no loss in forward-only passes, nor in the no-grad first forward of
    # recomputed layers (the recomputation in the backward records it once).
    if not (router.training and torch.is_grad_enabled()):
        return
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        get_tokens_per_expert_and_token_count,
        save_to_aux_losses_tracker,
        switch_load_balancing_loss_func,
    )

    config = router.config
    padding_mask = args[1] if len(args) > 1 else kwargs.get("padding_mask")
    with torch.no_grad():
        logits = router.gating(args[0]).view(-1, config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        routing_map, scores = compute_routing_scores_for_aux_loss(
            logits, router.topk, router.score_function, padding_mask=padding_mask)
        tokens_per_expert, _, total_tokens = get_tokens_per_expert_and_token_count(
            routing_map, router.tp_cp_group, router.topk, with_padding_mask=padding_mask is not None)
        loss = switch_load_balancing_loss_func(scores, tokens_per_expert, total_tokens, router.topk,
                                               config.num_moe_experts, moe_aux_loss_coeff=1.0)
    save_to_aux_losses_tracker(TRACKED, loss, router.layer_number, config.num_layers,
                               reduce_group=router.tp_cp_group)


def clear() -> None:
    """Forget what earlier forwards recorded (megatron's tracker is process-global)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def take_load_balancing_loss(architecture, num_micro_batches: int) -> float:
    """The recorded loss of one optimizer step's ``num_micro_batches`` on this rank, averaged over
    micro-batches, data-parallel ranks and MoE layers; collective over the pipeline, tensor and
    data-parallel groups (every rank calls it). Clears the record. ``architecture``: the model's
    ``ModelArchitecture``."""
    from megatron.core.transformer.moe.moe_utils import (
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
        save_to_aux_losses_tracker,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    if TRACKED not in tracker:
        # A pipeline stage without MoE layers still joins the all-reduce over the pipeline (its other
        # groups lie within the stage, so they all skip the rest alike).
        from parallel.state import device

        save_to_aux_losses_tracker(TRACKED, torch.zeros((), device=device()), 1, architecture.num_layers)
    values = tracker[TRACKED]["values"]
    values /= num_micro_batches  # before the data-parallel average: ranks may differ in micro-batches
    reduce_aux_losses_tracker_across_ranks([TRACKED])
    value = float(values[list(architecture.moe.layers)].mean())
    clear()
    return value
