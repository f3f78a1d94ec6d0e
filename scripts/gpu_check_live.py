"""GPU check of the live view (`torchmem top`, the live state file `torchmem run` keeps) on a real NVIDIA GPU.

A real `torchmem run` of a CUDA program that holds 1 GiB inside `torchmem.track("gpu-hold")`; while it holds,
the run's state file (what `top` and `run --live` draw) is compared with what the program's own
`torch.cuda.memory_allocated()` / `memory_reserved()` say and with NVML (`pynvml`) read at the same moment;
then `torchmem top --once` must show the GPU line (name, used of total), the program in NVML's process list
and its ALLOC column. Prints one PASS/FAIL line per check and exits non-zero when any fails.

    python scripts/gpu_check_live.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
FAILURES: list[str] = []
# The `torchmem` of this interpreter's environment, else the one on PATH (a wheel installed with --target).
TM = str(Path(sys.executable).parent / "torchmem")
if not Path(TM).exists():
    TM = shutil.which("torchmem") or TM

PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import torch
    import torchmem
    here = Path(sys.argv[1])
    with torchmem.track("gpu-hold"):
        x = torch.ones(GIB // 4, device="cuda")
        torch.cuda.synchronize()
        (here / "torch.json").write_text(json.dumps({
            "pid": os.getpid(),
            "allocated": torch.cuda.memory_allocated(),
            "reserved": torch.cuda.memory_reserved(),
        }))
        while not (here / "stop").exists():
            time.sleep(0.05)
    """
).replace("GIB", str(GIB))


def report(ok: bool, name: str, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def wait_for(check, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    return None


def main() -> int:
    import pynvml

    pynvml.nvmlInit()
    tmp = Path(tempfile.mkdtemp(prefix="torchmem-live-gpu-"))
    live = tmp / "live"
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable, TORCHMEM_LIVE_DIR=str(live))
    (tmp / "prog.py").write_text(PROGRAM)
    run = subprocess.Popen([TM, "run", "-o", str(tmp / "p.sqlite"), "--", "prog.py", "."], cwd=tmp, env=env)
    try:
        truth = wait_for(lambda: (tmp / "torch.json").exists() and json.loads((tmp / "torch.json").read_text()), 180)
        report(truth is not None, "program_started", f"{truth}")
        if truth is None:
            return 1
        pid = truth["pid"]

        def state():
            files = list(live.glob("*.json"))
            if not files:
                return None
            s = json.loads(files[0].read_text())
            procs = [p for p in s["processes"] if p["pid"] == pid and p["torch"] and p.get("phase") == "gpu-hold"]
            return procs and (s, procs[0])

        got = wait_for(state, 30)
        report(got is not None, "state_file_has_the_allocator", "the program's row with torch readings and its phase")
        if got is None:
            return 1
        time.sleep(1.0)  # the sampler's next reading of the idle, holding program
        s, p = state()
        t = p["torch"][0]
        report(
            t["allocated_bytes"] == truth["allocated"],
            "allocated_equals_torch",
            f"{t['allocated_bytes']} vs {truth['allocated']}",
        )
        report(
            t["reserved_bytes"] == truth["reserved"],
            "reserved_equals_torch",
            f"{t['reserved_bytes']} vs {truth['reserved']}",
        )
        report(
            s["tree"]["peak_allocated_bytes"] >= GIB,
            "peak_allocated_at_least_1_gib",
            f"{s['tree']['peak_allocated_bytes']}",
        )
        h = pynvml.nvmlDeviceGetHandleByIndex(t["device"])
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        gpu = next((g for g in s["gpus"] if g["index"] == t["device"]), None)
        report(gpu is not None and gpu["total_bytes"] == mem.total, "gpu_total_equals_nvml", f"{gpu} vs {mem.total}")
        if gpu is not None:
            # torchmem reads NVML's v2 memory info (as nvidia-smi shows it): "used" without the driver's reserved
            # memory, which v1's "used" (total - free) includes (~0.6 GiB on an H200).
            try:
                used = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used
                which = "NVML v2 used"
            except Exception:
                used, which = mem.used, "NVML v1 used (v2 unavailable)"
            report(
                abs(gpu["used_bytes"] - used) <= 256 * MIB,
                "gpu_used_near_nvml",
                f"{gpu['used_bytes']} vs {which} {used} (v1 used {mem.used})",
            )
        nvml_proc = {q.pid: q.usedGpuMemory for q in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
        report(
            p.get("gpu_bytes") == nvml_proc.get(pid),
            "process_gpu_bytes_equal_nvml",
            f"{p.get('gpu_bytes')} vs {nvml_proc.get(pid)}",
        )

        out = subprocess.run([TM, "top", "--once"], env=env, capture_output=True, text=True, timeout=60).stdout
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else name
        gpu_line = next((line for line in out.splitlines() if line.startswith(f"GPU {t['device']} ")), "")
        report(name in gpu_line and " used " in gpu_line, "top_gpu_line", gpu_line)
        procs_line = next((line for line in out.splitlines() if "processes (NVML)" in line), "")
        report(f"{pid} " in procs_line, "top_lists_the_program_on_the_gpu", procs_line)
        row = next((line for line in out.splitlines() if line.startswith(f"{pid} ")), "")
        cells = row.split()
        report(len(cells) > 4 and cells[4] == "1.00G", "top_alloc_column", row)
        report("no NVIDIA GPU" not in out, "top_sees_nvml", "no 'no NVIDIA GPU' line")
    finally:
        (tmp / "stop").touch()
        code = run.wait(timeout=120)
    report(code == 0, "run_exit_code", f"{code}")
    print(f"{'ALL PASS' if not FAILURES else 'FAILED: ' + ', '.join(FAILURES)}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
