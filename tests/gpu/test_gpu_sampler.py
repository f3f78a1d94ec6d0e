"""The in-process allocator sampler thread (`torchmem run`) on a real NVIDIA GPU (was scripts/gpu_check_sampler.py).

The sampler thread reads torch's allocator every tick (every 1 ms here) once the program uses CUDA. It keeps one
Python thread state for its life; when it attached afresh on each read, a program that started and stopped
tracemalloc was killed by SIGSEGV (CPython gh-128679; on the CPU 6 of 6 runs, `tests/test_run_profile.py`).
Here a CUDA program churns tracemalloc while it allocates and frees CUDA memory, under `torchmem run
--interval 1`, three times (one module-scoped run per parameter). Checks per run: exit code 0, and the profile's
peak allocated / reserved equal the program's own `torch.cuda.max_memory_allocated()` / `max_memory_reserved()`
(the sampler's numbers are torch's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROGRAM = textwrap.dedent(
    """
    import json, sys, time, tracemalloc
    import torch

    end = time.monotonic() + 4.0
    cycles = 0
    keep = []
    while time.monotonic() < end:
        tracemalloc.start()
        junk = [bytearray(64) for _ in range(2000)]
        keep.append(torch.empty(8 << 20, dtype=torch.uint8, device="cuda"))
        if len(keep) > 16:
            keep.clear()
        tracemalloc.stop()
        cycles += 1
    torch.cuda.synchronize()
    json.dump(
        {
            "cycles": cycles,
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
        },
        open(sys.argv[1], "w"),
    )
    """
)


@pytest.fixture(scope="module", params=[0, 1, 2], ids=lambda r: f"run{r}")
def sampler_run(request: pytest.FixtureRequest, torchmem_cli: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One `torchmem run -q --interval 1` of the churning program: its exit, the program's truth, the report."""
    run = request.param
    tmp = tmp_path_factory.mktemp(f"tm-sampler-{run}")
    prog = tmp / "churn.py"
    prog.write_text(PROGRAM)
    prof, facts = tmp / f"p{run}.sqlite", tmp / f"facts{run}.json"
    proc = subprocess.run(
        [torchmem_cli, "run", "-q", "--interval", "1", "-o", str(prof), "--", sys.executable, str(prog), str(facts)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    res: dict = {"run": run, "proc": proc, "truth": None, "gpu": None}
    if proc.returncode == 0:
        res["truth"] = json.loads(Path(facts).read_text())
        rep = subprocess.run([torchmem_cli, "report", "--format", "json", str(prof)], capture_output=True, text=True)
        res["gpu"] = json.loads(rep.stdout)["peak"]["gpus"][0]
    return res


def _ran(res: dict) -> tuple[dict, dict]:
    if res["truth"] is None:
        pytest.fail(f"run {res['run']}: torchmem run exited {res['proc'].returncode}: {res['proc'].stderr[-1500:]}")
    return res["gpu"], res["truth"]


def test_exit_code(sampler_run: dict) -> None:
    proc = sampler_run["proc"]
    assert proc.returncode == 0, f"run {sampler_run['run']}: exit code {proc.returncode} {proc.stderr[-1500:]}"


def test_peak_allocated_equals_torch_max_memory_allocated(sampler_run: dict) -> None:
    gpu, truth = _ran(sampler_run)
    print(f"run {sampler_run['run']}: {truth['cycles']} tracemalloc cycles")
    assert gpu.get("allocated_bytes") == truth["max_allocated"], (
        f"run {sampler_run['run']}: peak allocated == torch.cuda.max_memory_allocated(): "
        f"{gpu.get('allocated_bytes')} vs {truth['max_allocated']} ({truth['cycles']} tracemalloc cycles)"
    )


def test_peak_reserved_equals_torch_max_memory_reserved(sampler_run: dict) -> None:
    gpu, truth = _ran(sampler_run)
    assert gpu.get("reserved_bytes") == truth["max_reserved"], (
        f"run {sampler_run['run']}: peak reserved == torch.cuda.max_memory_reserved(): "
        f"{gpu.get('reserved_bytes')} vs {truth['max_reserved']}"
    )
