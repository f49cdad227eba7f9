"""The rollout's MoE routing in the trainer: measured (train/inference routing mismatch) and replayed (R3).

A token routed to other experts in training than in generation gets a different function: the
failure behind most MoE RL collapses (the log-prob gap, ``rollout/log_prob_abs_diff``, shows its
effect; the mismatch shows its cause). Where the rollout engine reports the experts it routed each
token to (``RolloutBatch.routed_experts``: the embedded engine does, and SGLang started with
``--enable-return-routed-experts``, which Trident asks for with replay on), two things use them:

- ``RoutingComparison``: the actor's old-log-prob pass, its first forward with the weights that
  generated the batch, compares its routers' top-k choice of every MoE layer with the rollout's:
  ``rollout/routed_experts_mismatch`` is the fraction of (token, MoE layer) pairs whose expert sets
  differ, over every token the engine reported.
- ``RoutingReplay`` (``actor.megatron.moe_router_replay``; Ma et al. 2025, "Stabilizing MoE RL by
  aligning training and inference routers", R3): the actor's routers take the rollout's experts
  for every reported token, in the old-log-prob pass and in the update, with the router's own
  probabilities of those experts (so the router still learns). It stands in megatron-core's
  ``RouterReplay`` on each router (``router.router_replay``, the hook megatron's top-k calls);
  tokens the engine did not report (padding, each row's last) keep the router's own choice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _RolloutRouting:
    """The rollout's routing of the micro-batch being run, placed as this rank's routers see its
    tokens: megatron's routers see a micro-batch's ``[s, b]`` positions flattened s-major, and with
    sequence parallelism only this TP rank's slice of ``s``; without it every TP rank sees every token."""

    def __init__(self, model_chunks, tp_rank: int, tp_size: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.sequence_parallel = model_chunks[0].config.sequence_parallel and tp_size > 1
        self.tp_rank, self.tp_size = tp_rank, tp_size
        moe_layers = model_chunks[0].hf_architecture.moe.layers
        self.moe_index = {layer: index for index, layer in enumerate(moe_layers)}
        self.routers = [module for chunk in model_chunks for module in chunk.modules() if isinstance(module, TopKRouter)]
        self.expected: torch.Tensor | None = None

    def expect(self, inputs, routed_experts: torch.Tensor) -> None:
        """The rollout's routing of one micro-batch (``routed_experts`` of its rows, ``[b, S, L, k]``)
        placed where its ``ModelInputs`` put each token (this CP rank's tokens under CP)."""
        layout = inputs.layout
        rows, width = layout.input_ids.shape
        expected = torch.full((rows, width, *routed_experts.shape[2:]), -1, dtype=routed_experts.dtype)
        expected[layout.layout_rows.cpu(), layout.layout_cols.cpu()] = routed_experts[layout.rows.cpu(), layout.cols.cpu()]
        if inputs.held_positions is not None:
            expected = expected[:, inputs.held_positions[inputs.cp_group.rank()]]
        expected = expected.transpose(0, 1)  # [s, b, ...], megatron's order
        if self.sequence_parallel:
            expected = expected.chunk(self.tp_size, dim=0)[self.tp_rank]
        self.expected = expected.reshape(-1, *expected.shape[2:])

    def of_router(self, router, device) -> torch.Tensor:
        """``[tokens, k]`` the rollout's experts for ``router``'s tokens (-1 where not reported)."""
        return self.expected[:, self.moe_index[router.layer_number - 1]].to(device).long()

    def close(self) -> None:
        self.expected = None


class RoutingComparison(_RolloutRouting):
    """Forward hooks on this rank's megatron routers that count (token, MoE layer) pairs whose top-k
    differs from the rollout's; set each micro-batch's expected routing with ``expect`` before its
    forward, read the global fraction with ``mismatch`` (collective), then ``close``. Without
    sequence parallelism every TP rank sees every token, so only TP rank 0 counts."""

    def __init__(self, model_chunks, tp_rank: int, tp_size: int) -> None:
        super().__init__(model_chunks, tp_rank, tp_size)
        self.counts = torch.zeros(2, dtype=torch.float64)  # differing pairs, compared pairs
        self._handles = [router.register_forward_hook(self._compare) for router in self.routers]

    def _compare(self, router, args, output) -> None:
        if self.expected is None or (not self.sequence_parallel and self.tp_rank != 0):
            return
        routing_map = output[1]  # [tokens, E] bool: the experts each token goes to
        expected = self.of_router(router, routing_map.device)
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
        super().close()


class RoutingReplay(_RolloutRouting):
    """R3 on this rank's routers until ``close``: each router's top-k is the rollout's for every
    token the engine reported (set each micro-batch's with ``expect`` before its forward).

    A micro-batch's routing stays set until the next one's forward, so a layer recomputed in its
    backward pass (``enable_gradient_checkpointing``) replays the same experts where the backward
    directly follows the forward (no pipeline parallelism; ``engine.config.validation`` refuses
    the combination otherwise)."""

    def __init__(self, model_chunks, tp_rank: int, tp_size: int) -> None:
        super().__init__(model_chunks, tp_rank, tp_size)
        self._replaced = [(router, router.router_replay) for router in self.routers]
        for router in self.routers:
            router.router_replay = _ReplayedTopK(self, router)

    def close(self) -> None:
        for router, original in self._replaced:
            router.router_replay = original
        super().close()


class _ReplayedTopK:
    """One router's stand-in for megatron's ``RouterReplay``: ``topk_routing_with_score_function``
    asks it for ``(top-k scores, top-k indices)`` of ``scores`` ``[tokens, E]``."""

    def __init__(self, routing: RoutingReplay, router) -> None:
        self.routing, self.router = routing, router

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.routing.expected is None:
            return values, indices
        rollout = self.routing.of_router(self.router, scores.device)
        if rollout.shape != indices.shape:
            raise RuntimeError(f"router replay: the rollout's routing {tuple(rollout.shape)} does not match layer "
                               f"{self.router.layer_number}'s tokens {tuple(indices.shape)}")
        indices = torch.where((rollout >= 0).all(dim=-1, keepdim=True), rollout, indices)
        return scores.gather(1, indices), indices
