"""SPMD reward scoring (engine.rewards.spmd) on a 3-rank gloo world: each response scored once, one result."""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.distributed import run_torchrun

pytestmark = pytest.mark.dist

WORLD = 3
ROWS = 23  # as in the worker
# Random scores: if two ranks scored the same row they would disagree. Rows 5 and 17 raise.
REWARD = textwrap.dedent('''
    import os
    import random

    LOG = {log!r}

    def compute_score(data_source, solution_str, ground_truth, extra_info):
        with open(LOG, "a") as handle:
            handle.write(f"{{os.getpid()}} {{extra_info['row']}}\\n")
        if extra_info["row"] in (5, 17):
            raise RuntimeError("judge unavailable")
        return {{"score": random.random(), "row_echo": float(solution_str)}}
''')


def run_world(tmp_path, num_workers: int) -> tuple[list[dict], list[tuple[int, int]]]:
    log = tmp_path / "calls.log"
    reward_file = tmp_path / "judge.py"
    reward_file.write_text(REWARD.format(log=str(log)))
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun("rewards_spmd.py", WORLD, [str(reward_file), str(log), str(out), str(num_workers)])
    records = sorted((json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)), key=lambda r: r["rank"])
    calls = [tuple(int(x) for x in line.split()) for line in log.read_text().splitlines()]
    return records, calls


def check_one_result(records, calls):
    assert sorted(row for _, row in calls) == list(range(ROWS)), "every row scored exactly once"
    first = records[0]
    for record in records[1:]:
        assert record["scores"] == first["scores"] and record["errors"] == first["errors"]
        assert record["metrics"] == first["metrics"]
    assert first["metrics"]["reward/errors"] == 2.0
    assert [i for i, e in enumerate(first["errors"]) if e] == [5, 17]
    assert first["scores"][5] == first["scores"][17] == 0.0
    expected_mean = sum(r for r in range(ROWS) if r not in (5, 17)) / (ROWS - 2)
    assert first["metrics"]["reward/row_echo/mean"] == pytest.approx(expected_mean)  # in input order
    assert len(set(first["scores"])) == ROWS - 1  # random scores, plus the two zeros


def test_in_process_scoring_is_split_over_the_ranks(tmp_path):
    records, calls = run_world(tmp_path, num_workers=0)
    check_one_result(records, calls)
    pid_of_rank = {record["pid"]: record["rank"] for record in records}
    # Rank r scores rows r, r + W, ...: the work is split, not repeated.
    assert all(pid_of_rank[pid] == row % WORLD for pid, row in calls)


@pytest.mark.slow
def test_a_ray_pool_scores_on_rank_zero_only(tmp_path):
    pytest.importorskip("ray")
    if os.environ.get("RAY_ADDRESS"):
        pytest.skip("starts a private local Ray instance")
    records, calls = run_world(tmp_path, num_workers=1)
    check_one_result(records, calls)
    assert not {pid for pid, _ in calls} & {record["pid"] for record in records}, "scored in the Ray worker"
