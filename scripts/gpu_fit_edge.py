"""Measures where a training program stops fitting on a real GPU (run it on the H200), for `torchmem estimate --fit`.

1. `--search LO..HI`: bisection, in fresh processes (`bench/estimate/fit_train.py`), for the largest batch of
   the workload that trains 3 steps without an out-of-memory error, knowing LO runs; then the next batch up is
   run to show it does not. Each run also says how many out-of-memory errors the allocator raised and had
   caught inside the step (`num_ooms`: cuDNN trying a plan with a smaller workspace) and how often it freed its
   cache and retried (`num_alloc_retries`).
2. `--snapshot-batches B,B2` (and `--snapshot-edge`: the two batches the search found): one run each with the
   allocator's history recorded; the snapshots are written gzipped under OUT (what the estimate's trace is
   compared with, request by request).

Usage: ``python scripts/gpu_fit_edge.py OUT --workload W --search 1706..2048 --snapshot-batches 1706,1707``;
writes ``OUT/fit-edge-W.json`` and prints one line per run.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(workload: str, batch: int, snapshot: Path | None = None) -> dict:
    cmd = [sys.executable, str(ROOT / "bench/estimate/fit_train.py"), "--workload", workload, "--batch", str(batch)]
    if snapshot is not None:
        cmd += ["--snapshot", str(snapshot)]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if lines else {"error": p.stderr[-800:]}
    res["rc"] = p.returncode
    res["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(res), flush=True)
    return res


def _fits(res: dict) -> bool:
    return res["rc"] == 0 and not res.get("oom")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--workload", required=True)
    ap.add_argument("--search", metavar="LO..HI")
    ap.add_argument("--snapshot-batches", default="")
    ap.add_argument("--snapshot-edge", action="store_true", help="also snapshot the two batches the search found")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out: dict = {"workload": args.workload, "runs": [], "snapshots": {}}
    snapshot_batches = [int(x) for x in args.snapshot_batches.split(",") if x]
    if args.search:
        lo, hi = (int(x) for x in args.search.split(".."))
        # Invariant: lo runs (checked first), hi + 1 is the first unknown above the range.
        first = _run(args.workload, lo)
        out["runs"].append(first)
        if not _fits(first):
            out["error"] = f"batch {lo} does not run"
        else:
            top = _run(args.workload, hi)
            out["runs"].append(top)
            if _fits(top):
                lo = hi
            else:
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    r = _run(args.workload, mid)
                    out["runs"].append(r)
                    lo, hi = (mid, hi) if _fits(r) else (lo, mid)
            out["largest_fitting"] = lo
            out["first_not_fitting"] = hi if hi != lo else None
            print(f"largest batch that runs: {lo}; first that does not: {out['first_not_fitting']}", flush=True)
            if args.snapshot_edge:
                snapshot_batches += [b for b in (lo, out["first_not_fitting"]) if b and b not in snapshot_batches]
    for b in snapshot_batches:
        raw = out_dir / f"{args.workload}-b{b}.pickle"
        res = _run(args.workload, b, raw)
        out["snapshots"][str(b)] = res
        if raw.exists():
            with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb", compresslevel=9) as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
    (out_dir / f"fit-edge-{args.workload}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
