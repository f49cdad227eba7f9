"""``python -m engine.rollout.sglang_launch ARGS``: ``sglang.launch_server ARGS``, with the API key
taken from the environment (``TRIDENT_ROLLOUT_API_KEY``) instead of the command line.

A key on the command line is readable by every user of the node (``/proc/<pid>/cmdline``, ``ps``),
and SGLang 0.5 logs its ``server_args`` with ``api_key`` in clear. Here the key goes into SGLang's
arguments inside the process and its start-up log shows ``<redacted>`` in its place.
"""
from __future__ import annotations

import os
import runpy
import sys

API_KEY_ENV = "TRIDENT_ROLLOUT_API_KEY"


def main() -> None:
    key = os.environ.get(API_KEY_ENV)
    if not key:
        sys.exit(f"engine.rollout.sglang_launch: {API_KEY_ENV} is not set (it carries the server's API key)")
    from sglang.srt.entrypoints import engine

    log_view = engine._server_args_for_logging  # the dict SGLang logs as server_args=...

    def redacted(server_args):
        return {**log_view(server_args), "api_key": "<redacted>"}

    engine._server_args_for_logging = redacted
    sys.argv = ["sglang.launch_server", *sys.argv[1:], "--api-key", key]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
