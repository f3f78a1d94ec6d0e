"""Side-by-side timing of `torchmem snapshot` against `python -m torch.cuda._memory_viz stats` on the real
snapshot fixtures (printed as ratios), and `torchmem snapshot` / `--top` on a >= 1 GB synthetic snapshot with
wall time and peak RSS (limits: <= 10 s, <= 2 GB). Not part of the test suite.

    python bench/snapshot/gen_synthetic.py /tmp/synthetic.pickle     # once, ~1.1 GB
    python bench/snapshot/run_bench.py --synthetic /tmp/synthetic.pickle

`torchmem` is taken from PATH (or --torchmem); the anchor runs with this Python.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "snapshots"


def run(cmd: list[str]) -> tuple[float, int, int]:
    """Wall seconds, peak RSS (bytes) and exit code of one child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        err = p.stderr.read().decode(errors="replace") if p.stderr else ""
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}): {err[-2000:]}")
    return wall, usage.ru_maxrss * 1024, p.returncode


def median_run(cmd: list[str], repeat: int) -> tuple[float, int]:
    walls, rss = [], 0
    for _ in range(repeat):
        w, r, _ = run(cmd)
        walls.append(w)
        rss = max(rss, r)
    return statistics.median(walls), rss


INPROC = """
import pickle, sys, time
from torch.cuda import _memory_viz as mv
t0 = time.perf_counter()
with open(sys.argv[1], "rb") as f:
    data = pickle.load(f)
mv.segsum(data)
print(time.perf_counter() - t0)
"""


def inprocess_seconds(path: Path, repeat: int) -> float:
    """memory_viz's own work (pickle.load + segsum) without the interpreter and torch import."""
    times = []
    for _ in range(repeat):
        r = subprocess.run([sys.executable, "-c", INPROC, str(path)], capture_output=True, text=True, check=True)
        times.append(float(r.stdout.strip().splitlines()[-1]))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchmem", default=shutil.which("torchmem") or "torchmem")
    ap.add_argument("--synthetic", help="path of a synthetic snapshot (bench/snapshot/gen_synthetic.py)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    tm = args.torchmem
    print(f"torchmem: {tm}\npython:   {sys.executable}\n")
    print(f"{'fixture':<46} {'size':>9} {'torchmem':>10} {'memory_viz stats':>17} {'ratio':>7}", end="")
    print(f" {'memory_viz work only':>21} {'ratio':>7}")
    ok = True
    for f in sorted(FIX.glob("*.pickle")):
        t_tm, _ = median_run([tm, "snapshot", str(f)], args.repeat)
        t_mv, _ = median_run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(f)], args.repeat)
        ratio = t_mv / t_tm
        ok &= ratio >= 10
        size_mb = f.stat().st_size / 1e6
        t_in = inprocess_seconds(f, args.repeat)
        print(f"{f.name:<46} {size_mb:>7.2f}MB {t_tm * 1000:>8.1f}ms {t_mv * 1000:>15.1f}ms {ratio:>6.1f}x", end="")
        print(f" {t_in * 1000:>19.1f}ms {t_in / t_tm:>6.1f}x")
    if args.synthetic:
        p = Path(args.synthetic)
        print(f"\nsynthetic {p} ({p.stat().st_size / 1e9:.2f} GB)")
        for extra in ([], ["--top", "10"]):
            wall, rss = median_run([tm, "snapshot", str(p), *extra], 1)
            good = wall <= 10 and rss <= 2 << 30
            ok &= good
            label = " ".join(["torchmem snapshot", *extra])
            print(f"  {label:<34} {wall:>6.2f} s  peak RSS {rss / 2**20:>7.0f} MiB  {'OK' if good else 'OVER LIMIT'}")
    print("\nall limits met" if ok else "\nSOME LIMIT MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
