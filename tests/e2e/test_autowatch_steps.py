"""`torchmem run`'s automatic watch records the measured steps only (the first 3, then one in 10 within a 1 %
time budget) and leaves the others alone: no marker, no gradient hook, no memory read (issue 28 item 7: +17 %
on a CPU loop of 1.7 ms steps when every step was recorded). Real torch, a real child process on a real pipe
as `torchmem run`'s recorder reads it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torchmem  # noqa: E402
from children import run_with_recorder_pipe  # noqa: E402
from torchmem import _sampled_watch  # noqa: E402

PROGRAM = """
import torchmem._bootstrap as b; b.start()
import torch
from torch import nn
import torchmem._sampled_watch as sw
sw.BUDGET = {budget}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
for i in range(25):
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
print(round(float(sum(p.detach().double().sum() for p in model.parameters())), 9))
"""


def _phase_ends(lines: list[dict]) -> list[str]:
    return [m["name"] for m in lines if m["type"] == "marker" and m["kind"] == "phase" and m["edge"] == "end"]


def _bare_output() -> str:
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(PROGRAM.format(budget=1.0))
    ours = ("import torchmem._bootstrap as b; b.start()", "import torchmem._sampled_watch as sw", "sw.BUDGET = 1.0")
    for line in ours:
        code = code.replace(line + "\n", "")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout


def test_only_the_first_three_and_every_tenth_step_are_recorded():
    proc, lines = run_with_recorder_pipe(PROGRAM.format(budget=1.0))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    # Steps 1, 2, 3, 10 and 20 of 25: their three phases each, in order; nothing from the other 20 steps.
    assert _phase_ends(lines) == ["forward", "backward", "optimizer step"] * 5
    with_bd = [m for m in lines if m["type"] == "marker" and "breakdown" in m]
    assert len(with_bd) == 4 * 5  # step start and the ends of forward, backward and optimizer step
    # The program computes what it computes without torchmem.
    assert proc.stdout == _bare_output()


def test_steps_over_the_time_budget_are_not_measured():
    proc, lines = run_with_recorder_pipe(PROGRAM.format(budget=0.0))
    assert proc.returncode == 0, proc.stderr
    assert _phase_ends(lines) == ["forward", "backward", "optimizer step"] * 3  # the first three only


def test_an_unmeasured_step_gets_no_hook_and_no_marker(monkeypatch):
    monkeypatch.setattr(_sampled_watch, "BUDGET", 1.0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = _sampled_watch.sampled_watch(model, opt, "total")
    try:
        hooked = []
        for _ in range(12):
            before = len(mon.markers) + mon._log.steps_started
            out = model(torch.randn(4, 8))
            hooked.append(bool(out._backward_hooks))
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            assert (len(mon.markers) + mon._log.steps_started > before) == hooked[-1]
        assert hooked == [True] * 3 + [False] * 6 + [True] + [False] * 2
        # The last measured step's breakdown is what `breakdown()` gives (step 10's, with its optimizer state).
        bd = mon.breakdown()
        assert [b["boundary"] for b in bd["boundaries"]] == [
            "step start",
            "end of forward",
            "end of backward",
            "end of optimizer step",
        ]
        assert isinstance(mon, torchmem.Monitor)
    finally:
        mon.close()
