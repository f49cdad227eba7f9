"""The batch the training roles read: prompt + response token ids and per-response-token tensors."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Sequence

import torch


@dataclass
class RolloutBatch:
    """Sequences of one training step, the same on every rank that receives it.

    Layout: ``input_ids`` is ``[B, S]`` = prompt columns followed by the ``R`` response columns
    (``R = response_mask.shape[1]``); ``attention_mask`` marks the real tokens (prompts usually
    left-padded, responses right-padded). Response token ``t`` of row ``i`` sits at column
    ``S - R + t``; its log-prob and the value V(s_t) are read from the model output at column
    ``S - R + t - 1``.

    Attributes:
        input_ids: ``[B, S]`` token ids.
        attention_mask: ``[B, S]`` 1 on real tokens.
        response_mask: ``[B, R]`` 1 on response tokens the losses see.
        old_log_probs, ref_log_probs, advantages: ``[B, R]``, read by the actor update.
        values, returns: ``[B, R]``, read by the critic update (``values`` = V_old).
        routed_experts: ``[B, S, MoE layers, k]`` int16: the experts the rollout engine routed each
            token to (-1 where it did not say: padding, every row's last token), for engines that
            report them (``engine.roles.routing``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"input_ids {tuple(self.input_ids.shape)} and attention_mask "
                f"{tuple(self.attention_mask.shape)} must both be [batch, seq_len]"
            )
        batch, seq_len = self.input_ids.shape
        if self.response_mask.dim() != 2 or self.response_mask.shape[0] != batch or self.response_mask.shape[1] >= seq_len:
            raise ValueError(
                f"response_mask {tuple(self.response_mask.shape)} must be [batch={batch}, R] with "
                f"R < seq_len={seq_len} (at least one prompt column)"
            )
        for name in ("old_log_probs", "ref_log_probs", "advantages", "values", "returns"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.shape != self.response_mask.shape:
                raise ValueError(f"{name} {tuple(tensor.shape)} must match response_mask {tuple(self.response_mask.shape)}")
        if self.routed_experts is not None and (self.routed_experts.dim() != 4
                                                or self.routed_experts.shape[:2] != self.input_ids.shape):
            raise ValueError(f"routed_experts {tuple(self.routed_experts.shape)} must be [batch={batch}, "
                             f"seq_len={seq_len}, MoE layers, k]")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    def sequence_lengths(self) -> list[int]:
        """Real tokens per row (prompt + response), the weights of dynamic batching."""
        return self.attention_mask.sum(dim=1).tolist()

    def select(self, indices: Sequence[int]) -> "RolloutBatch":
        """The rows ``indices``, in that order."""
        index = torch.as_tensor(list(indices), dtype=torch.long)
        picked = {}
        for field in fields(self):
            tensor = getattr(self, field.name)
            picked[field.name] = None if tensor is None else tensor[index.to(tensor.device)]
        return replace(self, **picked)

    def require(self, *names: str, role: str) -> None:
        """Raise naming the missing fields ``role`` needs."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{role} needs RolloutBatch fields {missing}, which are None")
