"""Checks `torchmem estimate --fit` on a real GPU (run it on the H200), and how much the ground truth itself varies.

1. For each `--fit` answer made on a machine without a GPU (the JSON files of `torchmem estimate --gpu H200
   --fit 'batch=1..4096' --json -- python bench/estimate/fit_train.py --workload W --batch {batch}`), train W
   in a fresh process at the largest batch said to fit (PASS when it runs 3 steps without an out-of-memory
   error) and at the first batch said not to (PASS when it runs out of memory).
2. `--repeat W:N`: N fresh runs of the truth config W (`scripts/gpu_estimator_truth.py --child`), to show the
   spread of its measured peak reserved across identical runs.

Usage: ``python scripts/gpu_check_estimate_fit.py OUT FIT.json ... [--repeat mlp_sgd_fp32:6]``; writes
``OUT/estimate-fit-check.json`` and prints one PASS/FAIL/INFO line per check.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fit_train(workload: str, batch: int) -> dict:
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, str(ROOT / "bench/estimate/fit_train.py"), "--workload", workload, "--batch", str(batch)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"error": p.stderr[-800:]}
    res["rc"] = p.returncode
    res["seconds"] = round(time.time() - t0, 1)
    return res


def _truth_run(workload: str) -> dict:
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts/gpu_estimator_truth.py"), "--child", "--workload", workload],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"error": p.stderr[-800:]}
    r = json.loads(lines[-1])
    return {k: r[k] for k in ("peak_allocated_bytes", "peak_reserved_bytes", "nvml_process_bytes_at_peak_step")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("fits", nargs="*")
    ap.add_argument("--repeat", action="append", default=[])
    args = ap.parse_args()
    out = {"fit": [], "repeat": {}}
    failures = 0
    for f in args.fits:
        r = json.loads(Path(f).read_text())
        fit = r["fit"]
        workload = next(b for a, b in zip(r["command"], r["command"][1:], strict=False) if a == "--workload")
        lo, hi = fit["largest_fitting"], fit["first_not_fitting"]
        at_lo = _fit_train(workload, lo) if lo else None
        at_hi = _fit_train(workload, hi) if hi else None
        ok_lo = at_lo is not None and at_lo["rc"] == 0 and not at_lo.get("oom")
        ok_hi = at_hi is not None and at_hi["rc"] == 3 and bool(at_hi.get("oom"))
        failures += (not ok_lo) + (not ok_hi)
        print(f"{'PASS' if ok_lo else 'FAIL'} {workload}: batch {lo} (largest said to fit) runs: {at_lo}", flush=True)
        print(f"{'PASS' if ok_hi else 'FAIL'} {workload}: batch {hi} (first said not to) OOMs: {at_hi}", flush=True)
        out["fit"].append(
            {"workload": workload, "fit": fit, "at_largest_fitting": at_lo, "at_first_not_fitting": at_hi}
        )
    for spec in args.repeat:
        workload, n = spec.split(":")
        runs = [_truth_run(workload) for _ in range(int(n))]
        out["repeat"][workload] = runs
        reserved = sorted({r.get("peak_reserved_bytes") for r in runs if "error" not in r})
        print(
            f"INFO {workload}: {n} identical fresh runs, peak reserved (MiB) seen: {[x >> 20 for x in reserved]}",
            flush=True,
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "estimate-fit-check.json").write_text(json.dumps(out, indent=1))
    print(f"{failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
