"""The order table of ``make test``: how long each work unit took, recorded by every run and kept in
``tests/unit_seconds.json`` by this script.

A work unit is what pytest-xdist hands to one worker (an xdist group, or one test; see
``tests/conftest.py``). Every run writes its units' wall seconds (setup, call and teardown of
their tests, summed) to ``RUN_RECORD`` and prints the slowest 15; the order of the next runs comes
from ``TABLE``, which this script rewrites from a run's record:

    python -m tests.unit_seconds            # TABLE <- the last run's record (.cache/unit-seconds.json)
    python -m tests.unit_seconds RECORD     # TABLE <- that record
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RUN_RECORD = REPO_ROOT / ".cache" / "unit-seconds.json"
TABLE = Path(__file__).resolve().parent / "unit_seconds.json"
# Units shorter than this count as 1 s (conftest.py): their order changes nothing that matters.
KEPT_FROM_S = 10.0
SHOWN = 15


def load_table() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def slowest(seconds: dict[str, float], count: int = SHOWN) -> list[tuple[str, float]]:
    return sorted(seconds.items(), key=lambda unit: -unit[1])[:count]


def table_from(record: dict[str, float]) -> dict[str, int]:
    return {unit: round(value) for unit, value in slowest(record, len(record)) if value >= KEPT_FROM_S}


def main(argv: list[str]) -> None:
    record_path = Path(argv[0]) if argv else RUN_RECORD
    if not record_path.exists():
        sys.exit(f"no run record at {record_path}: `make test` writes one")
    table = table_from(json.loads(record_path.read_text()))
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{TABLE.relative_to(REPO_ROOT)}: {len(table)} units of {KEPT_FROM_S:.0f} s or more, from {record_path}")


if __name__ == "__main__":
    main(sys.argv[1:])
