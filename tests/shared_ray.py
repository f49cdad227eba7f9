"""A local Ray cluster that the jobs of one pytest process join through ``RAY_ADDRESS``.

    python -m tests.shared_ray NUM_CPUS      (started by the ``shared_ray`` fixture, tests/conftest.py)

Every job whose Ray reward pool starts a private cluster pays for it: ~3.5 s of wall time and ~4.6 s
of CPU to start the GCS, the raylet and their workers, and more to stop them, on a machine whose two
cores run the job's ranks and servers too. The jobs of one worker's rehearsals share this one instead
(``engine.rewards.ray_pool.ensure_ray_initialized`` joins the cluster in ``RAY_ADDRESS``). This process
is the cluster's first driver: it prints the address, waits until its stdin closes (the fixture's end,
or its pytest process gone), and stops the cluster with ``ray.shutdown()``.
"""
from __future__ import annotations

import logging
import sys

import ray


def main(num_cpus: int) -> None:
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    print(ray.get_runtime_context().gcs_address, flush=True)
    sys.stdin.read()  # until the fixture closes it, or its process is gone
    ray.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
