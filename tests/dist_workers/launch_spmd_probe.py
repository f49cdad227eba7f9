"""Worker: the smallest SPMD program, for the launchers' tests (Ray placement, torchrun env).

Takes the launchers' program arguments (the yaml, then key=value overrides) like launch.main does,
joins the process group from the torchrun environment with parallel.state.init_distributed,
all-reduces (rank + 1) and all-gathers what every rank saw; rank 0 writes it as JSON to the
path given by the ``out=PATH`` override. ``fail_rank=R`` makes rank R exit with status 3 first, in
every attempt of the job or, with ``fail_attempts=K``, in its first K (``TORCHELASTIC_RESTART_COUNT``).
"""

import json
import os
import sys


def main() -> None:
    experiment, *overrides = sys.argv[1:]
    options = dict(item.split("=", 1) for item in overrides)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if options.get("fail_rank") == os.environ["RANK"] and attempt < int(options.get("fail_attempts", 10**9)):
        print(f"rank {os.environ['RANK']} failing on purpose", flush=True)
        raise SystemExit(3)

    import torch
    import torch.distributed as dist

    from parallel.state import init_distributed

    init_distributed(timeout_minutes=2)
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    seen = {
        key: os.environ.get(key)
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RESTART_COUNT")
    }
    seen.update(dist_rank=dist.get_rank(), dist_world_size=dist.get_world_size(), pid=os.getpid())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seen)
    if dist.get_rank() == 0:
        with open(options["out"], "w") as handle:
            json.dump({"all_reduce": total.item(), "ranks": gathered, "experiment": experiment,
                       "overrides": overrides}, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
