"""`torchmem run --tensorboard DIR`: the event files of a real run (torch on CPU, a Monitor's steps and phases)
read back with TensorBoard's own reader (`EventAccumulator`): memory scalars each second, per-step and
per-phase peaks at the program's step indices, the Monitor's memory breakdown at its boundaries, values that
agree with the profile."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import cli
from cli import ENV
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

PROGRAM = """
import time
import torch
import torchmem

model = torch.nn.Linear(512, 512)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
mon = torchmem.Monitor(model, opt, verbose=False, breakdown_every=2)  # measured: steps 1-3, then 4 and 6
keep = []
with mon.epoch():
    for i in range(6):
        with mon.step():
            loss = model(torch.randn(128, 512)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            keep.append(bytearray(b"\\x01" * (8 << 20)))
        time.sleep(0.3)
"""


torchmem = functools.partial(cli.torchmem, check=True)


def test_tensorboard_reads_the_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PROGRAM))
    logdir = tmp_path / "tb"
    prof = tmp_path / "p.sqlite"
    torchmem("run", "-q", "-o", str(prof), "--tensorboard", str(logdir), str(script))
    files = list(logdir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in [
        "torchmem/rss_bytes",
        "torchmem/pss_bytes",
        "torchmem/step/peak_rss_bytes",
        "torchmem/phase/forward/peak_rss_bytes",
        "torchmem/phase/optimizer_step/peak_rss_bytes",
        "torchmem/epoch/peak_rss_bytes",
    ]:
        assert tag in tags, sorted(tags)
    assert not [t for t in tags if "cuda" in t or "gpu" in t], "torch on CPU, no NVML: no GPU scalars"
    steps = acc.Scalars("torchmem/step/peak_rss_bytes")
    assert [e.step for e in steps] == [0, 1, 2, 3, 4, 5]
    peaks = [e.value for e in steps]
    assert peaks[-1] - peaks[0] >= 5 * (8 << 20) * 0.9, peaks  # each step keeps 8 MiB more
    assert [e.step for e in acc.Scalars("torchmem/phase/forward/peak_rss_bytes")] == [0, 1, 2, 3, 4, 5]
    rss = acc.Scalars("torchmem/rss_bytes")
    assert len(rss) >= 2 and [e.step for e in rss] == sorted(e.step for e in rss)
    assert all(e.step % 1000 == 0 for e in rss), "step = the window's start in ms"
    # The Monitor's breakdown at its boundaries, at the program's measured steps: the Linear's parameters exactly, its
    # gradients at the end of backward, none left after `zero_grad()` (set_to_none) at the next step's start.
    weights = (512 * 512 + 512) * 4
    tag = "torchmem/breakdown/{}/cpu/{}_bytes"
    for boundary, category, want in [
        ("end_of_forward", "parameters", weights),
        ("end_of_backward", "gradients", weights),
        ("step_start", "gradients", 0),
        # The batch is the one tensor the forward saves (for the weight's gradient): an input, not an activation.
        ("end_of_forward", "inputs", 128 * 512 * 4),
        ("end_of_forward", "activations", 0),
    ]:
        got = acc.Scalars(tag.format(boundary, category))
        assert [e.step for e in got] == [0, 1, 2, 3, 5], (boundary, category, got)  # the measured steps' indices
        assert {e.value for e in got} == {want}, (boundary, category, got)
    report = json.loads(torchmem("report", "--format", "json", str(prof)).stdout)
    peak_rss = report["peak"]["cpu_rss_bytes"]
    # The highest window is the profile's peak RSS (float32: 7 digits).
    assert abs(max(e.value for e in rss) - peak_rss) <= peak_rss * 1e-6, (max(e.value for e in rss), peak_rss)


def test_tensorboard_dir_that_is_a_file_is_a_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("print('ran')\n")
    (tmp_path / "f").write_text("")
    out = tmp_path / "p.sqlite"
    proc = subprocess.run(
        [sys.executable, "-m", "torchmem", "run", "-o", str(out), "--tensorboard", str(tmp_path / "f"), str(script)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=60,
    )
    assert proc.returncode == 1 and "it is a file, not a directory" in proc.stderr, proc.stderr
    assert "ran" not in proc.stdout and not out.exists()
