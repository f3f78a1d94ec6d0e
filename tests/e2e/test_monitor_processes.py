"""The Monitor seen from outside its process (moved from tests/unit/test_monitor.py, issue 27 item 5): markers on
the recorder's real pipe, on the same clock as the program."""

from __future__ import annotations

import torch
from children import run_with_recorder_pipe

MIB = 1 << 20
CUDA = torch.cuda.is_available()


def test_monitor_markers_reach_the_recorder_on_the_same_clock():
    proc, lines = run_with_recorder_pipe(
        """
        import time, torch, torchmem
        from torch import nn
        t0 = time.monotonic_ns()
        model = nn.Linear(8, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = torchmem.Monitor(model, opt, verbose=False)
        with mon.epoch():
            with mon.step():
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
        print(t0, time.monotonic_ns())
        """
    )
    assert proc.returncode == 0, proc.stderr
    t0, t1 = map(int, proc.stdout.split())
    markers = [m for m in lines if m["type"] == "marker"]
    seq = [(m["kind"], m["edge"], m["name"]) for m in markers]
    assert seq == [
        ("mark", "point", "Device checked"),
        ("mark", "point", "Model initialised"),
        ("epoch", "start", "epoch"),
        ("step", "start", "step"),
        ("phase", "start", "forward"),
        ("phase", "end", "forward"),
        ("phase", "start", "backward"),
        ("phase", "end", "backward"),
        ("phase", "start", "optimizer step"),
        ("phase", "end", "optimizer step"),
        ("step", "end", "step"),
        ("epoch", "end", "epoch"),
    ], seq
    assert all(t0 <= m["t_ns"] <= t1 for m in markers)
    assert markers[-1]["index"] == 0 and markers[-1]["memory"]["peak_rss_bytes"] > 0
