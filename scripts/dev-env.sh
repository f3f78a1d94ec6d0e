#!/usr/bin/env bash
# Creates .venv (if missing) with everything torchmem's build, tests and benchmarks need, and builds torchmem into
# it (release): the `torchmem` binary (the torchmem-cli wheel), then the package with its extension. Shared by
# setup.sh and test.sh; safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, torchvision, maturin, pytest, memory_profiler, psutil, numpy, transformers, accelerate, lightning, pytorch_lightning, xdist, nbclient, nbformat, ipykernel, wandb, mlflow, prometheus_client, tensorboard, pandas, timm, peft" 2>/dev/null || [ ! -x .venv/bin/ruff ]; then
  # torch and its CUDA libraries need about 7 GiB unpacked, the Rust build about 4 GiB more.
  free_kib=$(df -Pk . | awk 'NR==2 {print $4}')
  if [ "${free_kib:-0}" -lt $((12 * 1024 * 1024)) ]; then
    echo "dev-env: only $((free_kib / 1024 / 1024)) GiB free here; the setup needs about 12 GiB (free some space first)" >&2
  fi
  .venv/bin/python -m pip install -q --no-cache-dir --upgrade pip
  .venv/bin/python -m pip install -q --no-cache-dir "maturin>=1.9,<2" torch torchvision pytest ruff memory_profiler psutil numpy transformers \
    accelerate lightning pytorch-lightning pytest-xdist nbclient nbformat ipykernel wandb mlflow-skinny \
    prometheus-client tensorboard pandas timm peft
fi
# pip (under maturin) prints one "Ignoring ipython: markers 'extra == "jupyter"' don't match your environment"
# per optional dependency: noise, dropped. Every other line (errors included) is shown; maturin's exit status
# is the script's.
# Two wheels (docs/benchmarks.md, "Packaging"): first the `torchmem` command, a native binary
# (crates/torchmem-cli/pyproject.toml, maturin's `bindings = "bin"`, into .venv/bin), then the package and its
# extension, which depends on it and does not link the command line.
# A venv from before the split has `torchmem` as the package's console script: pip would delete the binary at that
# path when it replaces the package, so that package goes first.
if grep -qs "bin/torchmem," .venv/lib/python*/site-packages/torchmem-[0-9]*.dist-info/RECORD; then
  .venv/bin/python -m pip uninstall -q -y torchmem
fi
set +e
.venv/bin/maturin develop -q --release -m crates/torchmem-cli/Cargo.toml 2>&1 | scripts/quiet-pip-markers.sh
status=${PIPESTATUS[0]}
if [ "$status" -eq 0 ]; then
  .venv/bin/maturin develop -q --release 2>&1 | scripts/quiet-pip-markers.sh
  status=${PIPESTATUS[0]}
fi
set -e
if [ "$status" -eq 0 ]; then
  # The editable install runs torchmem's Python from python/: compile its bytecode once, as pip does for a
  # wheel, so a profiled program does not compile torchmem's modules at its first step (42 ms on this VM
  # where PYTHONDONTWRITEBYTECODE is set: the watch imports its modules at the first forward).
  .venv/bin/python -m compileall -q python/torchmem >/dev/null
fi
exit "$status"
