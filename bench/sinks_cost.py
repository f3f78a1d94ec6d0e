"""What the recorder's sinks cost: the `torchmem` recorder's own CPU time (utime + stime of its process, read
from /proc while it runs, so the profiled program's CPU is not counted) for the same program under two
binaries (before and after a change), and under the new binary with --metrics / --tensorboard and without
the live sink (`TORCHMEM_LIVE=0`), alternated, N runs each; prints the medians and ratios.

    python bench/sinks_cost.py --before /tmp/torchmem_before --after target/release/torchmem [--runs 5]

The program is a Python loop of Monitor steps (markers through the recorder at ~100 steps/s) without torch's
import cost in the measurement (only the recorder's process is timed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROGRAM = """
import time, torchmem
mon = torchmem.Monitor(verbose=False)
end = time.monotonic() + {seconds}
with mon.epoch():
    while time.monotonic() < end:
        with mon.step():
            with torchmem.track("forward"):
                x = bytearray(1 << 16)
        time.sleep(0.01)
"""

TICK_S = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK_S


def one(binary: str, extra: list[str], script: Path, tmp: Path) -> float:
    out = tmp / "p.sqlite"
    out.unlink(missing_ok=True)
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable, TORCHMEM_LIVE_DIR=str(tmp / "live"))
    if extra[:1] == ["TORCHMEM_LIVE=0"]:
        env["TORCHMEM_LIVE"], extra = "0", extra[1:]
    cmd = [binary, "run", "-q", "-f", "-o", str(out), *extra, str(script)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    last = 0.0
    while proc.poll() is None:
        c = cpu_s(proc.pid)
        if c is not None:
            last = c
        time.sleep(0.02)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} -> {proc.returncode}")
    return last


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        script = tmp / "loop.py"
        script.write_text(PROGRAM.format(seconds=a.seconds))
        cases = {
            "before (plain run)": (a.before, []),
            "after (plain run)": (a.after, []),
            "after --metrics --metrics-textfile": (
                a.after,
                ["--metrics", "127.0.0.1:0", "--metrics-textfile", str(tmp / "m.prom")],
            ),
            "after --tensorboard": (a.after, ["--tensorboard", str(tmp / "tb")]),
            # The live sink (the state file `torchmem top` reads, rewritten 4 times a second) is in every plain
            # run; TORCHMEM_LIVE=0 takes it out, so the two rows are its cost.
            "after TORCHMEM_LIVE=0 (no live sink)": (a.after, ["TORCHMEM_LIVE=0"]),
        }
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(a.runs):
            for name, (binary, extra) in cases.items():
                times[name].append(one(binary, extra, script, tmp))
    base = statistics.median(times["before (plain run)"])
    load = os.getloadavg()[0]
    print(f"recorder CPU over a {a.seconds:.0f} s run (~100 steps/s), median of {a.runs}, alternated; load {load:.1f}")
    for name, ts in times.items():
        m = statistics.median(ts)
        spread = f"{min(ts):.3f}-{max(ts):.3f}"
        print(f"  {name:38s} {m:.3f} s CPU  ({spread})  x{m / base:.2f}")


if __name__ == "__main__":
    main()
