"""Scores `torchmem estimate` on the user-style scripts of `bench/estimate/corpus/` against their H200 truth.

    .venv/bin/python bench/estimate/corpus_accuracy.py [--truth tests/fixtures/rnn-h200/rnn-truth.json.gz] [--json]

Each script with a recorded truth (`scripts/gpu_rnn_truth.py` records the RNN ones in fresh processes) is
estimated unchanged (`torchmem estimate --gpu H200 --json -- python SCRIPT`, a fresh process each) and its peak
allocated, peak reserved and NVML are compared with the H200's, with the interval's upper bound. These scripts
were written and recorded before the estimator's RNN support was scored on them: they are held out (the RNN
model was fitted on the grid of `gpu_rnn_truth.grid`, never on these).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "bench" / "estimate" / "corpus"


def estimate(script: Path) -> dict:
    exe = Path(sys.executable).with_name("torchmem")
    cmd = [str(exe), "estimate", "--gpu", "H200", "--json", "--", sys.executable, str(script)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(CORPUS), env=os.environ.copy(), timeout=900)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:]}
    return json.loads(p.stdout)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--truth", default=str(ROOT / "tests/fixtures/rnn-h200/rnn-truth.json.gz"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    truth = json.load(gzip.open(a.truth))["scripts"]
    rows = []
    for name, t in sorted(truth.items()):
        e = estimate(CORPUS / name)
        row = {"script": name, "measured": t, "estimate": e}
        if "error" not in e:
            for key, est_key in (("allocated_bytes.all.peak", "peak_allocated_bytes"),
                                 ("reserved_bytes.all.peak", "peak_reserved_bytes"),
                                 ("nvml_process_bytes", "nvml_bytes")):  # fmt: skip
                if t.get(key):
                    row[est_key + "_error_pct"] = (e[est_key] - t[key]) / t[key] * 100
            upper = e.get("peak_reserved_upper_bytes", e["peak_reserved_bytes"])
            row["reserved_inside_interval"] = (
                e["peak_reserved_bytes"] <= upper and t["reserved_bytes.all.peak"] <= upper
            )
        rows.append(row)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    gib = 2**30
    print(f"{'script':28s} {'alloc H200':>10s} {'estimate':>9s} {'err':>7s} {'reserved':>9s} "
          f"{'estimate':>9s} {'err':>7s} "
          f"{'NVML':>7s} {'err':>7s}  upper>=truth")  # fmt: skip
    for r in rows:
        t, e = r["measured"], r["estimate"]
        if "error" in e:
            print(f"{r['script']:28s} refused/failed: {e['error']}")
            continue
        print(f"{r['script']:28s} {t['allocated_bytes.all.peak'] / gib:9.3f}G {e['peak_allocated_bytes'] / gib:8.3f}G "
              f"{r['peak_allocated_bytes_error_pct']:+6.2f}% {t['reserved_bytes.all.peak'] / gib:8.3f}G "
              f"{e['peak_reserved_bytes'] / gib:8.3f}G {r['peak_reserved_bytes_error_pct']:+6.2f}% "
              f"{t.get('nvml_process_bytes', 0) / gib:6.3f}G {r.get('nvml_bytes_error_pct', float('nan')):+6.2f}%  "
              f"{r['reserved_inside_interval']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
