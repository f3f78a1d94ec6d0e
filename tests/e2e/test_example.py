"""Runs the bundled example (examples/train.py) as a real child process: it trains on the CPU, prints a line
per epoch, empties the cache, and warns about growth only with `--leak`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def run_example(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "default", str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "TORCHMEM_EVENT_FD"},
    )


@pytest.mark.parametrize("leak", [False, True])
def test_example_runs_on_cpu_and_warns_only_when_leaking(leak):
    args = ["--device", "cpu", "--epochs", "4", "--steps", "16", "--batch", "256"] + (["--leak"] if leak else [])
    proc = run_example(*args)
    assert proc.returncode == 0, proc.stderr
    out, err = proc.stdout, proc.stderr
    assert err.count("torchmem: epoch ") == 4, err
    assert out.count("empty_cache: CPU RSS") == 4, out
    assert "training on cpu" in out and "host RAM: total" in out
    for stage in (
        "Device checked",
        "Model initialised",
        "forward",
        "backward",
        "optimizer step",
        "Peak",
        "Cache emptied",
    ):
        assert stage in out, stage
    assert "Phases" in out or "phase" in out
    if leak:
        # the leak detector names the line that keeps each step's graph alive
        assert "MemoryGrowthWarning" in err and "total_loss += loss_fn(model(x), y)" in err, err
        assert "keeps each step's autograd graph alive" in err, err
    else:
        assert "MemoryGrowthWarning" not in err, err


def test_example_mermaid_journey():
    proc = run_example("--device", "cpu", "--epochs", "1", "--steps", "2", "--mermaid")
    assert proc.returncode == 0, proc.stderr
    assert "\njourney\n    title " in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA runs the example on the GPU")
def test_example_asked_for_cuda_without_one_says_so():
    proc = run_example("--device", "cuda", "--epochs", "1", "--steps", "1")
    assert proc.returncode != 0
    assert "no CUDA device" in proc.stderr
