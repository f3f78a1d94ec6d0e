"""`torchmem estimate --fit` on a real GPU (formerly scripts/gpu_check_estimate_fit.py; run it on the H200), and how
much the ground truth itself varies.

1. For each `--fit` answer made on a machine without a GPU (bench/estimate/fit-*.json, the JSON of `torchmem
   estimate --gpu H200 --fit 'batch=1..4096' --json -- python bench/estimate/fit_train.py --workload W --batch
   {batch}`; other files through TORCHMEM_FIT_JSON, os.pathsep-separated), train W in a fresh process at the
   largest batch said to fit (it must run 3 steps without an out-of-memory error) and at the first batch said not
   to (it must run out of memory). Each answer was made for one GPU (its `gpu`, `device_memory_bytes`): on a GPU
   of another memory size its tests skip with the reason.
2. TORCHMEM_FIT_REPEAT=W:N (e.g. mlp_sgd_fp32:6): N fresh runs of the truth config W
   (`scripts/gpu_estimator_truth.py --child`), to show the spread of its measured peak reserved across identical
   runs (printed, not judged; skipped without the variable).

With TORCHMEM_FIT_CHECK_OUT=DIR the measured runs are also written to DIR/estimate-fit-check.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fit_files() -> list[Path]:
    given = os.environ.get("TORCHMEM_FIT_JSON")
    if given:
        return [Path(p) for p in given.split(os.pathsep) if p]
    return sorted((ROOT / "bench/estimate").glob("fit-*.json"))


FITS = {p.stem.removeprefix("fit-"): p for p in _fit_files()}


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


@pytest.fixture(scope="module")
def record():
    """What was measured, written to TORCHMEM_FIT_CHECK_OUT/estimate-fit-check.json at the end when set."""
    out: dict = {"fit": {}, "repeat": {}}
    yield out
    dest = os.environ.get("TORCHMEM_FIT_CHECK_OUT")
    if dest:
        Path(dest).mkdir(parents=True, exist_ok=True)
        (Path(dest) / "estimate-fit-check.json").write_text(json.dumps(out, indent=1))


@pytest.fixture(scope="module")
def fit_runs(record: dict):
    """fit_runs(key): the answer of FITS[key] and a fresh training run at its two edges (each run once)."""
    cache: dict[str, dict] = {}

    def get(key: str) -> dict:
        r = json.loads(FITS[key].read_text())
        import torch

        props = torch.cuda.get_device_properties(0)
        if r.get("device_memory_bytes") not in (None, props.total_memory):
            pytest.skip(
                f"the answer was made for {r.get('gpu')} ({r['device_memory_bytes']} B); this GPU is {props.name} "
                f"({props.total_memory} B)"
            )
        if key not in cache:
            fit = r["fit"]
            workload = next(b for a, b in zip(r["command"], r["command"][1:], strict=False) if a == "--workload")
            lo, hi = fit["largest_fitting"], fit["first_not_fitting"]
            cache[key] = {
                "workload": workload,
                "fit": fit,
                "lo": lo,
                "hi": hi,
                "at_largest_fitting": _fit_train(workload, lo) if lo else None,
                "at_first_not_fitting": _fit_train(workload, hi) if hi else None,
            }
            record["fit"][key] = cache[key]
        return cache[key]

    return get


@pytest.mark.parametrize("key", list(FITS))
def test_largest_batch_said_to_fit_runs(fit_runs, key: str) -> None:
    r = fit_runs(key)
    at_lo = r["at_largest_fitting"]
    ok = at_lo is not None and at_lo["rc"] == 0 and not at_lo.get("oom")
    assert ok, f"{r['workload']}: batch {r['lo']} (largest said to fit) runs: {at_lo}"
    print(f"{r['workload']}: batch {r['lo']} (largest said to fit) runs: {at_lo}")


@pytest.mark.parametrize("key", list(FITS))
def test_first_batch_said_not_to_fit_runs_out_of_memory(fit_runs, key: str) -> None:
    r = fit_runs(key)
    at_hi = r["at_first_not_fitting"]
    ok = at_hi is not None and at_hi["rc"] == 3 and bool(at_hi.get("oom"))
    assert ok, f"{r['workload']}: batch {r['hi']} (first said not to) OOMs: {at_hi}"
    print(f"{r['workload']}: batch {r['hi']} (first said not to) OOMs: {at_hi}")


def test_truth_repeat_spread(record: dict, record_property) -> None:
    """INFO, not judged: the spread of a truth config's peak reserved over identical fresh runs."""
    specs = [s for s in os.environ.get("TORCHMEM_FIT_REPEAT", "").split(",") if s]
    if not specs:
        pytest.skip("set TORCHMEM_FIT_REPEAT=W:N (e.g. mlp_sgd_fp32:6) to measure the truth's spread")
    for spec in specs:
        workload, n = spec.split(":")
        runs = [_truth_run(workload) for _ in range(int(n))]
        record["repeat"][workload] = runs
        reserved = sorted({r.get("peak_reserved_bytes") for r in runs if "error" not in r})
        line = f"INFO {workload}: {n} identical fresh runs, peak reserved (MiB) seen: {[x >> 20 for x in reserved]}"
        print(line, flush=True)
        record_property(f"repeat_{workload}", line)
