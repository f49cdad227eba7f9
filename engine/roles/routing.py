"""Train/inference routing mismatch of MoE models: how often the trainer's experts are not the rollout's.

A token routed to other experts in training than in generation gets a different function: the
failure behind most MoE RL collapses (the log-prob gap, ``rollout/log_prob_abs_diff``, shows its
effect; this shows its cause). Where the rollout engine reports the experts it routed each token to
(``RolloutBatch.routed_experts``: the embedded engine does; SGLang only on CUDA, with
``--enable-return-routed-experts``, not wired up yet), the actor's old-log-prob pass, its first
forward with the weights that generated the batch, compares its own top-k choice of every MoE layer
with the rollout's: ``rollout/routed_experts_mismatch`` is the fraction of (token, MoE layer) pairs
whose expert sets differ, over every token the engine reported.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RoutingComparison:
    """Forward hooks on this rank's megatron routers that count (token, MoE layer) pairs whose top-k
    differs from the rollout's; set the micro-batch's expected routing with ``expect`` before each
    forward, read the global fraction with ``mismatch`` (collective), then ``close``.

    Tokens: megatron's routers see a micro-batch's ``[s, b]`` positions flattened s-major, and with
    sequence parallelism only this TP rank's slice of ``s``; without it every TP rank sees every
    token, so only TP rank 0 counts.
    """

    def __init__(self, model_chunks, tp_rank: int, tp_size: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.sequence_parallel = model_chunks[0].config.sequence_parallel and tp_size > 1
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.counts = torch.zeros(2, dtype=torch.float64)  # differing pairs, compared pairs
        moe_layers = model_chunks[0].hf_architecture.moe.layers
        self.moe_index = {layer: index for index, layer in enumerate(moe_layers)}
        self.expected: torch.Tensor | None = None
        self._handles = [module.register_forward_hook(self._compare)
                         for chunk in model_chunks for module in chunk.modules() if isinstance(module, TopKRouter)]

    def expect(self, layout, routed_experts: torch.Tensor) -> None:
        """The rollout's routing of one micro-batch (``routed_experts`` of its rows, ``[b, S, L, k]``)
        placed where ``layout`` (its ``TokenLayout``) puts each token, as this rank's routers see them."""
        rows, width = layout.input_ids.shape
        expected = torch.full((rows, width, *routed_experts.shape[2:]), -1, dtype=routed_experts.dtype)
        expected[layout.layout_rows.cpu(), layout.layout_cols.cpu()] = routed_experts[layout.rows.cpu(), layout.cols.cpu()]
        expected = expected.transpose(0, 1)  # [s, b, ...], megatron's order
        if self.sequence_parallel:
            expected = expected.chunk(self.tp_size, dim=0)[self.tp_rank]
        self.expected = expected.reshape(-1, *expected.shape[2:])

    def _compare(self, router, args, output) -> None:
        if self.expected is None or (not self.sequence_parallel and self.tp_rank != 0):
            return
        routing_map = output[1]  # [tokens, E] bool: the experts each token goes to
        expected = self.expected[:, self.moe_index[router.layer_number - 1]].to(routing_map.device).long()
        reported = (expected >= 0).all(dim=-1)
        rollout_map = torch.zeros_like(routing_map).scatter_(1, expected.clamp(min=0), True)
        differs = (rollout_map != routing_map).any(dim=-1) & reported
        self.counts += torch.tensor([float(differs.sum()), float(reported.sum())], dtype=torch.float64)

    def mismatch(self, device) -> float:
        """The fraction over every rank's compared pairs (collective over the world)."""
        counts = self.counts.to(device)
        dist.all_reduce(counts)
        return float(counts[0] / counts[1]) if counts[1] > 0 else 0.0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.expected = None
