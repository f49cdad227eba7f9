"""Seeded, resumable, data-parallel-aware sampling of prompt indices in global batches.

Every rank builds the same sampler (same seed, same dataset size) and draws the same global batch
at every step; it keeps the contiguous slice belonging to its data-parallel rank:

    global batch b of epoch e = permutation(seed, e)[b * B : (b + 1) * B]
    rank r's share            = global_batch[r * B / D : (r + 1) * B / D]        (D data-parallel ranks)

Contiguous shares (rather than strided) mean that concatenating the ranks' results in rank order,
as an all-gather over the data-parallel group does, gives back the global batch in order.

The position is global (epoch, batches consumed in that epoch, seed), not per rank, so a run can
resume with a different data-parallel size and still continue with exactly the next global batch.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np


class PromptSampler:
    """Yields this rank's dataset indices for each global batch of the current epoch, then moves on.

    Iterating consumes the rest of the current epoch; the trainer calls ``for indices in sampler``
    once per epoch. `state_dict()` taken after k batches of an epoch resumes at batch k + 1.

    Args:
        num_samples: dataset size.
        global_batch_size: prompts per global batch (`data.train_batch_size`), all ranks together.
        data_parallel_rank, data_parallel_size: this rank's position in the data-parallel group.
        shuffle: draw a fresh permutation per epoch; otherwise use dataset order.
        seed: shuffling seed.
        drop_last: drop the final incomplete global batch of an epoch (training: every batch is full
            and must split evenly over the ranks). Without it (validation), batches are split in
            contiguous chunks whose sizes differ by at most one, and the last batch may be short.
    """

    def __init__(self, num_samples: int, global_batch_size: int, *, data_parallel_rank: int = 0,
                 data_parallel_size: int = 1, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} is outside [0, {data_parallel_size})")
        if drop_last and global_batch_size % data_parallel_size != 0:
            raise ValueError(f"data.train_batch_size={global_batch_size} is not divisible by the data-parallel "
                             f"size {data_parallel_size}")
        if num_samples <= 0:
            raise ValueError("the dataset is empty")
        if seed < 0:
            raise ValueError(f"data.seed={seed}: must be >= 0")
        if drop_last and num_samples < global_batch_size:
            raise ValueError(f"the dataset has {num_samples} prompts, fewer than one global batch "
                             f"(data.train_batch_size={global_batch_size}); nothing to train on")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.index = 0  # global batches already handed out in `epoch`

    def __len__(self) -> int:
        """Global batches per epoch."""
        full, remainder = divmod(self.num_samples, self.global_batch_size)
        return full if self.drop_last or remainder == 0 else full + 1

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order in which epoch `epoch` visits the dataset (identical on every rank)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        # Seeding with the pair (seed, epoch) gives independent, reproducible streams per epoch.
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def global_batch_indices(self, epoch: int, batch_index: int) -> np.ndarray:
        """Dataset indices of global batch `batch_index` of epoch `epoch` (all ranks)."""
        if not 0 <= batch_index < len(self):
            raise IndexError(f"batch {batch_index} is outside the {len(self)} batches of an epoch")
        start = batch_index * self.global_batch_size
        return self.epoch_order(epoch)[start:start + self.global_batch_size]

    def rank_indices(self, epoch: int, batch_index: int) -> np.ndarray:
        """This rank's contiguous share of global batch `batch_index` of epoch `epoch`."""
        global_indices = self.global_batch_indices(epoch, batch_index)
        return np.array_split(global_indices, self.data_parallel_size)[self.data_parallel_rank]

    def __iter__(self) -> Iterator[np.ndarray]:
        while self.index < len(self):
            indices = self.rank_indices(self.epoch, self.index)
            self.index += 1
            yield indices
        self.epoch += 1
        self.index = 0

    def state_dict(self) -> dict[str, Any]:
        """The global position: save it with the checkpoint (identical on every rank)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "num_samples": self.num_samples,
                "global_batch_size": self.global_batch_size, "shuffle": self.shuffle, "drop_last": self.drop_last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a state drawn over a different dataset or batch size."""
        missing = {"epoch", "index", "seed", "num_samples", "global_batch_size"} - state.keys()
        if missing:
            raise KeyError(f"sampler state is missing {sorted(missing)}")
        for key in ("num_samples", "global_batch_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"cannot resume the prompt sampler: the checkpoint has {key}={state[key]} but this "
                                 f"run has {key}={getattr(self, key)} (the batches would not continue where they "
                                 f"stopped)")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
