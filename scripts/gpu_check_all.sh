#!/usr/bin/env bash
# Runs GPU check scripts on the device machine, one process each; leaves a summary and every output (one
# archive) under $OUT. The wheel built here (`maturin build --release -o .whl`) travels with `carry: [".whl"]` and is
# installed with --target (the device's Python has torch but not our build tools).
#
#   bash scripts/gpu_check_all.sh "gpu_check.py --only run --only interplay --only remap" gpu_check_api.py ...
#
# Each argument is one script of scripts/ with its arguments; "bench:ARGS" runs bench/run_overhead.py ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
RAW=/tmp/gpu-raw
mkdir -p "$OUT" "$RAW" /tmp/site
python3 -m pip install -q --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 2; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
  python3 -c 'import torch,sys; print(torch.__version__, torch.version.cuda, sys.version)'; } > "$RAW/gpu.txt" 2>&1
for spec in "$@"; do
  if [[ $spec == bench:* ]]; then
    name=run_overhead; cmd="python3 bench/run_overhead.py ${spec#bench:}"
  else
    name=$(basename "${spec%% *}" .py); cmd="python3 scripts/$spec"
  fi
  t0=$(date +%s)
  timeout "${GPU_CHECK_TIMEOUT_S:-560}" bash -c "$cmd" > "$RAW/$name.txt" 2>&1
  rc=$?
  pass=$(grep -c '^PASS' "$RAW/$name.txt"); fail=$(grep -c '^FAIL' "$RAW/$name.txt")
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s pass=$pass fail=$fail" | tee -a "$RAW/summary.txt"
  # after each script (a call cut short keeps what ran): the device returns at most 8 files, so the summary
  # and every output in one archive
  cp "$RAW/summary.txt" "$OUT/summary.txt"
  tar czf "$OUT/outputs.tgz" -C "$RAW" .
done
