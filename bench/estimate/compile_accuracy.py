"""The accuracy of the estimate of `torch.compile` programs (issue 23 item 4; docs/estimator.md §3.3): every config
of `scripts/gpu_compile_truth.py` (compiled and eager twins) estimated here, without a GPU, with `torchmem.estimate()`
for the GPU the truth was recorded on, against what that GPU measured. The recorded truth
(`tests/fixtures/compile-h100/compile-truth.json.gz`) is an NVIDIA H100 80GB HBM3's (torch 2.11, CUDA 13), not an
H200's: no H200 was free when it was recorded. The GPU is taken from the truth's `device_name`.

    .venv/bin/python bench/estimate/compile_accuracy.py [--only NAME,...] [--truth PATH] [--out PATH]

Each config is estimated in a fresh process (as `torchmem estimate` would run it: dynamo's caches and Inductor's
compile start empty), for as many steps as the truth ran (the first one compiles). Prints one row per config: the
GPU's whole-process peak allocated, reserved and NVML (compile step included), the point estimate, the upper
bound and the errors; writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "python"))
TRUTH = ROOT / "tests" / "fixtures" / "compile-h100" / "compile-truth.json.gz"


def load_truth(path: Path = TRUTH) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def gpu_key(device_name: str) -> str:
    """The catalogue key (`--gpu`) of the GPU torch named `device_name` (the truth's), e.g. "H100-80GB"."""
    import torchmem.estimator as te

    keys = [g["key"] for g in te.gpu_catalogue() if g["name"] == device_name]
    if not keys:
        raise SystemExit(f"no catalogue GPU is named {device_name!r}: add it to crates/torchmem-estimator/src/gpus.rs")
    return keys[0]


def estimate_config(name: str, steps: int, gpu: str) -> dict:
    """The estimate of one config (in this process) for the catalogue GPU `gpu`, as a dict of the numbers the table
    needs."""
    import gpu_compile_truth as truth
    import torch
    import torchmem.estimator as te

    spec = truth.CONFIGS[name]
    state: dict = {}

    def step():
        if not state:
            state["step"], _info = truth.build(spec, torch)
        state["step"]()

    t0 = time.perf_counter()
    est = te.estimate(step, gpu=gpu, steps=steps)
    return {
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "nvml_bytes": est.nvml_bytes,
        "peak_allocated_upper_bytes": est.peak_allocated_upper_bytes,
        "peak_reserved_upper_bytes": est.peak_reserved_upper_bytes,
        "nvml_upper_bytes": est.nvml_upper_bytes,
        "notes": est.notes,
        "uncertainty": [{k: u[k] for k in ("kind", "bytes", "calls")} for u in est.uncertainty],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def measured(t: dict) -> dict:
    nvml = [s.get("nvml_process_bytes") or 0 for s in t["steps"]]
    return {
        "peak_allocated_bytes": t["peak_allocated_bytes"],
        "peak_reserved_bytes": t["peak_reserved_bytes"],
        "nvml_bytes": max(nvml + [t.get("nvml_process_bytes_max_sampled") or 0]),
    }


def pct(pred: float, real: float) -> float:
    return 100.0 * (pred - real) / real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--truth", default=str(TRUTH))
    ap.add_argument("--out", default=str(ROOT / "bench" / "estimate" / "compile-accuracy.json"))
    ap.add_argument("--child", default="")
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--gpu", default="")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(estimate_config(args.child, args.steps, args.gpu)))
        return
    truth = load_truth(Path(args.truth))
    gpu = gpu_key(truth["device_name"])
    print(f"truth recorded on {truth['device_name']} (torch {truth['torch_version']}); estimating for --gpu {gpu}")
    names = [n for n in truth["configs"] if not args.only or n in args.only.split(",")]
    mib = 2**20
    rows = []
    print(
        f"{'config':40s} {'alloc real':>10s} {'pred':>8s} {'upper':>8s} {'err':>6s} {'resv real':>10s} {'pred':>8s} "
        f"{'upper':>8s} {'err':>6s} {'nvml real':>10s} {'pred':>8s} {'err':>6s} {'secs':>5s}"
    )
    for n in names:
        t = truth["configs"][n]
        if "error" in t:
            continue
        steps = len(t["steps"])
        argv = [sys.executable, __file__, "--child", n, "--steps", str(steps), "--gpu", gpu]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            print(f"{n:40s} estimate failed: {p.stderr.strip().splitlines()[-1:]}")
            rows.append({"config": n, "error": p.stderr[-2000:]})
            continue
        e = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("{")][-1])
        m = measured(t)
        row = {"config": n, "compiled": bool(t["spec"].get("compile")), "measured": m, "estimate": e}
        row["err_allocated_pct"] = pct(e["peak_allocated_bytes"], m["peak_allocated_bytes"])
        row["err_reserved_pct"] = pct(e["peak_reserved_bytes"], m["peak_reserved_bytes"])
        row["err_nvml_pct"] = pct(e["nvml_bytes"], m["nvml_bytes"])
        row["allocated_under_upper"] = m["peak_allocated_bytes"] <= e["peak_allocated_upper_bytes"]
        row["reserved_under_upper"] = m["peak_reserved_bytes"] <= e["peak_reserved_upper_bytes"]
        rows.append(row)
        print(
            f"{n:40s} {m['peak_allocated_bytes'] / mib:10.1f} {e['peak_allocated_bytes'] / mib:8.1f} "
            f"{e['peak_allocated_upper_bytes'] / mib:8.1f} {row['err_allocated_pct']:+6.2f} "
            f"{m['peak_reserved_bytes'] / mib:10.1f} {e['peak_reserved_bytes'] / mib:8.1f} "
            f"{e['peak_reserved_upper_bytes'] / mib:8.1f} {row['err_reserved_pct']:+6.2f} "
            f"{m['nvml_bytes'] / mib:10.1f} {e['nvml_bytes'] / mib:8.1f} {row['err_nvml_pct']:+6.2f} "
            f"{e['seconds']:5.0f}",
            flush=True,
        )
    ok = [r for r in rows if "error" not in r and r["compiled"]]
    for key in ("err_allocated_pct", "err_reserved_pct", "err_nvml_pct"):
        vals = [abs(r[key]) for r in ok]
        if vals:
            print(f"compiled configs, |{key}|: median {statistics.median(vals):.2f} max {max(vals):.2f}")
    under = sum(r["reserved_under_upper"] for r in ok)
    print(f"compiled configs: the {gpu}'s peak reserved at or under the upper bound in {under} of {len(ok)}")
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
