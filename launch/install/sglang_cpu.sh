#!/usr/bin/env bash
# CPU install tier for SGLang 0.5.23 (no GPU, no CUDA kernels).
#
# Usage: bash launch/install/sglang_cpu.sh PYTHON      (e.g. .venv/bin/python)
#
# Plain `pip install sglang` pulls ~4 GB of CUDA-only wheels (sglang-kernel has no CPU build on
# PyPI). Instead: install the GPU-free subset of sglang's requirements with the stack's pins held
# as constraints (so nothing already installed is churned), then sglang itself without deps.
# The missing `sgl_kernel` package is replaced, for server processes on CPU only, by the stand-in
# in launch/install/cpu_standins/ (engine/rollout/sglang_cpu.py puts it on PYTHONPATH).
# Idempotent: when everything is already installed pip only reports "already satisfied".
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash $0 PYTHON" >&2
    exit 2
fi
PYTHON="$1"
if ! "$PYTHON" -c "import sys" 2>/dev/null; then
    echo "[sglang_cpu] PYTHON '$PYTHON' is not a working interpreter" >&2
    exit 2
fi

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
REQUIREMENTS="$REPO/requirements/sglang-cpu.txt"
STANDINS="$HERE/cpu_standins"
SGLANG_VERSION="0.5.23"

# Held fixed while resolving sglang's dependencies: sglang pins these, and megatron/the base tier
# were installed against them.
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
cat >"$CONSTRAINTS" <<PINS
torch==2.14.1
torchvision==0.29.1
transformers==5.19.0
tokenizers==0.23.2
numpy<2.4
PINS

PIP=("$PYTHON" -m pip install --disable-pip-version-check)

echo "[sglang_cpu] installing $REQUIREMENTS (constraints: $(tr '\n' ' ' <"$CONSTRAINTS"))"
"${PIP[@]}" -c "$CONSTRAINTS" -r "$REQUIREMENTS"

installed="$("$PYTHON" -c "import importlib.metadata as m; print(m.version('sglang'))" 2>/dev/null || true)"
if [[ "$installed" != "$SGLANG_VERSION" ]]; then
    echo "[sglang_cpu] installing sglang==$SGLANG_VERSION without dependencies"
    "${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
else
    echo "[sglang_cpu] sglang==$SGLANG_VERSION already installed"
fi

# Verify the way the server will run: CPU engine on, the sgl_kernel stand-in on PYTHONPATH.
echo "[sglang_cpu] verifying: import sglang's server entry point with the CPU sgl_kernel stand-in"
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$STANDINS${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" - <<'PY'
import importlib.metadata

import sgl_kernel
import sglang
import sglang.srt.entrypoints.http_server  # noqa: F401  (what `python -m sglang.launch_server` imports)
import torch

assert getattr(sgl_kernel, "IS_TRIDENT_CPU_STANDIN", False), sgl_kernel.__file__
print(f"[sglang_cpu] ok: sglang {importlib.metadata.version('sglang')}, torch {torch.__version__}, "
      f"sgl_kernel stand-in at {sgl_kernel.__file__}")
PY
