"""Identity in the profile: every process of a run reaches the recorder and is told apart. Processes started by
multiprocessing's `spawn` (a fresh interpreter that inherits no descriptor) land in the profile with their own
pid and rank; two forked processes marking the same phase at overlapping times are paired each with itself.
Real child processes, real torch on CPU, real profiles read back through `torchmem report`."""

from __future__ import annotations

import functools
import json
import sqlite3
from pathlib import Path

import cli

ROOT = Path(__file__).resolve().parents[2]


torchmem = functools.partial(cli.torchmem, check=True)


def report(profile: Path) -> dict:
    return json.loads(torchmem("report", "--format", "json", str(profile)).stdout)


SPAWN_WORKERS = """
import os
import sys
import torch
import torch.multiprocessing as mp
import torchmem


def worker(rank, world_size, steps):
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    mon = torchmem.Monitor(model, opt, verbose=False)
    for _ in range(2):
        with mon.epoch():
            for _ in range(steps):
                with mon.step():
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
    with open(sys.argv[1] + f".{rank}", "w") as f:
        f.write(str(os.getpid()))


if __name__ == "__main__":
    mp.spawn(worker, args=(2, 5), nprocs=2, join=True)
"""


def test_spawned_workers_each_with_a_monitor_land_in_the_profile(tmp_path: Path) -> None:
    script = tmp_path / "spawned.py"
    script.write_text(SPAWN_WORKERS)
    prof = tmp_path / "p.sqlite"
    torchmem("run", "-q", "-o", str(prof), str(script), str(tmp_path / "pid"))
    pids = {rank: int((tmp_path / f"pid.{rank}").read_text()) for rank in (0, 1)}
    r = report(prof)
    # 2 workers x 2 epochs x 5 steps, each step one forward, backward and optimizer step.
    assert r["steps"] == 20, r["steps"]
    assert {p["name"]: p["count"] for p in r["phases"]} == {"forward": 20, "backward": 20, "optimizer step": 20}
    epochs = {(e["pid"], e["rank"], e["index"]): e["steps"] for e in r["epochs"]}
    want = {(pids[rank], rank, i): 5 for rank in (0, 1) for i in (0, 1)}
    assert epochs == want, (epochs, want)
    con = sqlite3.connect(prof)
    ranks = dict(con.execute("select pid, max(world_size) from markers where kind = 'step' group by pid").fetchall())
    assert ranks == {pids[0]: 2, pids[1]: 2}, ranks


FORKED_OVERLAP = """
import multiprocessing as mp
import sys
import time
import torchmem


def work(first, hold_s, started, barrier, out):
    barrier.wait()
    if not first:
        started.wait()  # the first one is inside its phase already
    with torchmem.track("forward") as t:
        if first:
            started.set()
        time.sleep(hold_s)
    with open(out, "w") as f:
        f.write(f"{t.result.duration_ns}")


if __name__ == "__main__":
    ctx = mp.get_context("fork")
    started, barrier = ctx.Event(), ctx.Barrier(2)
    # The first process starts "forward" and ends it after 0.3 s; the second starts its own "forward" inside
    # that and ends it 0.6 s later: start 1, start 2, end 1, end 2 (not nested).
    procs = [
        ctx.Process(target=work, args=(i == 0, hold_s, started, barrier, f"{sys.argv[1]}.{i}"))
        for i, hold_s in enumerate((0.3, 0.6))
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    with open(sys.argv[1] + ".pids", "w") as f:
        f.write(" ".join(str(p.pid) for p in procs))
"""


def test_forked_processes_marking_the_same_phase_at_once_are_paired_each_with_itself(tmp_path: Path) -> None:
    script = tmp_path / "forked.py"
    script.write_text(FORKED_OVERLAP)
    prof = tmp_path / "p.sqlite"
    out = tmp_path / "span"
    torchmem("run", "-q", "-o", str(prof), str(script), str(out))
    pids = [int(p) for p in (tmp_path / "span.pids").read_text().split()]
    measured = {pids[i]: int((tmp_path / f"span.{i}").read_text()) for i in (0, 1)}
    r = report(prof)
    rows = {t["pid"]: t for t in r["epoch_totals"] if t["name"] == "forward"}
    assert set(rows) == set(pids), rows
    for pid, duration_ns in measured.items():
        # Each process's span as the process itself measured it (paired by name alone, the first end would
        # close the second process's start).
        assert (rows[pid]["count"], rows[pid]["total_ns"]) == (1, duration_ns), (pid, rows[pid], duration_ns)
    assert measured[pids[1]] > measured[pids[0]] * 3 // 2
