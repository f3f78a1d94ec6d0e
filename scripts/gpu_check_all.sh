#!/usr/bin/env bash
# Runs the GPU tests (tests/gpu, marker `gpu`) with pytest on the device machine; leaves under $OUT the GPU and
# torch versions (gpu.txt), pytest's whole output with the -rA summary (pytest.txt: every test's outcome, the
# captured INFO/bench prints of the passing ones, the failures' assert messages), a JUnit XML report with each
# test's output (junit.xml) and one line per test file (summary.txt).
#
# The wheel built here (`maturin build --release -o .whl`) and, where the device's Python lacks pytest, pytest's
# wheels (pytest, pluggy, iniconfig, packaging, pygments) travel with `carry: [".whl"]`; every .whl/*.whl is
# installed with --target --upgrade (a warm machine keeps /tmp/site from an earlier call: without --upgrade pip
# would keep the earlier wheel's files).
#
#   bash scripts/gpu_check_all.sh                                   # every GPU test (more than one 10-minute call)
#   bash scripts/gpu_check_all.sh tests/gpu/test_gpu_api.py tests/gpu/test_gpu_run.py
#   bash scripts/gpu_check_all.sh tests/gpu/test_gpu_breakdown.py -k "not cost"
#
# Arguments are pytest's (files, -k, ...); none means tests/gpu. GPU_CHECK_TIMEOUT_S (default 560) bounds the
# pytest call; a call cut short still leaves what ran in pytest.txt. Exit status: pytest's (124 when cut short).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT" /tmp/site
if ! python3 -m pip install -q --no-deps --upgrade --target /tmp/site .whl/*.whl > "$OUT/install.txt" 2>&1; then
  echo "wheel install failed"; cat "$OUT/install.txt"; exit 2
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c 'import torch,sys; print(torch.__version__, torch.version.cuda, sys.version)';
  python3 -m pytest --version; } > "$OUT/gpu.txt" 2>&1
[ $# -eq 0 ] && set -- tests/gpu
t0=$(date +%s)
timeout "${GPU_CHECK_TIMEOUT_S:-560}" python3 -m pytest -m gpu -rA -p no:cacheprovider --durations=25 \
  --junitxml "$OUT/junit.xml" -o junit_logging=all "$@" > "$OUT/pytest.txt" 2>&1
rc=$?
# one line per test file: its outcomes, from the JUnit report
{
  echo "pytest -m gpu $* rc=$rc $(( $(date +%s) - t0 ))s: $(tail -n 1 "$OUT/pytest.txt")"
  python3 - "$OUT/junit.xml" <<'PY'
import collections, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    sys.exit(f"no JUnit report: {e}")
counts = collections.defaultdict(collections.Counter)
for case in root.iter("testcase"):
    kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
    counts[case.get("classname", "?")][kinds[0] if kinds else "passed"] += 1
for name, c in sorted(counts.items()):
    print(name, " ".join(f"{k}={v}" for k, v in sorted(c.items())))
PY
} | tee "$OUT/summary.txt"
exit $rc
