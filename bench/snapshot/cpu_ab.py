"""CPU time (user + sys, from os.wait4) of two or more builds of the `phase_times` example on one snapshot,
runs interleaved so that the machine's load hits each build alike; prints min and median per build. For
before/after comparisons of the reader on a shared machine, where wall time mostly measures the load.

    python bench/snapshot/cpu_ab.py 3 /tmp/synthetic.pickle /tmp/phase_times_before target/release/examples/phase_times

`FULL=1` times read + summary + top sites (the example's default); otherwise the fast decoder alone.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys


def main() -> None:
    n, path, bins = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    env = dict(os.environ) if os.environ.get("FULL") else dict(os.environ, FAST_ONLY="1")
    cpu: dict[str, list[tuple[float, float]]] = {b: [] for b in bins}
    for _ in range(n):
        for b in bins:
            p = subprocess.Popen([b, path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            _, status, usage = os.wait4(p.pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"{b} {path} failed")
            cpu[b].append((usage.ru_utime, usage.ru_stime))
    for b, runs in cpu.items():
        total = [u + s for u, s in runs]
        user = [u for u, _ in runs]
        print(
            f"{b:50s} user min {min(user):.3f} med {statistics.median(user):.3f}  "
            f"total min {min(total):.3f} med {statistics.median(total):.3f} s"
        )
    print("load average", " ".join(f"{x:.1f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
