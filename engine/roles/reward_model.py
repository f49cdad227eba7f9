"""The learned reward model: an HF ``*ForSequenceClassification`` checkpoint, frozen, on the Megatron mesh.

It is built like the critic (``build_model_chunks(..., value_head=True)``: the one-label ``score``
head is a ``[1, hidden]`` projection of the final hidden states, loaded from HF ``score.weight``)
and runs forward-only through megatron's pipeline schedules, sharded like the other roles. The
score of a sequence is the head's output at its last token, as HF's sequence classifiers pool.
"""

from __future__ import annotations

import torch

from engine.config.reward_model import RewardConfig
from engine.roles.batch import RolloutBatch
from engine.roles.worker import MegatronWorker, MicroBatchConfig, ModelInputs


class MegatronRewardModel(MegatronWorker):
    """Scores token sequences with a frozen reward model.

    Args:
        model_chunks: this rank's reward-model chunks (value-head model, HF weights loaded with a
            ``score.weight``).
        config: ``reward_model``: micro-batching of the scoring pass, sequence packing.
    """

    def __init__(self, model_chunks, config: RewardConfig) -> None:
        for chunk in model_chunks:
            chunk.requires_grad_(False)
        super().__init__(model_chunks, use_remove_padding=config.model.use_remove_padding)
        self.micro_batches = MicroBatchConfig.of(config.micro_batch_size_per_gpu, config.use_dynamic_bsz,
                                                 config.forward_max_token_len_per_gpu)

    def score(self, sequences: list[list[int]], pad_token_id: int = 0) -> torch.Tensor:
        """The reward of each whole token sequence (prompt and response, in the reward model's own
        tokens), ``[B]`` float32 on every rank. Every rank passes the same list."""
        batch = left_padded_batch(sequences, pad_token_id)

        def last_token_score(output: torch.Tensor, inputs: ModelInputs, micro_batch: RolloutBatch):
            # Rows are left-padded, so every sequence ends in the last column.
            return {"score": inputs.unpack(output[..., 0].float())[:, -1:]}

        scores = self.forward_per_token(batch, self.micro_batches, last_token_score, ["score"],
                                        "reward_model.forward_max_token_len_per_gpu")
        return scores["score"][:, 0]


def left_padded_batch(sequences: list[list[int]], pad_token_id: int) -> RolloutBatch:
    """Sequences as a left-padded ``RolloutBatch`` whose one-column "response" is each sequence's
    last token (the roles read per-row results from the response columns)."""
    if any(len(tokens) == 0 for tokens in sequences):
        raise ValueError("the reward model cannot score an empty sequence")
    width = max(2, max(len(tokens) for tokens in sequences))
    input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, tokens in enumerate(sequences):
        input_ids[row, width - len(tokens):] = torch.as_tensor(tokens, dtype=torch.long)
        attention_mask[row, width - len(tokens):] = 1
    return RolloutBatch(input_ids, attention_mask, torch.ones(len(sequences), 1))
