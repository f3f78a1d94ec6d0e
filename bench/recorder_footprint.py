"""The recorder's own footprint over a long run: its peak RSS and the profile's growth per minute at a given
sampling interval. Runs `torchmem run` on a program that sleeps (so every byte is the recorder's).

    .venv/bin/python bench/recorder_footprint.py [--seconds 60] [--interval-ms 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interval-ms", type=float, default=10.0)
    args = ap.parse_args()
    torchmem = shutil.which("torchmem", path=str(Path(sys.executable).parent)) or shutil.which("torchmem")
    if torchmem is None:
        raise SystemExit("torchmem is not installed: run ./setup.sh first")
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-footprint-"))
    profile = tmp / "p.sqlite"
    code = f"import time; x = bytearray(64 << 20); time.sleep({args.seconds})"
    cmd = [
        torchmem,
        "run",
        "-q",
        "--interval",
        str(args.interval_ms),
        "-o",
        str(profile),
        "--",
        sys.executable,
        "-c",
        code,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=dict(os.environ, TORCHMEM_PYTHON=sys.executable))
    hwm_kib = 0
    while proc.poll() is None:
        try:
            status_text = Path(f"/proc/{proc.pid}/status").read_text()
            hwm_kib = max(hwm_kib, int(status_text.split("VmHWM:")[1].split()[0]))
        except (OSError, IndexError, ValueError):
            pass
        time.sleep(0.2)
    wall = time.perf_counter() - start
    con = sqlite3.connect(profile)
    samples = con.execute("select count(*) from cpu_samples").fetchone()[0]
    size = profile.stat().st_size
    print(f"run {wall:.1f} s at {args.interval_ms:g} ms: {samples} CPU samples ({samples / wall:.0f} Hz)")
    print(f"recorder peak RSS (VmHWM of the torchmem process alone): {hwm_kib / 1024:.1f} MiB")
    print(f"profile {size / 1024:.0f} KiB = {size / 1024 / 1024 / (wall / 60):.2f} MiB per minute")
    shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
