"""Worker: SPMD reward scoring scores every response on exactly one rank and gives all ranks the same result.

The reward function (written by the test) draws a random score, appends "pid row" to a shared log
and raises on some rows, so a row scored twice, a row lost, or ranks disagreeing all show. Args:
REWARD_FILE LOG_FILE OUT_DIR NUM_WORKERS (0 = in-process scorers, > 0 = a Ray pool on rank 0).
"""
from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from engine.rewards import CustomRewardFunctionConfig, RewardConfig
from engine.rewards.spmd import reward_manager_for_this_rank, score_on_all_ranks
from parallel.state import init_distributed

ROWS = 23  # not a multiple of the world size


def main() -> None:
    reward_file, log_file, out_dir, num_workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    init_distributed()
    rank = dist.get_rank()
    config = RewardConfig(custom_reward_function=CustomRewardFunctionConfig(path=reward_file),
                          num_workers=num_workers, num_cpus_per_worker=0.5)
    manager = reward_manager_for_this_rank(config)
    try:
        assert (manager.pool is not None) == (num_workers > 0 and rank == 0), f"rank {rank}: pool {manager.pool}"
        responses = [str(row) for row in range(ROWS)]
        result = score_on_all_ranks(manager, responses, ["mine"] * ROWS, [None] * ROWS,
                                    [{"row": row} for row in range(ROWS)])
    finally:
        manager.close()
    record = {"rank": rank, "pid": os.getpid(), "scores": result.scores.tolist(), "errors": result.errors,
              "metrics": result.metrics}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
