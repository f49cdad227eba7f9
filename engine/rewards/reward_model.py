"""Scores from the learned reward model: the rollouts in the reward model's own tokens, then its
forward pass on the Megatron mesh (``engine.roles.reward_model``).

A reward model trained with another tokenizer or chat template than the policy's must see each
conversation as it saw its training data: the prompt's messages and the decoded response are
rendered with the reward model's template and tokenized again (verl does the same). When the two
tokenizers agree on vocabulary and template, the policy's own token ids are scored as they are.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch

from engine.roles.batch import RolloutBatch
from engine.roles.reward_model import MegatronRewardModel

logger = logging.getLogger(__name__)


def same_tokenization(policy_tokenizer: Any, reward_tokenizer: Any) -> bool:
    """True when token ids of one mean the same text to the other, template included."""
    return (policy_tokenizer.get_vocab() == reward_tokenizer.get_vocab()
            and getattr(policy_tokenizer, "chat_template", None) == getattr(reward_tokenizer, "chat_template", None))


class RewardModelInputs:
    """The reward model's token sequences for the policy's rollouts."""

    def __init__(self, policy_tokenizer: Any, reward_tokenizer: Any) -> None:
        self.tokenizer = reward_tokenizer
        self.retokenize = not same_tokenization(policy_tokenizer, reward_tokenizer)
        if self.retokenize and not getattr(reward_tokenizer, "chat_template", None):
            raise ValueError("reward_model.model.tokenizer_path: the reward model's tokenizer differs from the "
                             "policy's and has no chat_template to render the conversations with")

    def sequences(self, batch: RolloutBatch, messages: Sequence[Sequence[dict[str, str]]],
                  responses: Sequence[str]) -> list[list[int]]:
        """Per row: the policy's prompt and response tokens as they are, or the conversation
        (``messages`` + the decoded response as the assistant turn) in the reward model's template."""
        if not self.retokenize:
            return [ids[mask.bool()].tolist() for ids, mask in zip(batch.input_ids, batch.attention_mask)]
        return [self.encode(list(turns) + [{"role": "assistant", "content": response}])
                for turns, response in zip(messages, responses)]

    def encode(self, conversation: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False)
        # The template writes the special tokens (BOS included) itself.
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


class RewardModelScorer:
    """``reward_model.enable``: the reward model's score of every response, on every rank."""

    def __init__(self, model: MegatronRewardModel, inputs: RewardModelInputs) -> None:
        self.model = model
        self.inputs = inputs
        self.pad_token_id = inputs.tokenizer.pad_token_id or 0
        logger.info("reward model inputs: %s", "re-tokenized with its own chat template" if inputs.retokenize
                    else "the policy's token ids (same tokenizer and template)")

    def score(self, batch: RolloutBatch, messages: Sequence[Sequence[dict[str, str]]], responses: Sequence[str]
              ) -> tuple[torch.Tensor, dict[str, float]]:
        """``[B]`` float32 scores and ``reward/model/retokenize_s`` (0 without re-tokenization)."""
        start = time.perf_counter()
        sequences = self.inputs.sequences(batch, messages, responses)
        retokenize_s = time.perf_counter() - start if self.inputs.retokenize else 0.0
        return self.model.score(sequences, self.pad_token_id), {"reward/model/retokenize_s": retokenize_s}
