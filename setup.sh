#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the main job: builds torchmem into .venv, profiles the bundled
# example training script under `torchmem run`, and prints its report.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "maturin>=1.9,<2" torch pytest ruff memory_profiler psutil numpy
.venv/bin/maturin develop -q --release
mkdir -p out
.venv/bin/torchmem info
.venv/bin/torchmem run -o out/example.sqlite -- examples/train.py --epochs 3
.venv/bin/torchmem report out/example.sqlite
.venv/bin/torchmem plot out/example.sqlite -o out/example.html
echo "HTML report: out/example.html"
