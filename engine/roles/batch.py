"""The step's one carrier: prompt + response token ids, per-response-token tensors, and what the
rollout said of each row. Each phase of the PPO step returns a new batch with its results."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from engine.rollout.agentic.trajectory import TrajectoryStats


@dataclass(frozen=True)
class SampleInfo:
    """One row's prompt record (the rewards' input) and what its trajectory did."""

    data_source: str
    ground_truth: Any
    extra_info: Any
    messages: list[dict]
    trajectory: "TrajectoryStats"


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
        response_mask: ``[B, R]`` the loss mask: 1 on the response tokens the model sampled (every
            turn's), 0 on padding and on the messages appended between turns (tool results, an
            environment's replies), which are context only (no policy loss, value target or KL).
        old_log_probs, ref_log_probs, advantages: ``[B, R]``, read by the actor update.
        values, returns: ``[B, R]``, read by the critic update (``values`` = V_old).
        routed_experts: ``[B, S, MoE layers, k]`` int16: the experts the rollout engine routed each
            token to (-1 where it did not say: padding, every row's last token), for engines that
            report them (``engine.roles.routing``).
        rollout_log_probs: ``[B, R]`` the engine's own log-probs of the sampled tokens (0 off the mask).
        token_versions: ``[B, R]`` the weight version that sampled each token (-1 off the mask),
            where the engine tags them (SGLang).
        uids: ``[B]`` the prompt group of each row (the group estimators' index).
        samples: a ``SampleInfo`` per row.
        policy_version: the weights' version when the batch's generation started.
        generation_s: how long the engine generated it.
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
    rollout_log_probs: torch.Tensor | None = None
    token_versions: torch.Tensor | None = None
    uids: torch.Tensor | None = None
    samples: list[SampleInfo] | None = None
    policy_version: int = 0
    generation_s: float = 0.0

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
        for name in ("old_log_probs", "ref_log_probs", "advantages", "values", "returns", "rollout_log_probs",
                     "token_versions"):
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
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                picked[field.name] = value[index.to(value.device)]
            elif isinstance(value, list):
                picked[field.name] = [value[i] for i in index.tolist()]
        return replace(self, **picked)

    @staticmethod
    def concat(batches: list["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """One batch of several generated with the same weights and response length (before the
        training phases): prompts left-padded to the widest; the generation time is the sum."""
        width = max(b.input_ids.shape[1] for b in batches)

        def joined(name: str, fill: int | None = None) -> torch.Tensor | list | None:
            values = [getattr(b, name) for b in batches]
            if all(v is None for v in values):
                return None
            if any(v is None for v in values):
                raise ValueError(f"batches to concatenate disagree on whether they have {name}")
            if isinstance(values[0], list):
                return [item for value in values for item in value]
            if fill is not None:  # a [B, S, ...] tensor: left-pad its prompt columns
                values = [torch.cat([torch.full((v.shape[0], width - v.shape[1], *v.shape[2:]), fill, dtype=v.dtype), v],
                                    dim=1) for v in values]
            return torch.cat(values)

        return RolloutBatch(joined("input_ids", pad_id), joined("attention_mask", 0), joined("response_mask"),
                            routed_experts=joined("routed_experts", -1), rollout_log_probs=joined("rollout_log_probs"),
                            token_versions=joined("token_versions"), uids=joined("uids"), samples=joined("samples"),
                            policy_version=batches[0].policy_version, generation_s=sum(b.generation_s for b in batches))

    def require(self, *names: str, role: str) -> None:
        """Raise naming the missing fields ``role`` needs."""
        missing = [name for name in names if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{role} needs RolloutBatch fields {missing}, which are None")
