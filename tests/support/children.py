"""Child Python processes for the tests: `run_python` runs code in a fresh interpreter, `run_with_recorder_pipe`
runs it with TORCHMEM_EVENT_FD on a real pipe (as `torchmem run`'s recorder reads it) and returns the JSON lines
the child sent. Used by tests in every layer (tests/support is on pytest's pythonpath)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap


def run_python(
    code: str, env: dict | None = None, pass_fds: tuple = (), timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        pass_fds=pass_fds,
    )


def run_with_recorder_pipe(code: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Runs `code` in a child with TORCHMEM_EVENT_FD on a real pipe; returns the JSON lines it sent."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            env={**os.environ, "TORCHMEM_EVENT_FD": str(w)},
            pass_fds=(w,),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(w)
        w = -1
        chunks = []
        while True:
            data = os.read(r, 65536)
            if not data:
                break
            chunks.append(data)
        out, err = proc.communicate(timeout=timeout)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
    lines = [json.loads(line) for line in b"".join(chunks).decode().splitlines() if line.strip()]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), lines
