#!/usr/bin/env bash
# The wheels a lent GPU machine lacks, for benchmarks.gpu_smoke: megatron-core and omegaconf, at the
# versions of this project's venv, for the machine's Python 3.12 (the venv's megatron-core wheel is
# cp311 and will not install there). The machine already has torch, transformers (and PyYAML),
# pyarrow, tensorboard, psutil and numpy (see the device tool's README).
#   bash benchmarks/gpu_wheels.sh [.venv/bin/python]     # -> .whl/ (git-ignored, ~3 MB)
# The device call carries .whl and installs them without an index:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:. python3 -m benchmarks.gpu_smoke --out $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
OUT=.whl
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$OUT" \
    "megatron-core==$(version megatron-core)" "omegaconf==$(version omegaconf)"
ls "$OUT"
