"""Line-profiler overhead, side by side in one run: the untraced program, torchmem's line mode and
memory_profiler on (a) a Python-heavy data-preparation loop, (b) a small CPU training step and (c) a resnet18
training step on the GPU (only where CUDA exists). Each (mode, workload) runs in fresh processes, rounds
interleaved, min over rounds; ratios are against untraced.

    .venv/bin/python bench/line_overhead/run.py [--rounds 3] [--repeats 3] [--only a_dataprep,...] [--json out]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ["untraced", "torchmem", "memory_profiler"]


def cuda_available() -> bool:
    code = "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    workloads = ["a_dataprep", "b_cpu_train"] + (["c_gpu_resnet18"] if cuda_available() else [])
    if args.only:
        workloads = [w for w in workloads if w in args.only.split(",")]
    best: dict[tuple[str, str], float] = {}
    info: dict[tuple[str, str], dict] = {}
    for _ in range(args.rounds):
        for w in workloads:
            for m in MODES:
                p = subprocess.run(
                    [sys.executable, os.path.join(HERE, "child.py"), m, w, str(args.repeats)],
                    capture_output=True,
                    text=True,
                )
                if p.returncode != 0:
                    print(f"{w} {m} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
                    continue
                r = json.loads(p.stdout.strip().splitlines()[-1])
                key = (w, m)
                if r["best_s"] < best.get(key, float("inf")):
                    best[key] = r["best_s"]
                    info[key] = r
    print(f"python {sys.version.split()[0]}, rounds {args.rounds} x repeats {args.repeats} (min)")
    print(f"{'workload':<16} {'untraced':>10} {'torchmem':>10} {'ratio':>7} {'memory_profiler':>16} {'ratio':>7}")
    rows = []
    for w in workloads:
        base = best.get((w, "untraced"))
        tm = best.get((w, "torchmem"))
        mp = best.get((w, "memory_profiler"))

        def ratio(v, base=base):
            return v / base if (v and base) else float("nan")

        print(
            f"{w:<16} {base or float('nan'):>9.3f}s {tm or float('nan'):>9.3f}s {ratio(tm):>6.2f}x "
            f"{mp or float('nan'):>15.3f}s {ratio(mp):>6.2f}x"
        )
        t_info = info.get((w, "torchmem"), {})
        rows.append(
            {
                "workload": w,
                "untraced_s": base,
                "torchmem_s": tm,
                "memory_profiler_s": mp,
                "torchmem_ratio": ratio(tm),
                "memory_profiler_ratio": ratio(mp),
                "torchmem_events": t_info.get("events"),
                "torchmem_reads": t_info.get("reads"),
                "gate_ns": t_info.get("gate_ns"),
                "hook": t_info.get("hook"),
            }
        )
    for r in rows:
        if r["torchmem_events"]:
            print(
                f"  {r['workload']}: torchmem {r['hook']}, gate {r['gate_ns']:.0f} ns, "
                f"{r['torchmem_reads']} memory reads for {r['torchmem_events']} events"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"python": sys.version.split()[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
