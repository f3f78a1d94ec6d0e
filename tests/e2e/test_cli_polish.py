"""Small command-line consistencies (through `python -m torchmem`, the console script's path): usage text
names `torchmem`, usage errors exit 2, `snapshot --html` reports what it wrote like `plot`, and `info` says
in one short line why there is no NVML on a machine without an NVIDIA driver."""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SNAPSHOTS = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, timeout=120)


def test_python_m_torchmem_usage_names_torchmem() -> None:
    r = cli()
    assert r.returncode == 2
    assert "Usage: torchmem <COMMAND>" in r.stderr, r.stderr
    assert "__main__" not in r.stderr
    assert "Usage: torchmem report" in cli("report", "--help").stdout


def test_usage_errors_exit_2() -> None:
    pickle = sorted(SNAPSHOTS.glob("*.pickle"))[0]
    r = cli("snapshot", "diff", str(pickle))
    assert r.returncode == 2 and "usage: torchmem snapshot diff" in r.stderr, r.stderr
    r = cli("snapshot", str(pickle), "--at", "5")
    assert r.returncode == 2 and "--at needs --top" in r.stderr


def test_snapshot_html_says_what_it_wrote(tmp_path: Path) -> None:
    pickle = sorted(SNAPSHOTS.glob("*.pickle"))[0]
    out = tmp_path / "snap.html"
    r = cli("snapshot", str(pickle), "--html", str(out))
    assert r.returncode == 0, r.stderr
    size_kib = out.stat().st_size / 1024
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"torchmem: wrote {out} ("), line
    shown = float(line.rsplit("(", 1)[1].split()[0])
    assert abs(shown - (size_kib if "KiB" in line else size_kib / 1024)) < 0.01, line


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has NVML")
def test_info_without_a_driver_gives_one_short_nvml_line() -> None:
    r = cli("info")
    assert r.returncode == 0, r.stderr
    assert "NVML not available (libnvidia-ml.so.1 not found): no NVIDIA driver on this machine" in r.stdout
    assert "libloading" not in r.stdout and "shared object" not in r.stdout
    j = json.loads(cli("info", "--json").stdout)
    assert j["gpu_unavailable"].startswith("NVML not available")
