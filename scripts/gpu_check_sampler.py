"""GPU check of the in-process allocator sampler thread (`torchmem run`) on a real NVIDIA GPU.

The sampler thread reads torch's allocator every tick (every 1 ms here) once the program uses CUDA. It keeps one
Python thread state for its life; when it attached afresh on each read, a program that started and stopped
tracemalloc was killed by SIGSEGV (CPython gh-128679; on the CPU 6 of 6 runs, `tests/test_run_profile.py`).
Here a CUDA program churns tracemalloc while it allocates and frees CUDA memory, under `torchmem run
--interval 1`, three times. Checks: exit code 0 every time, and the profile's peak allocated / reserved equal
the program's own `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` (the sampler's numbers are
torch's). Prints one PASS/FAIL line per check and exits non-zero when any fails.

    python scripts/gpu_check_sampler.py      # wheel installed, `torchmem` on PATH
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

FAILURES: list[str] = []

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


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def main() -> None:
    tm = shutil.which("torchmem")
    if tm is None:
        raise SystemExit("gpu_check_sampler: `torchmem` is not on PATH; pip install the wheel first")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check_sampler: no CUDA device here; this script needs a GPU")
    tmp = Path(tempfile.mkdtemp(prefix="tm-sampler-"))
    prog = tmp / "churn.py"
    prog.write_text(PROGRAM)
    for run in range(3):
        prof, facts = tmp / f"p{run}.sqlite", tmp / f"facts{run}.json"
        proc = subprocess.run(
            [tm, "run", "-q", "--interval", "1", "-o", str(prof), "--", sys.executable, str(prog), str(facts)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        check(f"run {run}: exit code", proc.returncode == 0, f"{proc.returncode} {proc.stderr[-1500:]}")
        if proc.returncode != 0:
            continue
        truth = json.loads(facts.read_text())
        rep = subprocess.run([tm, "report", "--format", "json", str(prof)], capture_output=True, text=True)
        gpu = json.loads(rep.stdout)["peak"]["gpus"][0]
        check(
            f"run {run}: peak allocated == torch.cuda.max_memory_allocated()",
            gpu.get("allocated_bytes") == truth["max_allocated"],
            f"{gpu.get('allocated_bytes')} vs {truth['max_allocated']} ({truth['cycles']} tracemalloc cycles)",
        )
        check(
            f"run {run}: peak reserved == torch.cuda.max_memory_reserved()",
            gpu.get("reserved_bytes") == truth["max_reserved"],
            f"{gpu.get('reserved_bytes')} vs {truth['max_reserved']}",
        )
    print(f"{len(FAILURES)} FAIL" if FAILURES else "all PASS")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
