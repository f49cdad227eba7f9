"""How long a crashed SGLang server takes to come back: started as a process of its own (importing
SGLang again) vs forked from this process's forkserver (``engine.rollout.sglang_forkserver``).

    python -m benchmarks.server_restart --out server_restart.json [--repeats 3]

Each case starts one CPU server for a tiny random Llama as ``rollout.max_server_restarts`` would
see it, SIGKILLs its process group, and times ``SGLangServer.restart`` (stop what is left, start,
wait until it generates a token from its own process, ``READY_PATH``). ``plain`` runs with
``TRIDENT_SGLANG_FORKSERVER=off``; ``forked`` waits for this process's own forkserver first (it
starts once the first server answers). Both run in the same invocation; the least and all of
``--repeats`` restarts are reported.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import tempfile
import time
from pathlib import Path

CASES = ("plain", "forked")


def tiny_model(folder: Path) -> Path:
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def restart_seconds(case: str, model: Path, folder: Path, repeats: int) -> list[float]:
    from engine.config import RolloutConfig
    from engine.rollout import sglang_forkserver
    from engine.rollout.sglang_server import SGLangServer, SGLangServerConfig

    if case == "plain":
        os.environ[sglang_forkserver.FORKSERVER_ENV] = "off"
    else:
        os.environ.pop(sglang_forkserver.FORKSERVER_ENV, None)
    rollout = RolloutConfig(name="sglang", gpu_memory_utilization=0.05, dtype="float32", startup_timeout_s=600)
    server = SGLangServer(SGLangServerConfig(model_path=str(model), log_path=folder / f"{case}.log", rollout=rollout,
                                             skip_tokenizer_init=True))
    server.start()
    server.wait_until_ready()
    own = sglang_forkserver._OwnForkserver
    if case == "forked":
        state = sglang_forkserver.wait_for_forkserver(own.socket_path, own.process)
        if state != "ready":
            raise RuntimeError(f"the forkserver did not serve: {state}")
    seconds = []
    try:
        for _ in range(repeats):
            os.killpg(server.process.pid, signal.SIGKILL)  # a crash: nothing of it is left to stop gracefully
            started = time.perf_counter()
            server.restart()
            seconds.append(time.perf_counter() - started)
    finally:
        server.stop()
    forked = "forked from the SGLang forkserver" in server.log_path.read_text()
    if forked != (case == "forked"):
        raise RuntimeError(f"case {case}: the restarted server was {'' if forked else 'not '}forked ({server.log_path})")
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("server_restart.json"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    folder = Path(tempfile.mkdtemp(prefix="trident-server-restart-"))
    model = tiny_model(folder / "model")
    results = {case: restart_seconds(case, model, folder, args.repeats) for case in CASES}
    report = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "restart_s": {case: {"least": round(min(values), 2), "all": [round(v, 2) for v in values]}
                            for case, values in results.items()}}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["restart_s"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
