"""Checks every GPU number torchmem reports against torch.cuda and NVML read at the same moment, on a real GPU,
and writes the outcome as Markdown (keep the latest in docs/gpu-check.md).

    python scripts/gpu_check.py [--out docs/gpu-check.md]

Runs, each in its own process so one failure cannot hide the others:
- this file's own check of a `torchmem run` profile of a GPU training script (scripts/gpu_train_truth.py);
- scripts/gpu_check_api.py (stats, peak, empty_cache, Monitor phases), scripts/gpu_check_line.py (line
  profiler), scripts/gpu_check_snapshot.py (capture, on_oom, snapshot reader), when present;
- bench/run_overhead.py on the example training script with --device cuda.
Needs `torchmem` on PATH (pip install the wheel) and a CUDA GPU. Exits non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


class Checks:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failed = 0

    def check(self, name: str, ok: bool, detail: str) -> None:
        line = f"{'PASS' if ok else 'FAIL'} {name}: {detail}"
        print(line, flush=True)
        self.lines.append(line)
        self.failed += not ok


def run_profile_check(c: Checks, torchmem: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-gpucheck-"))
    prof, truth_path = tmp / "train.sqlite", tmp / "truth.json"
    cmd = [
        torchmem,
        "run",
        "-q",
        "-o",
        str(prof),
        "--",
        sys.executable,
        str(ROOT / "scripts/gpu_train_truth.py"),
    ]
    proc = subprocess.run([*cmd, str(truth_path)], capture_output=True, text=True, timeout=600)
    c.check("torchmem run exit code", proc.returncode == 0, f"{proc.returncode} {proc.stderr[-2000:]}")
    if proc.returncode != 0:
        return
    truth = json.loads(truth_path.read_text())
    con = sqlite3.connect(prof)
    meta = json.loads(con.execute("select value from meta where key='run'").fetchone()[0])
    start = meta["start_monotonic_ns"]
    t_truth = truth["t_ns"] - start
    n_torch = con.execute("select count(*) from torch_samples").fetchone()[0]
    dur = con.execute("select max(t_ns) from cpu_samples").fetchone()[0] / 1e9
    c.check(
        "allocator timeline recorded without code change",
        n_torch > 10,
        f"{n_torch} torch samples in {dur:.1f} s",
    )
    peak_a, peak_r = con.execute(
        "select max(max(peak_allocated_bytes, allocated_bytes)), max(max(peak_reserved_bytes, reserved_bytes)) "
        "from torch_samples"
    ).fetchone()
    c.check(
        "profile peak allocated == torch.cuda.max_memory_allocated()",
        peak_a == truth["max_allocated_bytes"],
        f"{peak_a} vs {truth['max_allocated_bytes']} (incl. a 3 GiB spike freed between samples)",
    )
    c.check(
        "profile peak reserved == torch.cuda.max_memory_reserved()",
        peak_r == truth["max_reserved_bytes"],
        f"{peak_r} vs {truth['max_reserved_bytes']}",
    )
    row = con.execute(
        "select t_ns, allocated_bytes, reserved_bytes from torch_samples where t_ns <= ? order by t_ns desc limit 1",
        (t_truth,),
    ).fetchone()
    c.check(
        "allocated at the same moment == torch.cuda.memory_allocated()",
        row is not None and row[1] == truth["allocated_bytes"],
        f"{row[1] if row else None} vs {truth['allocated_bytes']} "
        f"(sample {(t_truth - row[0]) / 1e6 if row else 0:.1f} ms before)",
    )
    c.check(
        "reserved at the same moment == torch.cuda.memory_reserved()",
        row is not None and row[2] == truth["reserved_bytes"],
        f"{row[2] if row else None} vs {truth['reserved_bytes']}",
    )
    g = con.execute(
        "select t_ns, process_bytes, total_bytes from gpu_samples where t_ns <= ? order by t_ns desc limit 1",
        (t_truth,),
    ).fetchone()
    if truth["nvml_process_bytes"] is not None:
        c.check(
            "NVML process memory at the same moment == pynvml",
            g is not None and g[1] == truth["nvml_process_bytes"],
            f"{g[1] if g else None} vs {truth['nvml_process_bytes']}",
        )
    if truth.get("nvml_total_bytes") is not None:
        c.check(
            "device total == NVML total (pynvml)",
            g is not None and g[2] == truth["nvml_total_bytes"],
            f"{g[2] if g else None} vs {truth['nvml_total_bytes']}; torch's total_memory is "
            f"{truth['device_total_bytes']} ({(truth['nvml_total_bytes'] - truth['device_total_bytes']) / MIB:.0f} MiB "
            "less: the driver keeps that part for itself)",
        )
    rep = subprocess.run([torchmem, "report", "--format", "json", str(prof)], capture_output=True, text=True)
    j = json.loads(rep.stdout)
    gpu = j["peak"]["gpus"][0]
    c.check(
        "report JSON peak allocated/reserved match torch",
        gpu["allocated_bytes"] == truth["max_allocated_bytes"] and gpu["reserved_bytes"] == truth["max_reserved_bytes"],
        f"{gpu['allocated_bytes']}/{gpu['reserved_bytes']}",
    )
    c.check(
        "NVML sees more than torch reserves (CUDA context etc.)",
        (gpu.get("nvml_process_bytes") or 0) > truth["max_reserved_bytes"] - 1,
        f"NVML peak {gpu.get('nvml_process_bytes')} vs reserved peak {truth['max_reserved_bytes']}",
    )
    shutil.rmtree(tmp, ignore_errors=True)


INTERPLAY = """
import torch, torchmem
torch.empty(1 << 20, device="cuda")

@torchmem.profile
def step():
    t = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del t
    return torch.empty(1 << 20, dtype=torch.uint8, device="cuda")

base = torch.cuda.memory_allocated()
with torchmem.peak() as p:
    u = step()
print(base, p.allocated_bytes, torchmem.peak().allocated_bytes)
"""


def run_interplay_check(c: Checks) -> None:
    """The line profiler resets torch's peak counters after a line with a temporary; an open `peak()` window
    around the profiled function must still see the temporary (both go through one reset path)."""
    proc = subprocess.run([sys.executable, "-c", INTERPLAY], capture_output=True, text=True, timeout=300)
    try:
        base, window_peak, process_peak = (int(v) for v in proc.stdout.split()[:3])
    except ValueError:
        c.check("peak() window around a line-profiled function", False, proc.stderr[-1500:])
        return
    want = base + (256 << 20)
    c.check(
        "peak() window around a line-profiled function sees the 256 MiB temporary",
        window_peak >= want and process_peak >= want,
        f"window {window_peak}, torchmem.peak() {process_peak}, expected >= {want}",
    )


REMAP_CHILD = """
import torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")  # 1 GiB on the program's cuda:0
torch.cuda.synchronize()
import time; time.sleep(0.3)
print(torch.cuda.get_device_properties(0).uuid)
"""


def run_remap_check(c: Checks, torchmem: str) -> None:
    """CUDA_VISIBLE_DEVICES renumbers GPUs for the program: its cuda:0 is the last GPU here (NVML index N-1),
    or, on a one-GPU machine, GPU 0 named by UUID. The profile must key the allocator's rows by NVML index,
    on the same row as that GPU's NVML numbers."""
    import pynvml

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    target = count - 1
    handle = pynvml.nvmlDeviceGetHandleByIndex(target)
    uuid = pynvml.nvmlDeviceGetUUID(handle)
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    visible = str(target) if count > 1 else uuid
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-remap-"))
    prof = tmp / "remap.sqlite"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    proc = subprocess.run(
        [torchmem, "run", "-q", "-o", str(prof), "--", sys.executable, "-c", REMAP_CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if proc.returncode != 0:
        c.check("CUDA_VISIBLE_DEVICES remap: run", False, proc.stderr[-1500:])
        return
    con = sqlite3.connect(prof)
    torch_devices = sorted(d for (d,) in con.execute("select distinct device from torch_samples"))
    peak = con.execute("select max(peak_allocated_bytes) from torch_samples where device = ?", (target,)).fetchone()[0]
    report = subprocess.run([torchmem, "report", str(prof), "--format", "json"], capture_output=True, text=True)
    gpus = json.loads(report.stdout)["peak"]["gpus"] if report.returncode == 0 else []
    row = next((g for g in gpus if g.get("device") == target), {})
    c.check(
        f"CUDA_VISIBLE_DEVICES={visible}: allocator rows keyed by NVML index {target} ({count} GPU(s) here)",
        torch_devices == [target] and (peak or 0) >= 1 << 30,
        f"torch_samples devices {torch_devices}, peak allocated on {target}: {peak}",
    )
    c.check(
        "CUDA_VISIBLE_DEVICES remap: the report's GPU row holds both the allocator's and NVML's numbers",
        (row.get("allocated_bytes") or 0) >= 1 << 30 and (row.get("nvml_process_bytes") or 0) >= 1 << 30,
        f"row {row}",
    )


def run_script(c: Checks, name: str, args: list[str], timeout_s: int) -> str:
    path = ROOT / name
    if not path.exists():
        c.check(name, False, "script missing")
        return ""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout_s, cwd=ROOT
        )
        out = proc.stdout + proc.stderr
        code = proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = "timeout"
    passes = sum(line.startswith("PASS") for line in out.splitlines())
    fail_lines = [line for line in out.splitlines() if line.startswith("FAIL")]
    c.check(
        name,
        code == 0,
        f"exit {code}, {passes} PASS / {len(fail_lines)} FAIL lines, {time.perf_counter() - start:.0f} s",
    )
    for line in fail_lines:
        c.lines.append(f"  {name}: {line}")
        print(f"  {line}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "docs" / "gpu-check.md"))
    parts_help = "skip a part: run, interplay, remap, api, line, snapshot, breakdown, bench"
    ap.add_argument("--skip", action="append", default=[], help=parts_help)
    ap.add_argument("--only", action="append", default=[], help="run only these parts (same names as --skip)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; this script checks GPU numbers and needs a GPU")
    torchmem = shutil.which("torchmem")
    if torchmem is None:
        raise SystemExit("gpu_check: `torchmem` is not on PATH; pip install the wheel first")
    c = Checks()
    header = (
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n- GPU: {torch.cuda.get_device_name(0)}, "
        f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB\n- torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), Python {platform.python_version()}\n"
    )
    print(header)
    sections: list[tuple[str, str]] = []

    def wanted(key: str) -> bool:
        return key not in args.skip and (not args.only or key in args.only)

    if wanted("run"):
        run_profile_check(c, torchmem)
    if wanted("interplay"):
        run_interplay_check(c)
    if wanted("remap"):
        run_remap_check(c, torchmem)
    parts = [
        ("api", "scripts/gpu_check_api.py", [], 400),
        ("line", "scripts/gpu_check_line.py", [], 600),
        ("snapshot", "scripts/gpu_check_snapshot.py", [], 600),
        ("breakdown", "scripts/gpu_check_breakdown.py", [], 300),
        (
            "bench",
            "bench/run_overhead.py",
            ["--reps", "3", "--", str(ROOT / "examples/train.py"), "--device", "cuda", "--epochs", "3"],
            600,
        ),
    ]
    for key, script, extra, timeout_s in parts:
        if not wanted(key):
            continue
        out = run_script(c, script, extra, timeout_s)
        sections.append((script, out))
    verdict = "all checks passed" if c.failed == 0 else f"{c.failed} check(s) FAILED"
    md = [
        "# GPU check: torchmem against torch.cuda and NVML on a real GPU",
        "",
        f"Command: `python scripts/gpu_check.py` (wheel installed, `torchmem` on PATH). Result: **{verdict}**.",
        "",
        header,
        "## Summary",
        "",
        "```",
        *c.lines,
        "```",
    ]
    for script, out in sections:
        md += ["", f"## {script}", "", "```", out.strip()[-12000:], "```"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(md) + "\n")
    print(f"\n{verdict}; written to {args.out}")
    sys.exit(1 if c.failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
