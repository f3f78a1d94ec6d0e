#!/usr/bin/env bash
# Runs every test: Rust unit and integration tests, then pytest against the built extension and real torch, by
# layer (DEVELOPERS.md, "Tests"): tests/unit first (in-process, about a minute), then the end-to-end and framework
# layers, then the long truth replays (`-m slow`); each spread over every core by pytest-xdist (`-n auto`).
# Works on a fresh machine: it creates .venv and builds the extension first when needed.
set -euo pipefail
cd "$(dirname "$0")"
scripts/dev-env.sh
export PATH="$PWD/.venv/bin:$PATH"
export TORCHMEM_PYTHON="$PWD/.venv/bin/python"
export PYO3_PYTHON="$PWD/.venv/bin/python"
cargo test --workspace
pytest=(.venv/bin/python -m pytest -q -n auto --dist worksteal --durations=25)
failed=()
layer() {
  local name=$1 start=$SECONDS status=0
  shift
  "${pytest[@]}" "$@" || status=$?
  echo "test.sh: $name: $([ "$status" -eq 0 ] && echo passed || echo FAILED) in $((SECONDS - start)) s"
  [ "$status" -eq 0 ] || failed+=("$name")
}
# Every layer runs even when one before it failed, so that one run shows every failure.
layer unit tests/unit
layer "e2e and frameworks" -m "not slow" tests/e2e tests/frameworks tests/gpu
layer "slow truth replays" -m slow tests/e2e tests/frameworks tests/unit tests/gpu
if [ "${#failed[@]}" -ne 0 ]; then
  echo "test.sh: failed: ${failed[*]}" >&2
  exit 1
fi
