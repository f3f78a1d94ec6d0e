"""Whole-run recording overhead: the untraced program, `torchmem run` and memory_profiler's `mprof run` (the
anchor for whole-run memory timelines), side by side in one run, interleaved, several repetitions.

    .venv/bin/python bench/run_overhead.py [--reps 5] [--interval-ms 10] [-- PROGRAM ARGS...]
    .venv/bin/python bench/run_overhead.py --short-steps [--reps 9]

Default program: examples/train.py --epochs 3. Prints the median wall time of each and the ratio to the
untraced run, plus the profile size, the number of samples and the recorder's own peak RSS.

`--short-steps`: the program is bench/short_steps.py (a CPU loop of 800 steps of ~1.7 ms, one thread, where a
per-step cost shows most), and the variants are the untraced run, `torchmem run`, `torchmem run` with
`TORCHMEM_WATCH=0` (no automatic watch: the in-process sampler alone), `torchmem run --no-inject` (nothing in
the process) and `mprof run`, 9 repetitions by default."""

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
# bench/short_steps.py also prints the loop's CPU time in its main thread.
CPU_LINE = re.compile(rb"^main thread CPU ([0-9.]+) s$", re.MULTILINE)


def timed(cmd: list[str], env: dict) -> tuple[float, int, float | None, float | None]:
    """Wall seconds, the peak RSS (KiB) of the largest child (wait4's rusage), and the program's own
    training-loop seconds and main-thread CPU seconds when it prints them."""
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
        _, status, rusage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        out.seek(0)
        text = out.read()
        found, cpu = LOOP_LINE.search(text), CPU_LINE.search(text)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"failed (exit {code}): {' '.join(cmd)}\n{stderr[-2000:]}")
    return (
        elapsed,
        rusage.ru_maxrss,
        float(found.group(1)) if found else None,
        float(cpu.group(1)) if cpu else None,
    )


def table(title: str, series: dict[str, list[float]]) -> None:
    """Median, minimum and their ratios to the untraced run's."""
    base, base_min = statistics.median(series["untraced"]), min(series["untraced"])
    print(title)
    print(f"{'variant':<26} {'median s':>9} {'min s':>8} {'ratio':>7} {'min ratio':>9}")
    for name, ts in series.items():
        med = statistics.median(ts)
        print(f"{name:<26} {med:9.3f} {min(ts):8.3f} {med / base:7.3f} {min(ts) / base_min:9.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=None, help="repetitions (5; 9 with --short-steps)")
    ap.add_argument("--interval-ms", type=float, default=10.0)
    ap.add_argument(
        "--diagnose",
        action="store_true",
        help="also run torchmem without the automatic watch (TORCHMEM_WATCH=0), without anything in-process "
        "(--no-inject) and without NVML (--no-gpu)",
    )
    ap.add_argument("--no-anchor", action="store_true", help="skip mprof (a quicker torchmem-only A/B)")
    ap.add_argument(
        "--short-steps",
        action="store_true",
        help="bench/short_steps.py with TORCHMEM_WATCH=0 and --no-inject variants (see above)",
    )
    ap.add_argument(
        "--torchmem",
        help="the torchmem command to time (default: the one beside this Python); with PYTHONPATH set to an "
        "older build's folder, an A/B of two builds",
    )
    ap.add_argument("program", nargs="*", default=[])
    args = ap.parse_args()
    if args.reps is None:
        args.reps = 9 if args.short_steps else 5
    default = ["bench/short_steps.py"] if args.short_steps else ["examples/train.py", "--epochs", "3"]
    program = args.program or [str(ROOT / default[0]), *default[1:]]
    python = sys.executable
    torchmem = args.torchmem or shutil.which("torchmem", path=str(Path(python).parent)) or shutil.which("torchmem")
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
    if args.short_steps or args.diagnose:
        # The in-process sampler without the automatic watch (torchmem._autowatch), then nothing in-process.
        variants["torchmem run, WATCH=0"] = [
            "env", "TORCHMEM_WATCH=0",
            torchmem, "run", "-q", "--force", "-o", str(tmp / "diag.sqlite"), "--", python, *program,
        ]  # fmt: skip
        variants["torchmem run --no-inject"] = [
            torchmem, "run", "-q", "--force", "--no-inject", "-o", str(tmp / "diag.sqlite"), "--", python, *program,
        ]  # fmt: skip
    if args.diagnose:
        for flag in ("--no-gpu",):
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
    if mprof and not args.no_anchor and not args.short_steps:
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
    cpus: dict[str, list[float]] = {k: [] for k in variants}
    maxrss: dict[str, int] = {}
    timed(variants["untraced"], env)  # warm the page cache and torch's import
    load_before = os.getloadavg()[0]
    for _ in range(args.reps):
        for name, cmd in variants.items():
            t, rss, loop, cpu = timed(cmd, env)
            # progress: partial results survive a time limit
            print(
                f"  {name}: {t:.3f} s"
                + (f" (loop {loop:.3f} s)" if loop is not None else "")
                + (f" (main thread CPU {cpu:.3f} s)" if cpu is not None else ""),
                flush=True,
            )
            times[name].append(t)
            if loop is not None:
                loops[name].append(loop)
            if cpu is not None:
                cpus[name].append(cpu)
            maxrss[name] = max(maxrss.get(name, 0), rss)
    print(f"program: {' '.join(program)}   reps: {args.reps}   python: {sys.version.split()[0]}")
    print(
        f"machine: {os.cpu_count()} CPUs, load average (1 min) {load_before:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end"
    )
    table("whole process (wall time):", times)
    if all(len(v) == args.reps for v in loops.values()):
        table("training loop only (the program's own timer):", loops)
    if all(len(v) == args.reps for v in cpus.values()):
        table("training loop, the main thread's CPU time (steadier on a loaded machine):", cpus)
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
