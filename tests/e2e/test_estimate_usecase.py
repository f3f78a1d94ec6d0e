"""The estimate use case, one implementation for both front ends (issue 27 item 1): `torchmem.estimate()`
builds its report in-process through `_native.estimate_report` (the torchmem-estimator crate that
`torchmem estimate` calls), so on the same trace it equals `torchmem estimate --trace ... --json`, and it
starts no process. Sizes are parsed by one parser: `simulate(memory_limit="14g")` means `--memory-limit 14g`.

Real parts: real torch on the emulated device, real trace files, the real CLI in a subprocess for the
comparison. Runs first in the session (tests/conftest.py): its step has a backward on the emulated device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SNAPS = ROOT / "tests" / "fixtures" / "snapshots"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCHMEM_PYTHON=sys.executable)
    return subprocess.run(
        [sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, env=env, timeout=240
    )


def _mlp_step():
    import torch

    state: dict = {}

    def step():
        if not state:
            model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
            state["model"] = model.to("cuda")
            state["opt"] = torch.optim.Adam(state["model"].parameters())
        x = torch.randn(32, 256, device="cuda")
        state["model"](x).sum().backward()
        state["opt"].step()
        state["opt"].zero_grad()

    return step


def test_estimate_runs_in_process_and_equals_the_cli_on_the_same_trace(tmp_path, monkeypatch):
    import torchmem
    from torchmem.estimator import _runner

    # The tracer's summary, kept for the CLI: a spy around the real function (its result is unchanged).
    seen: list[dict] = []
    real_summary = _runner.summary

    def spy(*args, **kwargs):
        s = real_summary(*args, **kwargs)
        seen.append(s)
        return s

    monkeypatch.setattr(_runner, "summary", spy)

    # No process may start: the estimate is in-process (before, it ran `python -m torchmem` three times).
    def no_process(*args, **kwargs):
        raise AssertionError(f"torchmem.estimate() started a process: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(subprocess, "run", no_process)
    monkeypatch.setattr(os, "fork", no_process)
    monkeypatch.setattr(os, "posix_spawn", no_process)
    trace = tmp_path / "trace.pickle"
    est = torchmem.estimate(
        _mlp_step(), gpu="l4", steps=2, trace_path=trace, device_memory="20g", alloc_conf="expandable_segments:True"
    )
    monkeypatch.undo()

    assert est.gpu == "NVIDIA L4" and est.device_memory_bytes == 20 << 30
    assert est.steps == 2 and est.kind == "training" and est.fits
    assert 0 < est.peak_allocated_bytes <= est.peak_reserved_bytes < est.nvml_bytes
    assert len(seen) == 1
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(seen[0]))
    args = ["estimate", "--trace", str(trace), "--summary", str(summary), "--gpu", "l4"]
    args += ["--device-memory", "20g", "--alloc-conf", "expandable_segments:True"]
    p = _cli(*args, "--json")
    assert p.returncode == 0, p.stderr
    cli = json.loads(p.stdout)
    report = dict(est.report)
    text = report.pop("text")
    assert report == cli
    assert report["alloc_conf"] == "expandable_segments:True" and report["gpu_key"] == "L4"
    t = _cli(*args)
    assert t.returncode == 0, t.stderr
    assert text == t.stdout == str(est)
    assert text.startswith("torchmem estimate: NVIDIA L4 (20.00 GiB usable by CUDA), 2 optimizer step(s)")


def test_the_report_binding_equals_the_cli_and_refuses_what_the_cli_refuses(tmp_path):
    """`_native.estimate_report` on a trace and summary the tracer wrote, against `torchmem estimate --trace`:
    the same dict, the same text, for a GPU with a measured context and one without; the same refusals."""
    import torchmem
    from torchmem import _native

    trace = tmp_path / "trace.pickle"
    seen: list[dict] = []
    from torchmem.estimator import _runner

    real_summary = _runner.summary
    _runner.summary = lambda *a, **k: seen.append(real_summary(*a, **k)) or seen[-1]
    try:
        torchmem.estimate(_mlp_step(), gpu="H200", steps=1, trace_path=trace)
    finally:
        _runner.summary = real_summary
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(seen[0]))
    for gpu in ("H200", "A100-40GB", "rtx 4090"):
        r = _native.estimate_report(str(trace), seen[0], gpu=gpu)
        text = r.pop("text")
        p = _cli("estimate", "--trace", str(trace), "--summary", str(summary), "--gpu", gpu, "--json")
        assert p.returncode == 0, p.stderr
        assert r == json.loads(p.stdout), gpu
        assert text == _cli("estimate", "--trace", str(trace), "--summary", str(summary), "--gpu", gpu).stdout
    assert r["gpu_key"] == "RTX-4090" and r["context_measured"] is False
    with pytest.raises(ValueError, match='unknown GPU "TPUv5"'):
        _native.estimate_report(str(trace), seen[0], gpu="TPUv5")
    with pytest.raises(ValueError, match="alloc conf"):
        _native.estimate_report(str(trace), seen[0], alloc_conf="nonsense:1")
    with pytest.raises(torchmem.SnapshotError):
        _native.estimate_report(str(summary), seen[0])
    from torchmem.estimator import EstimateUnsupported, gpu_catalogue, gpu_spec

    # One catalogue and one alias rule: Python's lookups are the CLI's.
    listed = json.loads(_cli("estimate", "--list-gpus", "--json").stdout)
    assert gpu_catalogue() == listed
    assert gpu_spec("h100").name == "NVIDIA H100 80GB HBM3" and gpu_spec("4090").name == "NVIDIA GeForce RTX 4090"
    with pytest.raises(EstimateUnsupported, match="Known: H200"):
        gpu_spec("TPUv5")


@pytest.mark.parametrize(
    ("text", "expected"),
    [("14g", 14 << 30), ("14GiB", 14 << 30), ("24GB", 24_000_000_000), ("512MiB", 512 << 20), ("8000000000", 8e9)],
)
def test_one_size_parser_for_the_cli_and_python(text, expected):
    import torchmem
    from torchmem import _native
    from torchmem.pytest_plugin import parse_size as marker_size

    assert _native.parse_size(text) == marker_size(text) == int(expected)
    # simulate(memory_limit=TEXT) is `torchmem simulate --memory-limit TEXT`: the same limit in the report.
    snap = SNAPS / "snapshot_mlp_adam_pystacks.pickle"
    r = torchmem.simulate(snap, memory_limit=text)
    p = _cli("simulate", str(snap), "--memory-limit", text, "--json")
    assert p.returncode in (0, 1), p.stderr
    cli = json.loads(p.stdout)
    assert r.raw["devices"] == cli["devices"]
    assert r.raw["devices"][0]["memory_limit_bytes"] == int(expected)


def test_sizes_the_cli_refuses_python_refuses():
    import torchmem
    from torchmem import _native

    snap = SNAPS / "snapshot_mlp_adam_pystacks.pickle"
    for bad in ("12", "lots", "14 gigs"):
        p = _cli("simulate", str(snap), "--memory-limit", bad)
        assert p.returncode != 0
        with pytest.raises(ValueError) as e:
            torchmem.simulate(snap, memory_limit=bad)
        assert str(e.value).startswith("memory_limit: ")
        with pytest.raises(ValueError):
            _native.parse_size(bad)
