"""Running the `torchmem` command from a test: `python -m torchmem …` with this interpreter, the environment that
points torchmem's children at it (`ENV`), output captured as text."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ENV = dict(os.environ, TORCHMEM_PYTHON=sys.executable)


def torchmem(
    *args: str, check: bool = False, env: dict | None = None, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`torchmem ARGS…`; with `check`, an AssertionError with its output unless it exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, env=env or ENV, cwd=cwd,
        timeout=timeout,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"torchmem {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc
