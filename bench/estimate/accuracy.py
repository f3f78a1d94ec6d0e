"""The estimator's accuracy table: every config of `scripts/gpu_estimator_truth.py` estimated here (no GPU) with
`torchmem.estimate()` for the H200, against what the H200 measured (`tests/fixtures/estimator-h200/`).

    .venv/bin/python bench/estimate/accuracy.py [--only NAME,...] [--catalogue full|leave-model-out|none]
        [--out bench/estimate/accuracy.json]

Prints one row per config (measured, predicted, error for peak allocated, peak reserved and NVML) and the
median / p90 / max of the absolute errors, plus the estimate's own time; writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "python"))


def estimate_config(name: str, steps: int, catalogue: str = "full"):
    import gpu_estimator_truth as truth
    import torch
    import torchmem.estimator as te

    spec = truth.WORKLOADS[name]
    state: dict = {}

    def step():
        if not state:
            _model, opt, loss_fn, _info = truth.build(spec, torch)
            scaler = torch.amp.GradScaler("cuda") if spec["dtype"] == "amp_fp16" else None
            state.update(opt=opt, loss_fn=loss_fn, scaler=scaler)
        truth.train_step(spec, torch, state["opt"], state["loss_fn"], state["scaler"])

    if catalogue == "leave-model-out":
        os.environ["TORCHMEM_ESTIMATE_CONV_EXCLUDE"] = spec.get("arch") or ""
    elif catalogue == "none":
        os.environ["TORCHMEM_ESTIMATE_CONV_EXCLUDE"] = "*"
    else:
        os.environ.pop("TORCHMEM_ESTIMATE_CONV_EXCLUDE", None)
    t0 = time.perf_counter()
    est = te.estimate(step, gpu="H200", steps=steps, alloc_conf=spec.get("alloc_conf", ""))
    return est, time.perf_counter() - t0


def pct(pred: float, real: float) -> float:
    return 100.0 * (pred - real) / real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--catalogue",
        choices=("full", "leave-model-out", "none"),
        default="full",
        help="cuDNN workspace catalogue: all of it; without the config's own architecture; none",
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "estimate" / "accuracy.json"))
    args = ap.parse_args()
    truth = json.loads((ROOT / "tests" / "fixtures" / "estimator-h200" / "estimator-truth.json").read_text())
    names = [n for n in truth["configs"] if not args.only or n in args.only.split(",")]
    rows = []
    mib = 2**20
    print(
        f"{'config':45s} {'alloc real':>10s} {'pred':>10s} {'err':>7s} {'resv real':>10s} {'pred':>10s} {'err':>7s} "
        f"{'nvml real':>10s} {'pred':>10s} {'err':>7s} {'secs':>5s}"
    )
    for n in names:
        t = truth["configs"][n]
        if "error" in t:
            continue
        try:
            est, secs = estimate_config(n, args.steps, args.catalogue)
        except Exception as e:  # noqa: BLE001 - a failed config is a row with its error
            print(f"{n:45s} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append({"config": n, "error": f"{type(e).__name__}: {e}"})
            continue
        real_nvml = t["nvml_process_bytes_at_peak_step"]
        row = {
            "config": n,
            "real_allocated_bytes": t["peak_allocated_bytes"],
            "pred_allocated_bytes": est.peak_allocated_bytes,
            "real_reserved_bytes": t["peak_reserved_bytes"],
            "pred_reserved_bytes": est.peak_reserved_bytes,
            "real_nvml_bytes": real_nvml,
            "pred_nvml_bytes": est.nvml_bytes,
            "seconds": round(secs, 1),
        }
        row["err_allocated_pct"] = pct(est.peak_allocated_bytes, t["peak_allocated_bytes"])
        row["err_reserved_pct"] = pct(est.peak_reserved_bytes, t["peak_reserved_bytes"])
        row["err_nvml_pct"] = pct(est.nvml_bytes, real_nvml) if real_nvml else None
        rows.append(row)
        print(
            f"{n:45s} {t['peak_allocated_bytes'] / mib:10.1f} {est.peak_allocated_bytes / mib:10.1f} "
            f"{row['err_allocated_pct']:+6.2f}% {t['peak_reserved_bytes'] / mib:10.1f} "
            f"{est.peak_reserved_bytes / mib:10.1f} {row['err_reserved_pct']:+6.2f}% {real_nvml / mib:10.1f} "
            f"{est.nvml_bytes / mib:10.1f} {row['err_nvml_pct']:+6.2f}% {secs:5.1f}",
            flush=True,
        )
    ok = [r for r in rows if "error" not in r]
    for key in ("err_allocated_pct", "err_reserved_pct", "err_nvml_pct"):
        vals = sorted(abs(r[key]) for r in ok if r.get(key) is not None)
        if vals:
            p90 = vals[min(len(vals) - 1, int(round(0.9 * (len(vals) - 1))))]
            med = statistics.median(vals)
            print(f"|{key}|: median {med:.2f} %  p90 {p90:.2f} %  max {vals[-1]:.2f} %  (n={len(vals)})")
    Path(args.out).write_text(
        json.dumps({"torch_here": __import__("torch").__version__, "catalogue": args.catalogue, "rows": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
