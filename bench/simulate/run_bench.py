"""Simulator speed: replay throughput (trace entries per second, wall and CPU time of the replay alone) and
the end-to-end time of `torchmem simulate` and `torchmem simulate --min-memory` on a 1 M-entry trace.

    python bench/simulate/run_bench.py [--entries 1000000] [--trace /tmp/long_trace.pickle]

Builds the `sim_bench` example and the `torchmem` binary (cargo, release: the venv's `maturin develop`
extension is a debug build) and writes the trace with gen_long_trace.py when it is missing.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return time.perf_counter() - t0, p.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--trace", default="/tmp/long_trace.pickle")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    trace = Path(args.trace)
    if not trace.exists():
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "bench/simulate/gen_long_trace.py"),
                str(trace),
                "--entries",
                str(args.entries),
            ],
            check=True,
        )
    env = dict(os.environ, PYO3_PYTHON=sys.executable)
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "torchmem-sim", "--example", "sim_bench"],
        check=True,
        env=env,
        cwd=ROOT,
    )
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    _, out = timed([str(ROOT / "target/release/examples/sim_bench"), str(trace), "--reps", str(args.reps)])
    print(out.rstrip())
    cli = [str(ROOT / "target/release/torchmem"), "simulate", str(trace)]
    for extra in ([], ["--min-memory"]):
        best = min(timed([*cli, *extra])[0] for _ in range(3))
        print(f"torchmem simulate {' '.join(extra) or '(replay, check)'}: best of 3 {best:.2f} s end to end")


if __name__ == "__main__":
    main()
