#!/usr/bin/env bash
# Runs every test: Rust unit and integration tests, then pytest against the built extension and real torch.
# Expects ./setup.sh to have run once (it builds .venv); builds the extension again if sources changed.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
  echo "test.sh: no .venv yet; run ./setup.sh first" >&2
  exit 2
fi
export PATH="$PWD/.venv/bin:$PATH"
cargo test --workspace --exclude torchmem-py
.venv/bin/maturin develop -q --release
.venv/bin/python -m pytest -q tests
