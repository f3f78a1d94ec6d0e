"""One measurement: run one workload under one mode in this fresh process and print its best time as JSON.
Modes: `untraced`, `torchmem` (torchmem.profile on the step function), `memory_profiler` (its LineProfiler
on the same function, no printing). The time printed is the fastest single call times the number of calls."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import WORKLOADS  # noqa: E402


def main() -> None:
    mode, name, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
    step, n = WORKLOADS[name]()
    if mode == "torchmem":
        import torchmem

        step = torchmem.profile(step)
    elif mode == "memory_profiler":
        import memory_profiler

        step = memory_profiler.LineProfiler(backend="psutil")(step)
    elif mode != "untraced":
        raise SystemExit(f"unknown mode {mode}")
    for _ in range(2):  # warm-up (allocator caches, cuDNN autotune, lazy imports)
        step()
    if mode == "memory_profiler":
        repeats = min(repeats, 2)  # 100-300x slower on (a): two passes are plenty to see it
    # Each call is timed on its own and the fastest one counts (times n, to keep the "per n steps" unit):
    # the minimum is what the code costs; everything above it is the machine's noise.
    best_step = float("inf")
    for _ in range(repeats):
        for _ in range(n):
            t0 = time.perf_counter()
            step()
            best_step = min(best_step, time.perf_counter() - t0)
    best = best_step * n
    extra = {}
    if mode == "torchmem":
        from torchmem.line_profiler import profile_data

        d = profile_data()
        extra = {"reads": d["reads"], "events": d["events"], "gate_ns": d["gate_ns"], "hook": d["hook"]}
        import torchmem.line_profiler as lp

        lp._atexit_done = True  # keep the benchmark's output to the JSON line
    print(json.dumps({"mode": mode, "workload": name, "best_s": best, "steps": n, **extra}))


if __name__ == "__main__":
    main()
