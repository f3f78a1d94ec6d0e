#!/usr/bin/env bash
# Sets everything up on a fresh machine and runs the main job: builds torchmem into .venv, profiles the bundled
# example training script under `torchmem run`, and prints its report.
set -euo pipefail
cd "$(dirname "$0")"
scripts/dev-env.sh
export PATH="$PWD/.venv/bin:$PATH"
mkdir -p out
torchmem info
torchmem run --force -o out/example.sqlite -- examples/train.py --epochs 3
torchmem report out/example.sqlite
torchmem plot out/example.sqlite -o out/example.html
echo "HTML report: out/example.html"
