"""Side-by-side timing of `torchmem snapshot` against `python -m torch.cuda._memory_viz stats` and plain
`pickle.load`, in one run, printed as ratios: on the real snapshot fixtures, on a GPT-2-shaped snapshot of
~23 MB / 133k entries (`gen_gpt2_like.py`), and on a >= 1 GB synthetic one (`gen_synthetic.py`, wall time,
MB/s and peak RSS; goal <= 2 s, <= 500 MB). Not part of the test suite.

    python bench/snapshot/gen_gpt2_like.py /tmp/gpt2_like.pickle          # once, 23 MB
    python bench/snapshot/gen_synthetic.py /tmp/synthetic.pickle          # once, ~1.1 GB
    python bench/snapshot/run_bench.py --gpt2-like /tmp/gpt2_like.pickle --synthetic /tmp/synthetic.pickle

`torchmem` is taken from PATH (or --torchmem: use the release binary, `target/release/torchmem`, not the
Python entry point); the anchors run with this Python. Each timing is the median of --repeat runs; the
spread (min–max) is printed next to it, and the load average before and after, since the machine is shared.
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


def run(cmd: list[str]) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (bytes) and CPU seconds (user + system) of one child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        err = p.stderr.read().decode(errors="replace") if p.stderr else ""
        raise SystemExit(f"{' '.join(cmd)} failed ({code}): {err[-2000:]}")
    return wall, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


class Timing:
    def __init__(self, walls: list[float], rss: int, cpus: list[float]) -> None:
        self.median = statistics.median(walls)
        self.lo, self.hi = min(walls), max(walls)
        self.rss = rss
        self.cpu = statistics.median(cpus)

    def ms(self) -> str:
        return f"{self.median * 1000:8.1f} ms ({self.lo * 1000:.0f}–{self.hi * 1000:.0f})"


def timed(cmd: list[str], repeat: int) -> Timing:
    walls, cpus, rss = [], [], 0
    for _ in range(repeat):
        w, r, c = run(cmd)
        walls.append(w)
        cpus.append(c)
        rss = max(rss, r)
    return Timing(walls, rss, cpus)


PICKLE_LOAD = "import pickle, sys\nwith open(sys.argv[1], 'rb') as f:\n    pickle.load(f)\n"


def load_avg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torchmem", default=shutil.which("torchmem") or "torchmem")
    ap.add_argument("--gpt2-like", help="a GPT-2-shaped snapshot (bench/snapshot/gen_gpt2_like.py)")
    ap.add_argument("--synthetic", help="a >= 1 GB synthetic snapshot (bench/snapshot/gen_synthetic.py)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-fixtures", action="store_true", help="only the generated snapshots")
    args = ap.parse_args()
    tm = args.torchmem
    print(f"torchmem: {tm}\npython:   {sys.executable}\nload average before: {load_avg()}\n")
    files = [] if args.no_fixtures else sorted(FIX.glob("*.pickle"))
    if args.gpt2_like:
        files.append(Path(args.gpt2_like))
    head = f"{'snapshot':<40} {'size':>9} {'torchmem snapshot':>24} {'memory_viz stats':>24} {'ratio':>6}"
    print(head + f" {'python pickle.load':>24} {'ratio':>6}")
    ok = True
    for f in files:
        t_tm = timed([tm, "snapshot", str(f)], args.repeat)
        t_mv = timed([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(f)], args.repeat)
        t_pl = timed([sys.executable, "-c", PICKLE_LOAD, str(f)], args.repeat)
        ratio = t_mv.median / t_tm.median
        print(f"{f.name:<40} {f.stat().st_size / 1e6:>7.2f}MB {t_tm.ms():>24} {t_mv.ms():>24} {ratio:>5.1f}x", end="")
        print(f" {t_pl.ms():>24} {t_pl.median / t_tm.median:>5.1f}x   (torchmem CPU {t_tm.cpu * 1000:.0f} ms)")
        if args.gpt2_like and f == Path(args.gpt2_like):
            ok &= ratio >= 50
    if args.synthetic:
        p = Path(args.synthetic)
        size = p.stat().st_size
        print(f"\nsynthetic {p} ({size / 1e9:.2f} GB)")
        for extra in ([], ["--top", "10"]):
            t = timed([args.torchmem, "snapshot", str(p), *extra], max(1, min(args.repeat, 3)))
            good = t.median <= 2 and t.rss <= 500e6
            ok &= good
            label = " ".join(["torchmem snapshot", *extra])
            print(f"  {label:<30} {t.median:6.2f} s ({t.lo:.2f}–{t.hi:.2f})  {size / 1e6 / t.median:6.0f} MB/s", end="")
            verdict = "OK" if good else "OVER THE GOAL (<= 2 s, <= 500 MB)"
            print(f"  CPU {t.cpu:5.2f} s  peak RSS {t.rss / 1e6:5.0f} MB  {verdict}")
    print(f"\nload average after: {load_avg()}")
    print("all goals met" if ok else "SOME GOAL MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
