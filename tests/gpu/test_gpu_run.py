"""Every GPU number of a `torchmem run` profile against torch.cuda and NVML read at the same moment, on a real
GPU (formerly scripts/gpu_check.py, parts run / interplay / remap / bench; its api, line, snapshot and breakdown
parts are the other files of tests/gpu).

- a `torchmem run` profile of a GPU training script (scripts/gpu_train_truth.py, no torchmem call in it) against
  what the script read from torch.cuda and pynvml at its end;
- an open `peak()` window around a line-profiled function sees the function's temporary;
- CUDA_VISIBLE_DEVICES remaps the program's cuda:0: rows keyed by NVML index;
- bench/run_overhead.py on the example training script with --device cuda (numbers printed, exit code judged).

Needs the wheel installed (`torchmem` on PATH), a CUDA GPU and pynvml.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


# --- a `torchmem run` profile of scripts/gpu_train_truth.py ------------------------------------------------------


@pytest.fixture(scope="module")
def run_profile(torchmem_cli: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The run, its profile's numbers at the truth's moment and its JSON report (read once)."""
    tmp = tmp_path_factory.mktemp("gpucheck-run")
    prof, truth_path = tmp / "train.sqlite", tmp / "truth.json"
    cmd = [torchmem_cli, "run", "-q", "-o", str(prof), "--", sys.executable, str(ROOT / "scripts/gpu_train_truth.py")]
    proc = subprocess.run([*cmd, str(truth_path)], capture_output=True, text=True, timeout=600)
    out: dict = {"rc": proc.returncode, "stderr": proc.stderr[-2000:]}
    if proc.returncode != 0:
        return out
    truth = json.loads(truth_path.read_text())
    con = sqlite3.connect(prof)
    meta = json.loads(con.execute("select value from meta where key='run'").fetchone()[0])
    t_truth = truth["t_ns"] - meta["start_monotonic_ns"]
    out["truth"] = truth
    out["n_torch"] = con.execute("select count(*) from torch_samples").fetchone()[0]
    out["dur"] = con.execute("select max(t_ns) from cpu_samples").fetchone()[0] / 1e9
    out["peak_a"], out["peak_r"] = con.execute(
        "select max(max(peak_allocated_bytes, allocated_bytes)), max(max(peak_reserved_bytes, reserved_bytes)) "
        "from torch_samples"
    ).fetchone()
    out["row"] = con.execute(
        "select t_ns, allocated_bytes, reserved_bytes from torch_samples where t_ns <= ? order by t_ns desc limit 1",
        (t_truth,),
    ).fetchone()
    out["t_truth"] = t_truth
    out["g"] = con.execute(
        "select t_ns, process_bytes, total_bytes from gpu_samples where t_ns <= ? order by t_ns desc limit 1",
        (t_truth,),
    ).fetchone()
    con.close()
    rep = subprocess.run([torchmem_cli, "report", "--format", "json", str(prof)], capture_output=True, text=True)
    out["report_gpu"] = json.loads(rep.stdout)["peak"]["gpus"][0]
    return out


@pytest.fixture(scope="module")
def run_ok(run_profile: dict) -> dict:
    if run_profile["rc"] != 0:
        pytest.fail(f"torchmem run failed: {run_profile['rc']} {run_profile['stderr']}")
    return run_profile


def test_torchmem_run_exit_code(run_profile: dict) -> None:
    assert run_profile["rc"] == 0, f"torchmem run exit code: {run_profile['rc']} {run_profile['stderr']}"


def test_allocator_timeline_recorded_without_code_change(run_ok: dict) -> None:
    r = run_ok
    assert r["n_torch"] > 10, f"{r['n_torch']} torch samples in {r['dur']:.1f} s"


def test_profile_peak_allocated_equals_max_memory_allocated(run_ok: dict) -> None:
    r, truth = run_ok, run_ok["truth"]
    assert r["peak_a"] == truth["max_allocated_bytes"], (
        f"{r['peak_a']} vs {truth['max_allocated_bytes']} (incl. a 3 GiB spike freed between samples)"
    )


def test_profile_peak_reserved_equals_max_memory_reserved(run_ok: dict) -> None:
    r, truth = run_ok, run_ok["truth"]
    assert r["peak_r"] == truth["max_reserved_bytes"], f"{r['peak_r']} vs {truth['max_reserved_bytes']}"


def test_allocated_at_the_same_moment_equals_memory_allocated(run_ok: dict) -> None:
    row, truth = run_ok["row"], run_ok["truth"]
    assert row is not None and row[1] == truth["allocated_bytes"], (
        f"{row[1] if row else None} vs {truth['allocated_bytes']} "
        f"(sample {(run_ok['t_truth'] - row[0]) / 1e6 if row else 0:.1f} ms before)"
    )


def test_reserved_at_the_same_moment_equals_memory_reserved(run_ok: dict) -> None:
    row, truth = run_ok["row"], run_ok["truth"]
    assert row is not None and row[2] == truth["reserved_bytes"], (
        f"{row[2] if row else None} vs {truth['reserved_bytes']}"
    )


def test_nvml_process_memory_at_the_same_moment_equals_pynvml(run_ok: dict) -> None:
    g, truth = run_ok["g"], run_ok["truth"]
    if truth["nvml_process_bytes"] is None:
        pytest.skip("pynvml gave no per-process bytes in the training script (as the script skipped it)")
    assert g is not None and g[1] == truth["nvml_process_bytes"], (
        f"{g[1] if g else None} vs {truth['nvml_process_bytes']}"
    )


def test_device_total_equals_nvml_total(run_ok: dict) -> None:
    g, truth = run_ok["g"], run_ok["truth"]
    if truth.get("nvml_total_bytes") is None:
        pytest.skip("pynvml gave no device total in the training script (as the script skipped it)")
    assert g is not None and g[2] == truth["nvml_total_bytes"], (
        f"{g[2] if g else None} vs {truth['nvml_total_bytes']}; torch's total_memory is "
        f"{truth['device_total_bytes']} ({(truth['nvml_total_bytes'] - truth['device_total_bytes']) / MIB:.0f} MiB "
        "less: the driver keeps that part for itself)"
    )


def test_report_json_peak_allocated_reserved_match_torch(run_ok: dict) -> None:
    gpu, truth = run_ok["report_gpu"], run_ok["truth"]
    assert (
        gpu["allocated_bytes"] == truth["max_allocated_bytes"] and gpu["reserved_bytes"] == truth["max_reserved_bytes"]
    ), f"{gpu['allocated_bytes']}/{gpu['reserved_bytes']}"


def test_nvml_sees_more_than_torch_reserves(run_ok: dict) -> None:
    """NVML sees more than torch reserves (CUDA context etc.)."""
    gpu, truth = run_ok["report_gpu"], run_ok["truth"]
    assert (gpu.get("nvml_process_bytes") or 0) > truth["max_reserved_bytes"] - 1, (
        f"NVML peak {gpu.get('nvml_process_bytes')} vs reserved peak {truth['max_reserved_bytes']}"
    )


# --- peak() around a line-profiled function ------------------------------------------------------------------

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


def test_peak_window_around_a_line_profiled_function_sees_the_256_mib_temporary() -> None:
    """The line profiler resets torch's peak counters after a line with a temporary; an open `peak()` window
    around the profiled function must still see the temporary (both go through one reset path)."""
    proc = subprocess.run([sys.executable, "-c", INTERPLAY], capture_output=True, text=True, timeout=300)
    try:
        base, window_peak, process_peak = (int(v) for v in proc.stdout.split()[:3])
    except ValueError:
        pytest.fail(f"peak() window around a line-profiled function: {proc.stderr[-1500:]}")
    want = base + (256 << 20)
    assert window_peak >= want and process_peak >= want, (
        f"window {window_peak}, torchmem.peak() {process_peak}, expected >= {want}"
    )


# --- CUDA_VISIBLE_DEVICES remap ----------------------------------------------------------------------------------

REMAP_CHILD = """
import torch
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")  # 1 GiB on the program's cuda:0
torch.cuda.synchronize()
import time; time.sleep(0.3)
print(torch.cuda.get_device_properties(0).uuid)
"""


@pytest.fixture(scope="module")
def remap(torchmem_cli: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """CUDA_VISIBLE_DEVICES renumbers GPUs for the program: its cuda:0 is the last GPU here (NVML index N-1),
    or, on a one-GPU machine, GPU 0 named by UUID. The profile must key the allocator's rows by NVML index,
    on the same row as that GPU's NVML numbers."""
    import pynvml

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    target = count - 1
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(target))
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    visible = str(target) if count > 1 else uuid
    prof = tmp_path_factory.mktemp("torchmem-remap") / "remap.sqlite"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    proc = subprocess.run(
        [torchmem_cli, "run", "-q", "-o", str(prof), "--", sys.executable, "-c", REMAP_CHILD],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if proc.returncode != 0:
        pytest.fail(f"CUDA_VISIBLE_DEVICES remap: run: {proc.stderr[-1500:]}")
    con = sqlite3.connect(prof)
    torch_devices = sorted(d for (d,) in con.execute("select distinct device from torch_samples"))
    peak = con.execute("select max(peak_allocated_bytes) from torch_samples where device = ?", (target,)).fetchone()[0]
    con.close()
    report = subprocess.run([torchmem_cli, "report", str(prof), "--format", "json"], capture_output=True, text=True)
    gpus = json.loads(report.stdout)["peak"]["gpus"] if report.returncode == 0 else []
    row = next((g for g in gpus if g.get("device") == target), {})
    return {"count": count, "target": target, "visible": visible, "devices": torch_devices, "peak": peak, "row": row}


def test_cuda_visible_devices_allocator_rows_keyed_by_nvml_index(remap: dict) -> None:
    r = remap
    print(f"CUDA_VISIBLE_DEVICES={r['visible']}: NVML index {r['target']} ({r['count']} GPU(s) here)")
    assert r["devices"] == [r["target"]] and (r["peak"] or 0) >= 1 << 30, (
        f"CUDA_VISIBLE_DEVICES={r['visible']} ({r['count']} GPU(s) here): torch_samples devices {r['devices']}, "
        f"peak allocated on {r['target']}: {r['peak']}"
    )


def test_cuda_visible_devices_report_row_holds_allocator_and_nvml_numbers(remap: dict) -> None:
    row = remap["row"]
    assert (row.get("allocated_bytes") or 0) >= 1 << 30 and (row.get("nvml_process_bytes") or 0) >= 1 << 30, (
        f"row {row}"
    )


# --- the recording's overhead on the example, on CUDA ------------------------------------------------------------


def test_run_overhead_bench_on_cuda(record_property) -> None:
    """bench/run_overhead.py --reps 3 on examples/train.py --device cuda: its table printed (a bench, not judged),
    its exit code checked as gpu_check.py did."""
    args = ["--reps", "3", "--", str(ROOT / "examples/train.py"), "--device", "cuda", "--epochs", "3"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "bench/run_overhead.py"), *args],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=ROOT,
        )
        out, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = "timeout"
    print(out)
    record_property("run_overhead", out[-4000:])
    assert code == 0, f"bench/run_overhead.py: exit {code}, {time.perf_counter() - start:.0f} s"
