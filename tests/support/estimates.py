"""Helpers of the estimator tests (tests/e2e/test_estimate.py, tests/e2e/test_conv_workspaces.py): the CLI in a
child process, a trace's request sequence, and a workload of scripts/gpu_estimator_truth.py traced in-process on the
emulated H200."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))


def _torchmem(
    *args: str, cwd: Path | None = None, timeout: int = 240, path: str | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable)
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )


def _requests(trace: list[dict], alloc: str, free: str) -> list[tuple[str, int, int]]:
    """(action, size, ordinal of the allocation) in order: identical lists mean identical request sequences."""
    ids: dict[int, int] = {}
    out = []
    n = 0
    for e in trace:
        if e["action"] == alloc:
            ids[e["addr"]] = n
            out.append(("alloc", e["size"], n))
            n += 1
        elif e["action"] == free:
            out.append(("free", e["size"], ids[e["addr"]]))
    return out


def _trace_workload(name: str, steps: int = 3):
    import gpu_estimator_truth as truth
    import torch
    from torchmem.estimator import _snapshot, gpu_spec
    from torchmem.estimator._session import Session

    spec = truth.WORKLOADS[name]
    with Session(gpu_spec("H200")) as s:
        _model, opt, loss_fn, _info = truth.build(spec, torch)
        for _ in range(steps):
            truth.train_step(spec, torch, opt, loss_fn, None)
    return s, _snapshot.build(s.tracer)
