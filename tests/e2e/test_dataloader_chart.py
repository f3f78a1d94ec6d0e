"""DataLoader runs in the chart: a real `torchmem run` of a torch DataLoader with 2 forked workers reading
a 400 MiB array of the parent. RSS summed over the tree counts the shared pages once per process; the chart
must draw PSS next to RSS, say which to trust, and the Processes table must mark the workers. The PSS drawn
is checked against the program's own sum of `Pss:` over /proc/*/smaps_rollup, and the page in chromium."""

from __future__ import annotations

import json
import re
import sys

import pytest
from browser import NEEDS_CHROMIUM, chromium
from cli import torchmem

MIB = 1 << 20

DL = r"""
import os, time
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

big = np.ones(400 * 2**20 // 8)  # 400 MiB, touched: the workers inherit it (shared, copy-on-write)

def tree_pss():
    pids, stack = [os.getpid()], [os.getpid()]
    while stack:
        p = stack.pop()
        for t in os.listdir(f"/proc/{p}/task"):
            try:
                kids = open(f"/proc/{p}/task/{t}/children").read().split()
            except OSError:
                continue
            for k in map(int, kids):
                pids.append(k)
                stack.append(k)
    total = 0
    for p in pids:
        try:
            for line in open(f"/proc/{p}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return len(pids), total

class D(Dataset):
    def __len__(self):
        return 120
    def __getitem__(self, i):
        time.sleep(0.06)
        return torch.tensor([float(big[i * 4096])])

dl = DataLoader(D(), batch_size=2, num_workers=2, multiprocessing_context="fork", persistent_workers=False)
seen = []
for k, x in enumerate(dl):
    if k in (10, 30, 50):
        seen.append(tree_pss())
print("INDEPENDENT", seen, flush=True)
time.sleep(0.3)
"""


def chart_data(html: str) -> dict:
    m = re.search(r'<script type="application/json" id="tm-data">(.*?)</script>', html, re.S)
    assert m, "no chart data block"
    return json.loads(m.group(1))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = tmp_path_factory.mktemp("dl")
    script = d / "dl.py"
    script.write_text(DL)
    prof = d / "dl.sqlite"
    r = torchmem("run", "-o", str(prof), "--", sys.executable, str(script))
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("INDEPENDENT"))
    independent = [tuple(x) for x in eval(line.split(" ", 1)[1])]  # our own list of (count, bytes) tuples
    page = d / "dl.html"
    assert torchmem("plot", str(prof), "-o", str(page)).returncode == 0
    svg = d / "dl.svg"
    assert torchmem("plot", str(prof), "--svg", "-o", str(svg)).returncode == 0
    report = torchmem("report", str(prof)).stdout
    return {"dir": d, "page": page, "svg": svg, "report": report, "independent": independent}


def series(data: dict, label: str) -> dict:
    found = [s for s in data["series"] if s["label"] == label]
    assert found, [s["label"] for s in data["series"]]
    return found[0]


def test_chart_draws_pss_next_to_rss_and_pss_is_right(run: dict) -> None:
    html = run["page"].read_text()
    data = chart_data(html)
    rss = max(v for v in series(data, "CPU RSS")["max"] if v is not None)
    pss = max(v for v in series(data, "CPU PSS")["max"] if v is not None)
    # three processes map the 400 MiB: RSS counts it three times, PSS once
    assert rss > 1100 * MIB, rss / MIB
    assert 400 * MIB < pss < 0.6 * rss, (pss / MIB, rss / MIB)
    # PSS drawn agrees with the program's own smaps_rollup sum while its 2 workers lived (±20 %; the
    # workers live ~4 s, so PSS reads fall after their copy-on-write growth has settled)
    with_workers = [b for n, b in run["independent"] if n >= 3]
    assert with_workers, run["independent"]
    expected = max(with_workers)
    assert abs(pss - expected) <= 0.2 * expected, (pss / MIB, expected / MIB)
    assert "trust PSS" in html
    assert "trust PSS" in run["svg"].read_text() and "CPU PSS" in run["svg"].read_text()


def test_processes_table_marks_the_workers(run: dict) -> None:
    html = run["page"].read_text()
    rows = re.findall(r"<tr><td class=\"num\">(\d+)</td><td class=\"num\">(\d+)</td><td>([^<]*)</td>", html)
    roles = {pid: role for pid, _ppid, role in rows}
    main = [pid for pid, role in roles.items() if role == "main"]
    assert len(main) == 1, rows
    workers = [role for role in roles.values() if role == f"fork of {main[0]} (DataLoader worker?)"]
    assert len(workers) == 2, rows
    assert "DataLoader worker?" in run["report"]


@NEEDS_CHROMIUM
def test_hover_reads_pss_in_a_real_browser(run: dict) -> None:
    data = chart_data(run["page"].read_text())
    pss = series(data, "CPU PSS")
    # a pixel column where PSS was sampled while the workers lived (the highest RSS column with PSS)
    rss = series(data, "CPU RSS")
    cols = [i for i, v in enumerate(pss["max"]) if v is not None and rss["max"][i] is not None]
    i = max(cols, key=lambda k: rss["max"][k])
    t = (i + 0.5) * data["t_end_s"] / data["n"]
    r = chromium("--dump-dom", run["page"].as_uri() + f"#t={t:.4f}")
    assert r.returncode == 0, r.stderr
    m = re.search(r'<div id="tm-readout" data-t="[0-9.]+">(.*?)</div>', r.stdout, re.S)
    assert m, "the read-out was not filled"
    assert re.search(r"CPU PSS: <b>[0-9.]+ (MiB|GiB)", m.group(1)), m.group(1)
    assert re.search(r"CPU RSS: <b>[0-9.]+ (MiB|GiB)", m.group(1)), m.group(1)
