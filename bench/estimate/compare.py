"""Compares the estimator's trace of a workload with the trace recorded on the H200, request by request.

    .venv/bin/python bench/estimate/compare.py mlp_sgd_fp32 [--steps 3] [--show 40] [--fixture estimator-h200]
    .venv/bin/python bench/estimate/compare.py --script SCRIPT.py --snapshot REAL.pickle[.gz] [--gpu H100-80GB]

It traces the workload of `scripts/gpu_estimator_truth.py` (same model, same step) on the emulated GPU, loads
`tests/fixtures/<fixture>/NAME__*.pickle.gz`, and prints: the number of allocations, the 512-rounded live-bytes
peak of each (the allocated peak the allocator would report, less its block rounding), the sizes only one side
has (with the Python line that requested them), and an alignment of the two request sequences around the first
differences. That is how the CUDA rules in `python/torchmem/estimator/_rules.py` were found.

With `--script`, any program (a corpus script) is traced unchanged, as `torchmem estimate` would run it, and
compared with an allocator history recorded on the GPU (`CORPUS_SNAPSHOT=... scripts/gpu_corpus_truth.py --child`);
both request sequences are also replayed through the simulator (`torchmem simulate`), which tells the trace's
part of a reserved error from the simulator's.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import gzip
import json
import pickle
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "python"))


def _site(frames) -> str:
    for f in frames or []:
        fn = f.get("filename", "")
        if fn.endswith(".py") and "torch/" not in fn.split("site-packages/")[-1][:6]:
            return f"{fn.split('/')[-1]}:{f['line']}"
    for f in frames or []:
        if f.get("filename", "").endswith(".py"):
            return f"{f['filename'].split('/')[-1]}:{f['line']}"
    return "?"


def real_requests(path: Path) -> list[tuple[str, int, int, str]]:
    snap = pickle.load(gzip.open(path) if path.suffix == ".gz" else open(path, "rb"))
    out = []
    for e in snap["device_traces"][0]:
        if e["action"] == "alloc":
            out.append(("alloc", e["addr"], e["size"], _site(e.get("frames"))))
        elif e["action"] == "free_requested":
            out.append(("free", e["addr"], e["size"], ""))
    return out


def est_requests(events) -> list[tuple[str, int, int, str]]:
    return [(e.action, e.addr, e.size_bytes, e.what if e.action == "alloc" else "") for e in events]


def live_peak(reqs) -> tuple[int, int]:
    live = peak = 0
    at = 0
    sizes = {}
    for i, (a, addr, size, _) in enumerate(reqs):
        r = (size + 511) // 512 * 512
        if a == "alloc":
            sizes[addr] = r
            live += r
            if live > peak:
                peak, at = live, i
        else:
            live -= sizes.pop(addr, 0)
    return peak, at


def trace_workload(name: str, steps: int):
    import gpu_estimator_truth as truth
    import torch
    from torchmem.estimator import gpu_spec
    from torchmem.estimator._session import Session

    spec = truth.WORKLOADS[name]
    t0 = time.time()
    with Session(gpu_spec("H200")) as s:
        _model, opt, loss_fn, _info = truth.build(spec, torch)
        scaler = torch.amp.GradScaler("cuda") if spec["dtype"] == "amp_fp16" else None
        for _ in range(steps):
            truth.train_step(spec, torch, opt, loss_fn, scaler)
    return s.tracer, time.time() - t0


def trace_script(script: Path, argv: list[str], gpu: str):
    """Runs SCRIPT as `python SCRIPT ARGS` would, on the emulated GPU (as `torchmem estimate` does)."""
    import runpy

    from torchmem.estimator import gpu_spec
    from torchmem.estimator._session import Session

    old_argv, old_path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(script.resolve().parent))
    t0 = time.time()
    try:
        with Session(gpu_spec(gpu)) as s:
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit:
                pass
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    return s.tracer, time.time() - t0


def simulate_file(path: Path) -> dict | None:
    import subprocess

    p = subprocess.run([sys.executable, "-m", "torchmem", "simulate", str(path), "--json"], capture_output=True,
                       text=True)  # fmt: skip
    if p.returncode != 0:
        print("  simulate failed:", p.stderr[-500:])
        return None
    return json.loads(p.stdout)["devices"][0]


def simulate(tracer, name: str | None) -> dict | None:
    import tempfile

    from torchmem.estimator import _snapshot

    conf = __import__("gpu_estimator_truth").WORKLOADS[name].get("alloc_conf", "") if name else ""
    with tempfile.TemporaryDirectory() as d:
        return simulate_file(_snapshot.write(_snapshot.build(tracer, alloc_conf=conf), Path(d) / "trace.pickle"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name", nargs="?")
    ap.add_argument("--script", type=Path, help="a program to trace unchanged (with --snapshot)")
    ap.add_argument("--snapshot", type=Path, help="the allocator history the GPU recorded for --script")
    ap.add_argument("--gpu", default="H200")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--show", type=int, default=30)
    ap.add_argument("--fixture", default="estimator-h200")
    ap.add_argument("--json", action="store_true")
    args, rest = ap.parse_known_args()
    fx = ROOT / "tests" / "fixtures" / args.fixture
    if args.script:
        if not args.snapshot:
            ap.error("--script needs --snapshot (the GPU's allocator history of the same program)")
        path = args.snapshot
        args.name = args.script.stem
        real = real_requests(path)
        tracer, secs = trace_script(args.script, rest, args.gpu)
    else:
        path = next(fx.glob(f"{args.name}__*.pickle.gz"))
        real = real_requests(path)
        tracer, secs = trace_workload(args.name, args.steps)
    est = est_requests(tracer.events)
    rp, rat = live_peak(real)
    ep, eat = live_peak(est)
    ra = [r for r in real if r[0] == "alloc"]
    ea = [r for r in est if r[0] == "alloc"]
    print(f"{args.name}: traced {args.steps} steps in {secs:.1f} s")
    print(f"  allocs        real {len(ra):6d}   est {len(ea):6d}")
    print(f"  live peak     real {rp / 2**20:10.2f} MiB (req #{rat})   est {ep / 2**20:10.2f} MiB (req #{eat})")
    print(f"  error         {100 * (ep - rp) / rp:+.2f} %")
    rc = collections.Counter(r[2] for r in ra)
    ec = collections.Counter(r[2] for r in ea)
    only_r = rc - ec
    only_e = ec - rc
    site_r = collections.defaultdict(collections.Counter)
    for r in ra:
        site_r[r[2]][r[3]] += 1
    site_e = collections.defaultdict(collections.Counter)
    for r in ea:
        site_e[r[2]][r[3]] += 1
    print("  only in the real trace (size x count, top sites):")
    for size, n in sorted(only_r.items(), key=lambda x: -x[0] * x[1])[: args.show]:
        print(f"    {size:>12d} ({size / 2**20:8.2f} MiB) x{n:<4d} {dict(site_r[size].most_common(2))}")
    print("  only in the estimate:")
    for size, n in sorted(only_e.items(), key=lambda x: -x[0] * x[1])[: args.show]:
        print(f"    {size:>12d} ({size / 2**20:8.2f} MiB) x{n:<4d} {dict(site_e[size].most_common(2))}")
    sm = difflib.SequenceMatcher(a=[r[2] for r in ra], b=[r[2] for r in ea], autojunk=False)
    shown = 0
    print("  first differing stretches (real | est):")
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        print(f"    {tag} real[{i1}:{i2}] {[r[2] for r in ra[i1 : min(i2, i1 + 6)]]} {ra[i1][3] if i1 < i2 else ''}")
        print(f"         est[{j1}:{j2}] {[r[2] for r in ea[j1 : min(j2, j1 + 6)]]} {ea[j1][3] if j1 < j2 else ''}")
        shown += 1
        if shown >= 12:
            break
    sim = simulate(tracer, None if args.script else args.name)
    if args.script:
        real_sim = simulate_file(path)
        if sim and real_sim:
            for k in ("peak_allocated_bytes", "peak_reserved_bytes"):
                print(f"  simulated {k:22s} from the trace {sim[k] / 2**20:10.2f} MiB   from the GPU's requests "
                      f"{real_sim[k] / 2**20:10.2f} MiB")  # fmt: skip
    truth = (
        json.loads((fx / "estimator-truth.json").read_text())["configs"].get(args.name)
        if fx.name == "estimator-h200"
        else None
    )
    if sim and truth:
        for k, tk in (("peak_allocated_bytes", "peak_allocated_bytes"), ("peak_reserved_bytes", "peak_reserved_bytes")):
            print(
                f"  sim {k:22s} {sim[k] / 2**20:10.2f} MiB   real {truth[tk] / 2**20:10.2f} MiB   "
                f"{100 * (sim[k] - truth[tk]) / truth[tk]:+.2f} %"
            )
    if tracer.notes.messages:
        print("  notes:", tracer.notes.messages)
    if args.json:
        print(json.dumps({"name": args.name, "real_peak": rp, "est_peak": ep, "seconds": secs}))


if __name__ == "__main__":
    main()
