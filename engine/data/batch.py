"""Collation of prompts into a left-padded batch that carries the per-prompt metadata for rewards."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from engine.config.data import DataConfig
from engine.data.dataset import PromptDataset, PromptSample
from engine.data.sampler import PromptSampler


@dataclass
class PromptBatch:
    """A batch of prompts, left-padded so that generation continues at the same column for every row.

    Attributes:
        input_ids: [batch, prompt_len] token ids, padding on the left.
        attention_mask: [batch, prompt_len] 1 on prompt tokens, 0 on padding.
        position_ids: [batch, prompt_len] 0-based positions of the prompt tokens (0 on padding).
        prompt_uids: [batch] int64 id of the prompt; the n responses sampled for one prompt share it,
            which is what GRPO/RLOO group by. Unique across the whole run for training batches.
        dataset_indices: [batch] int64 row of the prompt in its `PromptDataset`.
        raw_prompt_ids: unpadded token ids per row (what a rollout engine is sent).
        data_sources, ground_truths, extra_infos, abilities: the row metadata the reward needs.
        messages: the rows' chat messages before the template (a reward model or judge with a
            template of its own renders them again).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    prompt_uids: torch.Tensor
    dataset_indices: torch.Tensor
    raw_prompt_ids: list[list[int]]
    data_sources: list[str]
    ground_truths: list[Any]
    extra_infos: list[dict[str, Any]]
    abilities: list[str]
    messages: list[list[dict[str, str]]]

    def __len__(self) -> int:
        return len(self.raw_prompt_ids)

    def repeat_interleave(self, repeats: int) -> "PromptBatch":
        """Each prompt `repeats` times in a row (p0, p0, ..., p1, p1, ...): n samples per prompt."""
        if repeats < 1:
            raise ValueError(f"repeats={repeats}: must be at least 1")

        def repeat_list(values: list) -> list:
            return [value for value in values for _ in range(repeats)]

        return replace(
            self,
            input_ids=self.input_ids.repeat_interleave(repeats, dim=0),
            attention_mask=self.attention_mask.repeat_interleave(repeats, dim=0),
            position_ids=self.position_ids.repeat_interleave(repeats, dim=0),
            prompt_uids=self.prompt_uids.repeat_interleave(repeats),
            dataset_indices=self.dataset_indices.repeat_interleave(repeats),
            raw_prompt_ids=repeat_list(self.raw_prompt_ids), data_sources=repeat_list(self.data_sources),
            ground_truths=repeat_list(self.ground_truths), extra_infos=repeat_list(self.extra_infos),
            abilities=repeat_list(self.abilities), messages=repeat_list(self.messages))


def collate_prompts(samples: Sequence[PromptSample], dataset_indices: Sequence[int], prompt_uids: Sequence[int],
                    pad_token_id: int, pad_to_length: int | None = None) -> PromptBatch:
    """Left-pad `samples` to the longest prompt (or to `pad_to_length`) and gather their metadata.

    An empty list gives an empty batch (a rank's share of a short validation batch can be empty).
    """
    longest = max((len(sample.prompt_ids) for sample in samples), default=0)
    width = longest if pad_to_length is None else pad_to_length
    if width < longest:
        raise ValueError(f"pad_to_length={pad_to_length} is shorter than the longest prompt ({longest} tokens)")
    input_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        length = len(sample.prompt_ids)
        input_ids[row, width - length:] = torch.tensor(sample.prompt_ids, dtype=torch.long)
        attention_mask[row, width - length:] = 1
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return PromptBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        prompt_uids=torch.as_tensor(np.asarray(prompt_uids), dtype=torch.long),
        dataset_indices=torch.as_tensor(np.asarray(dataset_indices), dtype=torch.long),
        raw_prompt_ids=[list(sample.prompt_ids) for sample in samples],
        data_sources=[sample.record.data_source for sample in samples],
        ground_truths=[sample.record.ground_truth for sample in samples],
        extra_infos=[sample.record.extra_info for sample in samples],
        abilities=[sample.record.ability for sample in samples],
        messages=[sample.record.messages for sample in samples])


class PromptDataLoader:
    """Iterates this rank's `PromptBatch`es of a `PromptDataset`; its position lives in the sampler.

    Training prompt uids are `epoch * len(dataset) + dataset_index`: the same prompt drawn in two
    epochs gets two uids, so groups of responses never mix across steps.
    """

    def __init__(self, dataset: PromptDataset, sampler: PromptSampler, pad_to_length: int | None = None):
        if sampler.num_samples != len(dataset):
            raise ValueError(f"sampler covers {sampler.num_samples} samples but the dataset has {len(dataset)}")
        self.dataset = dataset
        self.sampler = sampler
        self.pad_to_length = pad_to_length

    @classmethod
    def for_training(cls, dataset: PromptDataset, config: DataConfig, *, data_parallel_rank: int = 0,
                     data_parallel_size: int = 1) -> "PromptDataLoader":
        """Shuffled (if `data.shuffle`) global batches of `data.train_batch_size` prompts."""
        sampler = PromptSampler(len(dataset), config.train_batch_size, data_parallel_rank=data_parallel_rank,
                                data_parallel_size=data_parallel_size, shuffle=config.shuffle, seed=config.seed,
                                drop_last=config.drop_last)
        return cls(dataset, sampler)

    @classmethod
    def for_validation(cls, dataset: PromptDataset, config: DataConfig, *, data_parallel_rank: int = 0,
                       data_parallel_size: int = 1) -> "PromptDataLoader":
        """Every validation prompt exactly once, in file order, `data.val_batch_size` at a time."""
        batch_size = config.val_batch_size or len(dataset)
        sampler = PromptSampler(len(dataset), batch_size, data_parallel_rank=data_parallel_rank,
                                data_parallel_size=data_parallel_size, shuffle=False, drop_last=False)
        return cls(dataset, sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[PromptBatch]:
        for indices in self.sampler:
            # After the sampler yields, its epoch is still the one this batch was drawn from.
            uids = self.sampler.epoch * len(self.dataset) + indices
            yield collate_prompts([self.dataset[int(i)] for i in indices], indices, uids,
                                  self.dataset.pad_token_id, self.pad_to_length)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
