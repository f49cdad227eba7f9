"""Expand a Slurm hostlist ("node[01-03,07],gpu-a[1-2]-ib") into host names, one per line.

The same expansion as ``scontrol show hostnames``, in plain Python, so the batch scripts' dry runs
work outside a Slurm cluster: ``python -m launch.slurm.hostlist "$SLURM_JOB_NODELIST"``.
"""

from __future__ import annotations

import re
import sys

_BRACKET = re.compile(r"\[([^\]]*)\]")


class HostlistError(ValueError):
    """A malformed hostlist; the message quotes it."""


def _split_top_level(hostlist: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(hostlist):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in hostlist {hostlist!r}")
        elif char == "," and depth == 0:
            parts.append(hostlist[start:index])
            start = index + 1
    if depth:
        raise HostlistError(f"unbalanced '[' in hostlist {hostlist!r}")
    parts.append(hostlist[start:])
    return [part for part in parts if part]


def _expand_range(spec: str, hostlist: str) -> list[str]:
    values = []
    for item in spec.split(","):
        low, _, high = item.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise HostlistError(f"bad range {item!r} in hostlist {hostlist!r}")
        high = high or low
        if int(high) < int(low):
            raise HostlistError(f"descending range {item!r} in hostlist {hostlist!r}")
        width = len(low)  # node[01-10] keeps the zero padding of the lower bound
        values += [str(number).zfill(width) for number in range(int(low), int(high) + 1)]
    return values


def expand_hostlist(hostlist: str) -> list[str]:
    """Host names of a Slurm hostlist, in Slurm's order."""
    hosts: list[str] = []
    for part in _split_top_level(hostlist.strip()):
        match = _BRACKET.search(part)
        if match is None:
            hosts.append(part)
            continue
        head, tail = part[: match.start()], part[match.end():]
        for value in _expand_range(match.group(1), hostlist):
            hosts += expand_hostlist(head + value + tail)  # further bracket groups in the tail
    return hosts


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m launch.slurm.hostlist HOSTLIST", file=sys.stderr)
        return 2
    try:
        print("\n".join(expand_hostlist(args[0])))
    except HostlistError as err:
        print(f"launch.slurm.hostlist: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
