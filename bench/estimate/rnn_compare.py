"""Compares the estimator's cuDNN RNN requests with the H200's, config by config and phase by phase.

    .venv/bin/python bench/estimate/rnn_compare.py [TRUTH] [--show N] [--only SUBSTRING]

TRUTH is `tests/fixtures/rnn-h200/rnn-truth.json.gz` by default (recorded by `scripts/gpu_rnn_truth.py`).
Each grid config runs `gpu_rnn_truth.exercise` again on the emulated H200 (`torchmem.estimator`'s session) and
its requests (sizes rounded to 512 bytes, as the allocator's history records them) are compared with the
recorded ones between the same marks: the module moved to the GPU, the input, packing, the training forward,
its backward, the frees, the inference forward. Prints, per phase, how many configs match request for request
and the first differences; exits 1 when any phase differs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_rnn_truth  # noqa: E402

PHASES = ["start", "to_cuda", "input", "packed", "forward", "backward", "freed", "eval_start", "eval_forward",
          "eval_freed"]  # fmt: skip


def split(events: list[list], mark_bytes: int) -> dict[str, list[tuple[str, int]]]:
    """Events between marker requests, keyed by the mark that ends them; the markers' own alloc/free dropped.
    The k-th marker is a request of exactly `mark_bytes + 512 * k` freed right away (a real request of that
    size elsewhere is not taken for one)."""
    out: dict[str, list[tuple[str, int]]] = {}
    cur: list[tuple[str, int]] = []
    k = 0
    sizes = [(a, (int(s) + 511) // 512 * 512) for a, s in events]
    i = 0
    while i < len(sizes):
        action, r = sizes[i]
        nxt = sizes[i + 1] if i + 1 < len(sizes) else None
        if (
            action == "alloc"
            and r == mark_bytes + 512 * (k + 1)
            and nxt is not None
            and nxt[0] != "alloc"
            and nxt[1] == r
        ):
            if k < len(PHASES):
                out[PHASES[k]] = cur
            cur = []
            k += 1
            i += 2
            continue
        cur.append(("alloc" if action == "alloc" else "free", r))
        i += 1
    return out


def live_peak(phases: dict[str, list[tuple[str, int]]]) -> int:
    """The largest sum of live requests (512-rounded) over the phases in order, frees matched by size."""
    live = peak = 0
    for p in PHASES:
        for action, size in phases.get(p, []):
            live += size if action == "alloc" else -size
            peak = max(peak, live)
    return peak


def emulated(cfg: dict) -> list[list]:
    import torch
    from torchmem.estimator import gpu_spec
    from torchmem.estimator._session import Session

    with Session(gpu_spec("H200")) as s:

        def mark(name):
            torch.empty(gpu_rnn_truth.MARK_BYTES + 512 * (PHASES.index(name) + 1), dtype=torch.uint8, device="cuda")

        gpu_rnn_truth.exercise(cfg, mark)
    return [[e.action, e.size_bytes] for e in s.tracer.events]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("truth", nargs="?", default=str(ROOT / "tests/fixtures/rnn-h200/rnn-truth.json.gz"))
    ap.add_argument("--show", type=int, default=5)
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    doc = json.load(gzip.open(a.truth))
    grid = [r for r in doc["grid"] if "events" in r and a.only in json.dumps(r["config"])]
    matched = dict.fromkeys(PHASES[1:], 0)
    peak_errors: list[tuple[float, dict]] = []
    differ: dict[str, list] = {p: [] for p in PHASES[1:]}
    for r in grid:
        real = split(r["events"], gpu_rnn_truth.MARK_BYTES)
        try:
            est = split(emulated(r["config"]), gpu_rnn_truth.MARK_BYTES)
        except Exception as e:  # noqa: BLE001 - reported per config
            differ["to_cuda"].append((r["config"], f"{type(e).__name__}: {e}", ""))
            continue
        real_peak, est_peak = live_peak(real), live_peak(est)
        peak_errors.append(((est_peak - real_peak) / real_peak * 100 if real_peak else 0.0, r["config"]))
        for p in PHASES[1:]:
            if real.get(p, []) == est.get(p, []):
                matched[p] += 1
            else:
                differ[p].append((r["config"], real.get(p), est.get(p)))
    print(f"{len(grid)} configs ({doc.get('device')}, torch {doc.get('torch')}, cuDNN {doc.get('cudnn')})")
    bad = False
    for p in PHASES[1:]:
        print(f"{p:13s} {matched[p]:4d} / {len(grid)} request for request")
        for cfg, real, est in differ[p][: a.show]:
            bad = True
            print(f"    {json.dumps(cfg)}\n      H200:     {real}\n      estimate: {est}")
    errs = sorted(abs(e) for e, _ in peak_errors)
    if errs:
        worst = max(peak_errors, key=lambda e: abs(e[0]))
        print(f"peak of live bytes over all phases: median |error| {errs[len(errs) // 2]:.3f} %, max {errs[-1]:.3f} %"
              f" ({json.dumps(worst[1])}: {worst[0]:+.3f} %)")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
