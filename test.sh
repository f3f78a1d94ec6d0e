#!/usr/bin/env bash
# Runs every test: Rust unit and integration tests, then pytest against the built extension and real torch.
# Works on a fresh machine: it creates .venv and builds the extension first when needed.
set -euo pipefail
cd "$(dirname "$0")"
scripts/dev-env.sh
export PATH="$PWD/.venv/bin:$PATH"
export TORCHMEM_PYTHON="$PWD/.venv/bin/python"
export PYO3_PYTHON="$PWD/.venv/bin/python"
cargo test --workspace
.venv/bin/python -m pytest -q tests
