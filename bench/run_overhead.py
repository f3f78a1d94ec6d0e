"""Whole-run recording overhead: the untraced program, `torchmem run` and memory_profiler's `mprof run` (the
anchor for whole-run memory timelines), side by side in one run, interleaved, several repetitions.

    .venv/bin/python bench/run_overhead.py [--reps 5] [--interval-ms 10] [-- PROGRAM ARGS...]

Default program: examples/train.py --epochs 3. Prints the median wall time of each and the ratio to the
untraced run, plus the profile size, the number of samples and the recorder's own peak RSS."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# examples/train.py prints "trained E epochs x S steps in X s": the training loop alone, without the
# interpreter start, torch's import and CUDA's start, which are most of a short run's wall time and its noise.
LOOP_LINE = re.compile(rb"^trained .* in ([0-9.]+) s$", re.MULTILINE)


def timed(cmd: list[str], env: dict) -> tuple[float, int, float | None]:
    """Wall seconds, the peak RSS (KiB) of the largest child (wait4's rusage) and the program's own
    training-loop seconds when it prints them."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
        _, status, rusage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        out.seek(0)
        found = LOOP_LINE.search(out.read())
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"failed (exit {code}): {' '.join(cmd)}\n{stderr[-2000:]}")
    return elapsed, rusage.ru_maxrss, float(found.group(1)) if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="also run torchmem without the in-process sampler (--no-inject) and without NVML (--no-gpu)",
    )
    ap.add_argument("--no-anchor", action="store_true", help="skip mprof (a quicker torchmem-only A/B)")
    ap.add_argument("program", nargs="*", default=[])
    args = ap.parse_args()
    program = args.program or [str(ROOT / "examples" / "train.py"), "--epochs", "3"]
    python = sys.executable
    torchmem = shutil.which("torchmem", path=str(Path(python).parent)) or shutil.which("torchmem")
    mprof = shutil.which("mprof", path=str(Path(python).parent)) or shutil.which("mprof")
    if torchmem is None:
        raise SystemExit("torchmem is not installed in this Python's bin folder: run ./setup.sh first")
    env = dict(os.environ, TORCHMEM_PYTHON=python)
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-bench-"))
    profile = tmp / "bench.sqlite"
    variants = {
        "untraced": [python, *program],
        f"torchmem run ({args.interval_ms:g} ms)": [
            torchmem,
            "run",
            "-q",
            "--force",
            "--interval",
            str(args.interval_ms),
            "-o",
            str(profile),
            "--",
            python,
            *program,
        ],
    }
    if args.diagnose:
        for flag in ("--no-inject", "--no-gpu"):
            variants[f"torchmem run {flag}"] = [
                torchmem, "run", "-q", "--force", flag, "-o", str(tmp / "diag.sqlite"), "--", python, *program,
            ]  # fmt: skip
        # The in-process allocator read (it needs the interpreter's lock) at 100 ms instead of every tick.
        variants["torchmem run, alloc 100ms"] = [
            "env", "TORCHMEM_ALLOCATOR_INTERVAL_MS=100",
            torchmem, "run", "-q", "--force", "-o", str(tmp / "diag.sqlite"), "--", python, *program,
        ]  # fmt: skip
    if mprof and not args.no_anchor:
        variants["mprof run (100 ms)"] = [mprof, "run", "-o", str(tmp / "mprof.dat"), python, *program]
        variants["mprof run (10 ms)"] = [
            mprof,
            "run",
            "-T",
            "0.01",
            "-o",
            str(tmp / "mprof10.dat"),
            python,
            *program,
        ]
    times: dict[str, list[float]] = {k: [] for k in variants}
    loops: dict[str, list[float]] = {k: [] for k in variants}
    maxrss: dict[str, int] = {}
    timed(variants["untraced"], env)  # warm the page cache and torch's import
    for _ in range(args.reps):
        for name, cmd in variants.items():
            t, rss, loop = timed(cmd, env)
            # progress: partial results survive a time limit
            print(f"  {name}: {t:.3f} s" + (f" (loop {loop:.3f} s)" if loop is not None else ""), flush=True)
            times[name].append(t)
            if loop is not None:
                loops[name].append(loop)
            maxrss[name] = max(maxrss.get(name, 0), rss)
    base = statistics.median(times["untraced"])
    base_min = min(times["untraced"])
    print(f"program: {' '.join(program)}   reps: {args.reps}   python: {sys.version.split()[0]}")
    print("whole process (wall time):")
    print(f"{'variant':<26} {'median s':>9} {'min s':>8} {'ratio':>7} {'min ratio':>9}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<26} {med:9.3f} {min(ts):8.3f} {med / base:7.3f} {min(ts) / base_min:9.3f}")
    if all(len(v) == args.reps for v in loops.values()):
        lbase = statistics.median(loops["untraced"])
        lbase_min = min(loops["untraced"])
        print("training loop only (the program's own timer):")
        print(f"{'variant':<26} {'median s':>9} {'min s':>8} {'ratio':>7} {'min ratio':>9}")
        for name, ts in loops.items():
            med = statistics.median(ts)
            print(f"{name:<26} {med:9.3f} {min(ts):8.3f} {med / lbase:7.3f} {min(ts) / lbase_min:9.3f}")
    con = sqlite3.connect(profile)
    samples = con.execute("select count(*) from cpu_samples").fetchone()[0]
    duration_s = con.execute("select max(t_ns) from cpu_samples").fetchone()[0] / 1e9
    size = profile.stat().st_size
    print(
        f"torchmem profile: {samples} CPU samples over {duration_s:.2f} s "
        f"({samples / duration_s:.0f} Hz), {size / 1024:.0f} KiB "
        f"= {size / 1024 / 1024 / (duration_s / 60):.2f} MiB per minute"
    )
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
