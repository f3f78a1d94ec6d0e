"""The live view (`torchmem top`, the live state file `torchmem run` keeps) on a real NVIDIA GPU (was
scripts/gpu_check_live.py).

A real `torchmem run` of a CUDA program that holds 1 GiB inside `torchmem.track("gpu-hold")`; while it holds,
the run's state file (what `top` and `run --live` draw) is compared with what the program's own
`torch.cuda.memory_allocated()` / `memory_reserved()` say and with NVML (`pynvml`) read at the same moment;
then `torchmem top --once` must show the GPU line (name, used of total), the program in NVML's process list
and its ALLOC column. The run happens once (a module-scoped fixture records every reading); each check is a test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

MIB = 1 << 20
GIB = 1 << 30

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


def _torchmem() -> str:
    """The `torchmem` of this interpreter's environment, else the one on PATH (a wheel installed with --target)."""
    tm = str(Path(sys.executable).parent / "torchmem")
    if not Path(tm).exists():
        tm = shutil.which("torchmem") or tm
    return tm


def wait_for(check, timeout_s: float):  # noqa: ANN001, ANN201 - a predicate returning a value or a falsy one
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    return None


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Runs the holding program under `torchmem run` and reads everything the checks compare, while it holds."""
    import pynvml

    pynvml.nvmlInit()
    tm = _torchmem()
    tmp = tmp_path_factory.mktemp("torchmem-live-gpu")
    live_dir = tmp / "live"
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable, TORCHMEM_LIVE_DIR=str(live_dir))
    (tmp / "prog.py").write_text(PROGRAM)
    res: dict = {"truth": None, "got": None}
    run = subprocess.Popen([tm, "run", "-o", str(tmp / "p.sqlite"), "--", "prog.py", "."], cwd=tmp, env=env)
    try:
        truth = wait_for(lambda: (tmp / "torch.json").exists() and json.loads((tmp / "torch.json").read_text()), 180)
        res["truth"] = truth
        if truth is not None:
            pid = truth["pid"]

            def state():  # noqa: ANN202
                files = list(live_dir.glob("*.json"))
                if not files:
                    return None
                s = json.loads(files[0].read_text())
                procs = [p for p in s["processes"] if p["pid"] == pid and p["torch"] and p.get("phase") == "gpu-hold"]
                return procs and (s, procs[0])

            res["got"] = wait_for(state, 30)
            if res["got"] is not None:
                time.sleep(1.0)  # the sampler's next reading of the idle, holding program
                s, p = state()
                t = p["torch"][0]
                h = pynvml.nvmlDeviceGetHandleByIndex(t["device"])
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                # torchmem reads NVML's v2 memory info (as nvidia-smi shows it): "used" without the driver's
                # reserved memory, which v1's "used" (total - free) includes (~0.6 GiB on an H200).
                try:
                    used = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used
                    which = "NVML v2 used"
                except Exception:
                    used, which = mem.used, "NVML v1 used (v2 unavailable)"
                nvml_proc = {q.pid: q.usedGpuMemory for q in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
                out = subprocess.run([tm, "top", "--once"], env=env, capture_output=True, text=True, timeout=60).stdout
                name = pynvml.nvmlDeviceGetName(h)
                res.update(
                    s=s,
                    p=p,
                    t=t,
                    mem_total=mem.total,
                    mem_v1_used=mem.used,
                    used=used,
                    which=which,
                    nvml_proc=nvml_proc,
                    top=out,
                    name=name.decode() if isinstance(name, bytes) else name,
                )
    finally:
        (tmp / "stop").touch()
        res["code"] = run.wait(timeout=120)
    return res


def _holding(live: dict) -> dict:
    if live["truth"] is None:
        pytest.fail("the program never started holding (no torch.json within 180 s)")
    if live["got"] is None:
        pytest.fail("the state file never had the program's row with torch readings and its phase")
    return live


def test_program_started(live: dict) -> None:
    assert live["truth"] is not None, f"program_started: {live['truth']}"


def test_state_file_has_the_allocator(live: dict) -> None:
    if live["truth"] is None:
        pytest.fail("the program never started holding (no torch.json within 180 s)")
    assert live["got"] is not None, "state_file_has_the_allocator: the program's row with torch readings and its phase"


def test_allocated_equals_torch(live: dict) -> None:
    r = _holding(live)
    assert r["t"]["allocated_bytes"] == r["truth"]["allocated"], (
        f"allocated_equals_torch: {r['t']['allocated_bytes']} vs {r['truth']['allocated']}"
    )


def test_reserved_equals_torch(live: dict) -> None:
    r = _holding(live)
    assert r["t"]["reserved_bytes"] == r["truth"]["reserved"], (
        f"reserved_equals_torch: {r['t']['reserved_bytes']} vs {r['truth']['reserved']}"
    )


def test_peak_allocated_at_least_1_gib(live: dict) -> None:
    r = _holding(live)
    assert r["s"]["tree"]["peak_allocated_bytes"] >= GIB, (
        f"peak_allocated_at_least_1_gib: {r['s']['tree']['peak_allocated_bytes']}"
    )


def _gpu(r: dict) -> dict | None:
    return next((g for g in r["s"]["gpus"] if g["index"] == r["t"]["device"]), None)


def test_gpu_total_equals_nvml(live: dict) -> None:
    r = _holding(live)
    gpu = _gpu(r)
    assert gpu is not None and gpu["total_bytes"] == r["mem_total"], f"gpu_total_equals_nvml: {gpu} vs {r['mem_total']}"


def test_gpu_used_near_nvml(live: dict) -> None:
    r = _holding(live)
    gpu = _gpu(r)
    if gpu is None:
        pytest.fail(f"gpu_used_near_nvml: no GPU {r['t']['device']} in the state file's gpus {r['s']['gpus']}")
    assert abs(gpu["used_bytes"] - r["used"]) <= 256 * MIB, (
        f"gpu_used_near_nvml: {gpu['used_bytes']} vs {r['which']} {r['used']} (v1 used {r['mem_v1_used']})"
    )


def test_process_gpu_bytes_equal_nvml(live: dict) -> None:
    r = _holding(live)
    pid = r["truth"]["pid"]
    assert r["p"].get("gpu_bytes") == r["nvml_proc"].get(pid), (
        f"process_gpu_bytes_equal_nvml: {r['p'].get('gpu_bytes')} vs {r['nvml_proc'].get(pid)}"
    )


def test_top_gpu_line(live: dict) -> None:
    r = _holding(live)
    gpu_line = next((line for line in r["top"].splitlines() if line.startswith(f"GPU {r['t']['device']} ")), "")
    assert r["name"] in gpu_line and " used " in gpu_line, f"top_gpu_line: {gpu_line!r} (GPU name {r['name']!r})"


def test_top_lists_the_program_on_the_gpu(live: dict) -> None:
    r = _holding(live)
    pid = r["truth"]["pid"]
    procs_line = next((line for line in r["top"].splitlines() if "processes (NVML)" in line), "")
    assert f"{pid} " in procs_line, f"top_lists_the_program_on_the_gpu: {procs_line!r} (pid {pid})"


def test_top_alloc_column(live: dict) -> None:
    r = _holding(live)
    pid = r["truth"]["pid"]
    row = next((line for line in r["top"].splitlines() if line.startswith(f"{pid} ")), "")
    cells = row.split()
    assert len(cells) > 4 and cells[4] == "1.00G", f"top_alloc_column: {row!r}"


def test_top_sees_nvml(live: dict) -> None:
    r = _holding(live)
    assert "no NVIDIA GPU" not in r["top"], f"top_sees_nvml: a 'no NVIDIA GPU' line in\n{r['top']}"


def test_run_exit_code(live: dict) -> None:
    assert live["code"] == 0, f"run_exit_code: {live['code']}"
