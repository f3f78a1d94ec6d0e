"""A long, fast run stays small: under `torchmem run --keep-spans N` a real 20,000-step Monitor loop keeps the
markers of the first N occurrences of each step and phase (and every epoch marker), folds the rest into
per-epoch aggregate rows, and `torchmem report` still gives exactly the per-phase and per-epoch totals that
every marker gives. The loop's own Monitor keeps every marker (`keep_markers=None`) and writes them out: the
test recomputes the totals from those, the same marker objects the recorder was sent."""

from __future__ import annotations

import functools
import json
import sqlite3
import textwrap
from pathlib import Path

import cli

EPOCHS, STEPS, KEEP = 4, 5000, 5

LOOP = textwrap.dedent(
    """
    import json, sys
    import torch, torchmem
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    mon = torchmem.Monitor(model, opt, verbose=False, keep_markers=None)
    for _ in range(int(sys.argv[2])):
        with mon.epoch():
            for _ in range(int(sys.argv[3])):
                with mon.step():
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    with open(sys.argv[1], "w") as f:
        json.dump(mon.markers, f)
    """
)


torchmem = functools.partial(cli.torchmem, check=True)


def totals_from_all_markers(markers: list[dict]) -> tuple[dict, dict, dict]:
    """Per phase (count, Σ duration, Σ ΔRSS, n), per (epoch, kind, name) (count, Σ duration), per epoch steps."""
    open_spans: dict[tuple[str, str], list[tuple[dict, int | None]]] = {}
    epoch: int | None = None
    phases: dict[str, list[int]] = {}
    per_epoch: dict[tuple[int | None, str, str], list[int]] = {}
    steps: dict[int, int] = {}
    for m in sorted(markers, key=lambda m: m["t_ns"]):
        kind, name, edge = m["kind"], m["name"], m["edge"]
        if kind == "epoch":
            epoch = m["index"] if edge == "start" else None
            continue
        if kind == "mark":
            continue
        if edge == "start":
            open_spans.setdefault((kind, name), []).append((m, epoch))
            if kind == "step":
                steps[epoch] = steps.get(epoch, 0) + 1
            continue
        start, at_epoch = open_spans[(kind, name)].pop()
        duration = m["t_ns"] - start["t_ns"]
        row = per_epoch.setdefault((at_epoch, kind, name), [0, 0])
        row[0] += 1
        row[1] += duration
        if kind == "phase":
            p = phases.setdefault(name, [0, 0, 0, 0])
            p[0] += 1
            p[1] += duration
            a, b = start["memory"].get("rss_bytes"), m["memory"].get("rss_bytes")
            if a is not None and b is not None:
                p[2] += b - a
                p[3] += 1
    return phases, per_epoch, steps


def test_a_long_fast_run_keeps_few_markers_and_exact_totals(tmp_path: Path) -> None:
    loop = tmp_path / "loop.py"
    loop.write_text(LOOP)
    prof, dump = tmp_path / "long.sqlite", tmp_path / "markers.json"
    torchmem("run", "-q", "--keep-spans", str(KEEP), "-o", str(prof), str(loop), str(dump), str(EPOCHS), str(STEPS))
    markers = json.loads(dump.read_text())
    phases, per_epoch, steps = totals_from_all_markers(markers)
    assert sum(steps.values()) == EPOCHS * STEPS

    con = sqlite3.connect(prof)
    in_file = con.execute("select count(*) from markers").fetchone()[0]
    marks = sum(1 for m in markers if m["kind"] == "mark")
    # Every epoch marker and mark, plus both edges of the first KEEP steps and of each of the 3 phases.
    assert in_file == 2 * EPOCHS + marks + 2 * KEEP * 4, in_file
    assert len(markers) > 150 * in_file
    aggregate_rows = con.execute("select count(*) from span_aggregates").fetchone()[0]
    assert aggregate_rows == EPOCHS * 4, aggregate_rows

    r = json.loads(torchmem("report", "--format", "json", str(prof)).stdout)
    assert r["steps"] == EPOCHS * STEPS
    got_phases = {p["name"]: (p["count"], p["total_ns"], p["mean_delta_rss_bytes"]) for p in r["phases"]}

    def mean_toward_zero(total: int, n: int) -> int:
        return abs(total) // n * (1 if total >= 0 else -1)

    want_phases = {name: (p[0], p[1], mean_toward_zero(p[2], p[3])) for name, p in phases.items()}
    assert got_phases == want_phases
    got_epochs = {(t["epoch"], t["kind"], t["name"]): [t["count"], t["total_ns"]] for t in r["epoch_totals"]}
    assert got_epochs == per_epoch
    assert {e["index"]: e["steps"] for e in r["epochs"]} == steps
