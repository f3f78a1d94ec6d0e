"""Distributed runs under torchmem: real `torchrun` with the gloo backend (DDP on a small model) under
`torchmem run`, every rank's Monitor phases and peaks merged by `torchmem report`; a rank killed mid-step
leaves the others' data intact and is named as the first to fail; Slurm-style launches (N `torchmem run`
processes with SLURM_* variables, one profile each, into one directory) merged from the directory. CPU only,
real processes, real profiles read back through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
MIB = 1 << 20
# A launcher's or a parent test run's identity must not leak into the ranks'.
BASE_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")
}
ENV = dict(BASE_ENV, TORCHMEM_PYTHON=sys.executable, OMP_NUM_THREADS="1")


def torchmem(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, env=env or ENV, timeout=300
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"torchmem {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def report_json(*inputs: Path) -> dict:
    return json.loads(torchmem("report", "--format", "json", *map(str, inputs)).stdout)


# DDP on gloo. Rank r holds r * 32 MiB of ballast (imbalance to find); `die_rank` SIGKILLs itself inside step 3.
TRAIN = """
import os, signal, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import torchmem

out, steps, die_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
init = sys.argv[4] if len(sys.argv) > 4 else "env://"
rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
with open(f"{out}.{rank}", "w") as f:
    f.write(str(os.getpid()))
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ballast = torch.ones(rank * 32 * 2**20 // 4 + 1)
mon = torchmem.Monitor(model, opt, verbose=False)
with mon.epoch():
    for step in range(steps):
        with mon.step():
            if rank == die_rank and step == 3:
                time.sleep(0.3)  # killed mid-step (events are written every 10 ms: the step's start is out)
                os.kill(os.getpid(), signal.SIGKILL)
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
dist.barrier()
dist.destroy_process_group()
"""


def write_train(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    return script


def pids_of(tmp_path: Path, n: int) -> dict[int, int]:
    return {r: int((tmp_path / f"pid.{r}").read_text()) for r in range(n) if (tmp_path / f"pid.{r}").exists()}


def test_torchrun_ddp_every_rank_recorded_and_merged(tmp_path: Path) -> None:
    script = write_train(tmp_path)
    prof = tmp_path / "job.sqlite"
    n, steps = 3, 6
    torchmem(
        "run", "-q", "-o", str(prof), "--",
        str(TORCHRUN), "--standalone", f"--nproc-per-node={n}", str(script), str(tmp_path / "pid"), str(steps), "-1",
    )  # fmt: skip
    pids = pids_of(tmp_path, n)
    assert len(pids) == n, pids
    r = report_json(prof)
    ranks = r["ranks"]
    assert [(x["rank"], x["pid"], x["local_rank"], x["world_size"]) for x in ranks] == [
        (k, pids[k], k, n) for k in range(n)
    ], ranks
    hostname = r["meta"]["hostname"]
    for x in ranks:
        assert x["host"] == hostname and x["steps"] == steps, x
        assert x["stopped_inside"] == [], x
        assert x["device"] is None and x["peak_allocated_bytes"] is None, "CPU run: no GPU values, not zeros"
    # Every rank's phases are its own: forward, backward and optimizer step once per step, per process.
    for pid in pids.values():
        counts = {t["name"]: t["count"] for t in r["epoch_totals"] if t["pid"] == pid and t["kind"] == "phase"}
        assert counts == {"forward": steps, "backward": steps, "optimizer step": steps}, (pid, counts)
    # Each rank's own process's peak RSS (its import-time peak dominates here), not the tree's sum.
    tree_peak = r["peak"]["cpu_rss_bytes"]
    assert all(100 * MIB < x["peak_rss_bytes"] < tree_peak / 2 for x in ranks), (tree_peak, ranks)
    dist = r["distributed"]
    assert dist["world_size"] == n and dist["missing_ranks"] == [] and dist["first_failure"] is None
    # The ballast: rank r holds r * 32 MiB more during training; every phase shows it, and so does each step.
    imb = {i["what"]: i for i in dist["imbalance"]}
    for phase in ("forward", "backward", "optimizer step"):
        i = imb[f"phase {phase}: peak CPU RSS"]
        assert (i["max_rank"], i["min_rank"]) == (n - 1, 0), i
        assert abs(i["max_minus_min_bytes"] - (n - 1) * 32 * MIB) < 8 * MIB, i
    # Steps aligned by number: every rank has steps 0..steps-1 with its own RSS in them.
    assert [s["rank"] for s in dist["steps"]] == list(range(n))
    for s in dist["steps"]:
        assert [p["step"] for p in s["steps"]] == list(range(steps)), s
    last = [s["steps"][-1]["peak_rss_bytes"] for s in dist["steps"]]
    assert all(24 * MIB < last[k + 1] - last[k] < 40 * MIB for k in range(n - 1)), last
    text = torchmem("report", str(prof)).stdout
    assert "torchmem distributed report" in text and "Imbalance" in text and "Steps, aligned by step number" in text
    assert f"WORLD_SIZE {n}" in text, text
    # The node's page: its usual chart and tables, then the ranks, one step-aligned chart each.
    torchmem("plot", str(prof))
    page = prof.with_suffix(".html").read_text()
    assert page.count('class="rank-chart"') == n and '<section id="ranks">' in page
    assert page.index('<section id="ranks">') > page.index("<svg"), "after the node's own timeline"


def test_a_killed_rank_leaves_the_others_intact_and_is_the_first_to_fail(tmp_path: Path) -> None:
    script = write_train(tmp_path)
    prof = tmp_path / "job.sqlite"
    n, steps, victim = 3, 40, 1
    run = torchmem(
        "run", "-q", "-o", str(prof), "--",
        str(TORCHRUN), "--standalone", f"--nproc-per-node={n}", "--monitor-interval=1",
        str(script), str(tmp_path / "pid"), str(steps), str(victim),
        check=False,
    )  # fmt: skip
    assert run.returncode != 0, "torchrun reports the dead worker"
    pids = pids_of(tmp_path, n)
    r = report_json(prof)
    by_rank = {x["rank"]: x for x in r["ranks"]}
    assert sorted(by_rank) == list(range(n)), by_rank
    assert by_rank[victim]["pid"] == pids[victim]
    # The victim started step 3 and never ended it; the others' steps up to their end are all there.
    assert by_rank[victim]["steps"] == 4, by_rank[victim]
    assert "step 3" in by_rank[victim]["stopped_inside"], by_rank[victim]
    for k in set(range(n)) - {victim}:
        assert by_rank[k]["steps"] >= 4, by_rank[k]
        assert by_rank[k]["peak_rss_bytes"] > 50 * MIB, by_rank[k]
    first = r["distributed"]["first_failure"]
    assert first is not None and first["rank"] == victim and first["pid"] == pids[victim], first
    assert "stopped inside step 3" in first["what"], first


def test_slurm_style_tasks_into_one_directory_are_merged(tmp_path: Path) -> None:
    """What `srun -n 2 torchmem run -o job/task-%t.sqlite -- python train.py` does: one recorder per task,
    identity from SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS only (no RANK), one directory."""
    script = write_train(tmp_path)
    job = tmp_path / "job"
    job.mkdir()
    n, steps = 2, 5
    rdv = f"file://{tmp_path}/rendezvous"
    procs = []
    for task in range(n):
        env = dict(ENV, SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NTASKS=str(n), SLURM_JOB_ID="77")
        cmd = [sys.executable, "-m", "torchmem", "run", "-q", "-o", str(job / f"task-{task}.sqlite"), "--"]
        cmd += [sys.executable, str(script), str(tmp_path / "pid"), str(steps), "-1", rdv]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (out, err)
    pids = pids_of(tmp_path, n)
    r = report_json(job)
    assert r["profiles"] == [str(job / "task-0.sqlite"), str(job / "task-1.sqlite")]
    assert [(x["rank"], x["local_rank"], x["world_size"], x["pid"]) for x in r["ranks"]] == [
        (0, 0, 2, pids[0]),
        (1, 1, 2, pids[1]),
    ], r["ranks"]
    assert [x["profile"] for x in r["ranks"]] == r["profiles"]
    assert all(x["steps"] == steps for x in r["ranks"])
    imb = {i["what"]: i for i in r["distributed"]["imbalance"]}["phase forward: peak CPU RSS"]
    assert imb["max_rank"] == 1 and 24 * MIB < imb["max_minus_min_bytes"] < 40 * MIB, imb
    # The same through the file list, and the merged page with one chart per rank.
    assert report_json(job / "task-1.sqlite", job / "task-0.sqlite")["ranks"] == r["ranks"]
    torchmem("plot", str(job))
    page = (tmp_path / "job.html").read_text()
    assert page.count('class="rank-chart"') == n and "Imbalance" in page
    # One task's own profile alone: its report still carries its rank.
    one = report_json(job / "task-1.sqlite")
    assert [x["rank"] for x in one["ranks"]] == [1] and one["distributed"]["missing_ranks"] == [0]
    assert "no profile holds rank(s) 0" in one["distributed"]["warnings"][0]


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = torchmem("report", str(empty), check=False)
    assert bad.returncode == 1 and "no profile (*.sqlite) in this directory" in bad.stderr, bad.stderr
    for name in ("a", "b"):
        torchmem("run", "-q", "-o", str(tmp_path / f"{name}.sqlite"), "--", sys.executable, "-c", "pass")
    merged = torchmem("report", str(tmp_path / "a.sqlite"), str(tmp_path / "b.sqlite"), check=False)
    assert merged.returncode == 1 and "hold no rank" in merged.stderr, merged.stderr
    csv = torchmem("report", "--format", "csv", str(tmp_path / "a.sqlite"), str(tmp_path / "b.sqlite"), check=False)
    assert csv.returncode == 1 and "--format csv shows one profile" in csv.stderr, csv.stderr


def test_the_monitor_knows_its_rank_from_torchrun_or_slurm_variables() -> None:
    code = (
        "import torch, torchmem\n"
        "mon = torchmem.Monitor(verbose=True, warn=False)\n"
        "with mon.epoch():\n"
        "    with mon.step():\n"
        "        torch.ones(10)\n"
        "d = mon.to_dict()\n"
        "print(d['rank'], d['local_rank'], d['world_size'])\n"
    )
    for extra, want in (
        ({"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4"}, "3 1 4"),
        ({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "8", "SLURM_PROCID": "5"}, "2 0 8"),
        ({}, "None None None"),
    ):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(ENV, **extra))
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == want, (extra, p.stdout)
        rank = want.split()[0]
        prefix = "torchmem: epoch " if rank == "None" else f"torchmem rank {rank}: epoch "
        assert prefix in p.stderr, p.stderr
