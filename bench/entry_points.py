"""Packaging benchmark (issue 9 item 7, issue 27 item 3): the installed `torchmem` command (before the split a
console script, CPython + the extension; after it the `torchmem-cli` wheel's native binary), `python -m torchmem`
(the same command line; after the split a shim that execs the binary) and the cargo-built binary, side by side in
one run, and what every profiled process pays to load the extension. (Not named `packaging.py`: a bench script
beside it that imports the `packaging` library, as transformers does, would import this file instead.)

    .venv/bin/python bench/entry_points.py [--n 21] [--binary target/release/torchmem]

Prints: `torchmem --version` startup (median of N, with `python -c pass` as the floor), the recorder's RSS
(VmRSS peak sampled, VmHWM at the end) during a `torchmem run` of a child that sleeps, and the extension's size,
`import torchmem._native` time, the RSS it adds and the shared libraries it maps (/proc/self/maps)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


def median_ms(cmd: list[str], n: int, env: dict[str, str] | None = None) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=env)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def status_kib(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def recorder_rss(cmd: list[str], sleep_s: float) -> dict[str, float]:
    """Starts `cmd run -q -o P -- python -c sleep`, samples the recorder's (our child's) VmRSS every 20 ms."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TORCHMEM_PYTHON=sys.executable)
        child = [sys.executable, "-c", f"import time; time.sleep({sleep_s})"]
        p = subprocess.Popen([*cmd, "run", "-q", "-o", f"{d}/p.sqlite", "--", *child], env=env)
        peak_kib, hwm_kib = 0, 0
        while p.poll() is None:
            peak_kib = max(peak_kib, status_kib(p.pid, "VmRSS") or 0)
            hwm_kib = max(hwm_kib, status_kib(p.pid, "VmHWM") or 0)
            time.sleep(0.02)
        assert p.returncode == 0, p.returncode
    return {"rss_peak_mib": peak_kib / 1024, "hwm_mib": hwm_kib / 1024}


PROBE = r"""
import json, sys, time
from pathlib import Path
def rss_kib():
    return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:")).split()[1])
def libs():
    out = {}
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and (".so" in parts[5]):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out[parts[5]] = out.get(parts[5], 0) + hi - lo
    return out
before_rss, before_libs = rss_kib(), libs()
t0 = time.perf_counter()
if len(sys.argv) > 1:  # a given build of the extension (e.g. target/release/lib_native.so)
    import importlib.util
    spec = importlib.util.spec_from_file_location("_native", sys.argv[1])
    n = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(n)
else:
    import torchmem._native as n
import_ms = (time.perf_counter() - t0) * 1e3
after_rss, after_libs = rss_kib(), libs()
new = {k: v for k, v in after_libs.items() if k not in before_libs}
print(json.dumps({"import_ms": import_ms, "rss_added_kib": after_rss - before_rss, "new_libs": new, "so": n.__file__}))
"""


def probe(n: int, extension: str | None = None) -> dict:
    extra = [extension] if extension else []
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, "-S", "-c", PROBE, *extra],
                capture_output=True,
                text=True,
                check=True,
                env=dict(os.environ, PYTHONPATH=str(site_packages())),
            ).stdout
        )
        for _ in range(n)
    ]
    last = runs[-1]
    return {
        "import_ms": statistics.median(r["import_ms"] for r in runs),
        "rss_added_mib": statistics.median(r["rss_added_kib"] for r in runs) / 1024,
        "new_libs": last["new_libs"],
        "so": last["so"],
    }


def site_packages() -> Path:
    import torchmem

    return Path(torchmem.__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=21)
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "torchmem"))
    ap.add_argument("--sleep-s", type=float, default=2.0)
    ap.add_argument(
        "--release-extension",
        default=str(ROOT / "target" / "release" / "lib_native.so"),
        help="a release build of the extension, probed too (maturin develop without --release is debug)",
    )
    args = ap.parse_args()
    installed = VENV_BIN / "torchmem"
    kind = "console script" if installed.read_bytes()[:2] == b"#!" else "native binary"
    commands = [(f"torchmem ({kind})", [str(installed)]), ("python -m torchmem", [sys.executable, "-m", "torchmem"])]
    binary = Path(args.binary)
    if binary.exists():
        built = time.strftime("%Y-%m-%d %H:%M", time.gmtime(binary.stat().st_mtime))
        commands.append((f"cargo binary ({built} UTC)", [str(binary)]))
    print(f"# installed {installed} ({kind}); N={args.n}; load {os.getloadavg()[0]:.1f}")

    floor = median_ms([sys.executable, "-c", "pass"], args.n)
    print("\n## startup: `torchmem --version`, median ms")
    print(f"{'python -c pass':32} {floor:7.1f}")
    for label, cmd in commands:
        print(f"{label:32} {median_ms([*cmd, '--version'], args.n):7.1f}")

    print(f"\n## recorder during `torchmem run` of a child sleeping {args.sleep_s} s (MiB)")
    for label, cmd in commands:
        if cmd[0] == sys.executable:
            continue  # the shim execs the binary: the same process as the installed command after the split
        r = recorder_rss(cmd, args.sleep_s)
        print(f"{label:32} VmRSS peak {r['rss_peak_mib']:6.1f}  VmHWM {r['hwm_mib']:6.1f}")

    builds = [("installed", None)]
    if Path(args.release_extension).exists():
        builds.append(("release", args.release_extension))
    for label, ext in builds:
        p = probe(max(5, args.n // 2), ext)
        so = Path(p["so"])
        print(f"\n## what every profiled process loads: `import torchmem._native`, {label} build (python -S, median)")
        print(f"extension           {so} {so.stat().st_size / 2**20:.1f} MiB on disk")
        print(f"import time         {p['import_ms']:.1f} ms")
        print(f"RSS added           {p['rss_added_mib']:.1f} MiB")
        print("new shared objects mapped (MiB of address space):")
        for lib, size in sorted(p["new_libs"].items(), key=lambda kv: -kv[1]):
            print(f"  {size / 2**20:6.1f}  {lib}")
    print(f"installed command on disk {installed.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
