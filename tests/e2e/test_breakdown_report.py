"""The breakdown through the whole Rust side: a real `torchmem run` of a small CPU training loop under
`torchmem.Monitor(model, optimizer)` (real torch, real recorder, real profile file), then `torchmem report`
in text, JSON and CSV (`--csv-table breakdown`) and `torchmem plot` in headless chromium. The report's
parameter bytes must equal Σ numel·element_size of the model's parameters, and the HTML page's stacked
chart must draw its categories with a legend."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

from browser import CHROMIUM, chromium
from cli import torchmem

TRAIN = """
import torch
import torchmem

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
mon = torchmem.Monitor(model, opt)
for step in range(12):  # measured (the default breakdown_every=10): steps 1, 2, 3 and 10
    with mon.step():
        loss = model(torch.randn(64, 256)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
print("PARAM_BYTES", sum(p.numel() * p.element_size() for p in model.parameters()))
"""


def test_a_real_monitor_run_reports_what_the_memory_is(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    profile = tmp_path / "p.sqlite"
    run = torchmem("run", "-o", str(profile), "--", sys.executable, str(script))
    assert run.returncode == 0, run.stderr + run.stdout
    param_bytes = int(next(line.split()[1] for line in run.stdout.splitlines() if line.startswith("PARAM_BYTES")))

    rep = torchmem("report", "--format", "json", str(profile))
    assert rep.returncode == 0, rep.stderr
    b = json.loads(rep.stdout)["breakdown"]
    assert b["recorded"] and b["hint"] is None
    boundaries = {r["boundary"]: r for r in b["boundaries"] if r["device"] == "cpu"}
    assert {"step start", "end of forward", "end of backward", "end of optimizer step"} <= set(boundaries)
    for r in boundaries.values():
        assert r["count"] == 4
        assert r["categories"]["parameters"] == {"mean_bytes": param_bytes, "max_bytes": param_bytes}
    # Adam's state (exp_avg, exp_avg_sq per parameter, plus step counters) after the first optimizer step.
    assert boundaries["end of optimizer step"]["categories"]["optimizer_state"]["max_bytes"] >= 2 * param_bytes
    assert boundaries["end of backward"]["categories"]["gradients"]["max_bytes"] == param_bytes
    peak = b["peak"]
    assert peak["device"] == "cpu" and peak["basis"] == "rss"
    rows = {r["category"]: r["bytes"] for r in peak["rows"]}
    assert rows["parameters"] == param_bytes
    assert sum(rows.values()) == peak["total_bytes"]

    text = torchmem("report", str(profile))
    assert text.returncode == 0, text.stderr
    assert "What the memory is: at the peak" in text.stdout and "What the memory is: per boundary" in text.stdout

    table = torchmem("report", "--format", "csv", "--csv-table", "breakdown", str(profile))
    assert table.returncode == 0, table.stderr
    csv_rows = list(csv.DictReader(io.StringIO(table.stdout)))
    assert len(csv_rows) == 4 * 4
    assert all(int(r["parameters_bytes"]) == param_bytes for r in csv_rows)
    bad = torchmem("report", "--csv-table", "breakdown", str(profile))
    assert bad.returncode != 0 and "--format csv" in bad.stderr

    html = tmp_path / "p.html"
    plot = torchmem("plot", str(profile), "-o", str(html))
    assert plot.returncode == 0, plot.stderr
    page = html.read_text()
    assert 'class="tm-breakdown"' in page
    if CHROMIUM is not None:
        dom = chromium("--dump-dom", html.as_uri())
        assert dom.returncode == 0, dom.stderr
        for category in ("parameters", "gradients", "optimizer_state"):
            assert f'class="legend-item" data-category="{category}"' in dom.stdout, category
            assert f'class="layer" data-category="{category}"' in dom.stdout, category


def test_a_run_without_a_monitor_says_how_to_get_a_breakdown(tmp_path: Path) -> None:
    script = tmp_path / "plain.py"
    script.write_text("import torchmem\nwith torchmem.track('work'):\n    x = [0] * 100000\n")
    profile = tmp_path / "p.sqlite"
    run = torchmem("run", "-o", str(profile), "--", sys.executable, str(script))
    assert run.returncode == 0, run.stderr
    rep = torchmem("report", "--format", "json", str(profile))
    b = json.loads(rep.stdout)["breakdown"]
    assert not b["recorded"] and "torchmem.Monitor(model, optimizer)" in b["hint"]
    text = torchmem("report", str(profile)).stdout
    assert "torchmem.Monitor(model, optimizer)" in text
