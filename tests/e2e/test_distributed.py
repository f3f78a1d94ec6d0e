"""Distributed runs under torchmem: real `torchrun` with the gloo backend (DDP on a small model) under
`torchmem run`, every rank's Monitor phases and peaks merged by `torchmem report`; a rank killed mid-step
leaves the others' data intact and is named as the first to fail; Slurm-style launches (N `torchmem run`
processes with SLURM_* variables, one profile each, into one directory) merged from the directory; each
torchrun rank wrapping itself (`torchrun -m torchmem run -o prof/`: one file per rank, `stats()` knowing its
rank), a real torchrun restart (`--max-restarts 1`: both attempts' files told apart), and one metrics port
per rank on a node. CPU only, real processes, real profiles read back through the CLI."""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import cli

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
MIB = 1 << 20
# A launcher's or a parent test run's identity must not leak into the ranks'.
BASE_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")
}
ENV = dict(BASE_ENV, TORCHMEM_PYTHON=sys.executable, OMP_NUM_THREADS="1")


torchmem = functools.partial(cli.torchmem, check=True, env=ENV)


def report_json(*inputs: Path) -> dict:
    return json.loads(torchmem("report", "--format", "json", *map(str, inputs)).stdout)


# DDP on gloo. Rank r holds r * 32 MiB of ballast (imbalance to find); `die_rank` SIGKILLs itself inside step 3.
TRAIN = """
import json, os, signal, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import torchmem

out, steps, die_rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
init = sys.argv[4] if len(sys.argv) > 4 else "env://"
rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
# A rendezvous per attempt: torchrun's agent store keeps the failed attempt's gloo addresses, and a restarted
# rank that starts later than its peer can read the dead one's (connectFullMesh: Connection refused).
init = init.replace("ATTEMPT", attempt)
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
with open(f"{out}.{rank}", "w") as f:
    f.write(str(os.getpid()))
with open(f"{out}.{rank}.attempt{attempt}", "w") as f:
    f.write(f"{os.getpid()}\\n{torchmem.stats().rank_line()}\\n{json.dumps(torchmem.stats().to_dict())}")
# TM_DIE_ATTEMPT: die only in that attempt (a restarted job's first try fails, its second does not).
if os.environ.get("TM_DIE_ATTEMPT", attempt) != attempt:
    die_rank = -1
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
    assert bad.returncode == 1 and "no torchmem profile (*.sqlite) in this directory" in bad.stderr, bad.stderr
    for name in ("a", "b"):
        torchmem("run", "-q", "-o", str(tmp_path / f"{name}.sqlite"), "--", sys.executable, "-c", "pass")
    # Two runs without a rank are no job to merge: one overview row each.
    listed = torchmem("report", str(tmp_path / "a.sqlite"), str(tmp_path / "b.sqlite"), check=False)
    assert listed.returncode == 0 and "2 profiles (no rank: separate runs)" in listed.stdout, listed
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


def profiles_in(d: Path) -> list[Path]:
    return sorted(d.glob("*.sqlite"))


def test_each_torchrun_rank_wraps_itself_one_file_per_rank(tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2 -m torchmem run -o prof/ -- train.py`: every rank's recorder writes its own
    file into prof/ (host, rank, timestamp, pid in the name), none clobbers another, and `torchmem report prof/`
    lists every rank with its local rank, node and attempt; `torchmem.stats()` in each rank says its rank."""
    script = write_train(tmp_path)
    prof = tmp_path / "prof"
    n, steps = 2, 4
    torchmem_m = ["-m", "torchmem", "run", "-q", "-o", f"{prof}/", "--"]
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={n}", *torchmem_m]
    cmd += [str(script), str(tmp_path / "pid"), str(steps), "-1"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=400)
    assert p.returncode == 0, (p.stdout, p.stderr)
    files = profiles_in(prof)
    host = socket.gethostname()
    assert len(files) == n, files
    for k in range(n):
        mine = [f for f in files if f"-rank{k}-" in f.name]
        assert len(mine) == 1 and mine[0].name.startswith(f"{host}-rank{k}-"), files
        pid_line, who, stats = (tmp_path / f"pid.{k}.attempt0").read_text().splitlines()
        assert who == f"rank {k} of {n} (local rank {k}, node 0, restart 0)", who
        d = json.loads(stats)
        assert (d["rank"], d["local_rank"], d["world_size"], d["restart_count"]) == (k, k, n, 0), d
    pids = pids_of(tmp_path, n)
    r = report_json(prof)
    assert r["profiles"] == [str(f) for f in files]
    got = [(x["rank"], x["local_rank"], x["group_rank"], x["restart_count"], x["pid"]) for x in r["ranks"]]
    assert got == [(k, k, 0, 0, pids[k]) for k in range(n)], r["ranks"]
    assert [Path(x["profile"]).name for x in r["ranks"]] == [
        next(f.name for f in files if f"-rank{k}-" in f.name) for k in range(n)
    ]
    assert all(x["steps"] == steps for x in r["ranks"]), r["ranks"]
    assert r["distributed"]["missing_ranks"] == [] and r["distributed"]["warnings"] == [], r["distributed"]
    assert [a["restart_count"] for a in r["distributed"]["attempts"]] == [0]
    # The recorder's own place is in the profile's metadata too.
    with_meta = json.loads(torchmem("report", "--format", "json", str(files[1])).stdout)
    assert with_meta["ranks"][0]["rank"] == 1 and with_meta["ranks"][0]["restart_count"] == 0
    launch = with_meta["meta"]["launch"]
    # The identity blob's shape: an Origin (no pid: the launch's place, not a process's) and a Launch, flat.
    expected = {"pid": None, "rank": 1, "local_rank": 1, "world_size": n, "group_rank": 0, "restart_count": 0}
    assert launch == expected, launch
    text = torchmem("report", str(prof)).stdout
    header = text.split("Ranks", 1)[1].splitlines()[1]
    assert header.split()[:6] == ["rank", "local", "node", "restart", "host", "pid"], header
    # The same directory again: new files beside the old ones, nothing replaced.
    before = {f: f.stat().st_mtime_ns for f in files}
    p = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=400)
    assert p.returncode == 0, p.stderr
    assert len(profiles_in(prof)) == 2 * n
    assert all(f.stat().st_mtime_ns == t for f, t in before.items()), "the first run's files are untouched"


def test_a_restarted_torchrun_job_says_which_attempt_each_file_is(tmp_path: Path) -> None:
    """A real restart: rank 1 dies inside step 3 of the first attempt, torchrun (`--max-restarts 1`) starts every
    rank again (TORCHELASTIC_RESTART_COUNT=1), and the second attempt finishes. prof/ holds both attempts' files;
    the report lists every rank of each attempt with its restart count, says which files are which attempt,
    names the first attempt's rank 1 as the first to fail and compares only the last attempt's ranks."""
    script = write_train(tmp_path)
    prof = tmp_path / "prof"
    n, steps, victim = 2, 6, 1
    cmd = [str(TORCHRUN), "--standalone", f"--nproc-per-node={n}", "--max-restarts=1", "--monitor-interval=1"]
    cmd += ["-m", "torchmem", "run", "-q", "-o", f"{prof}/", "--"]
    cmd += [str(script), str(tmp_path / "pid"), str(steps), str(victim), f"file://{tmp_path}/rendezvous-ATTEMPT"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(ENV, TM_DIE_ATTEMPT="0"), timeout=500)
    assert p.returncode == 0, ("the second attempt succeeds", p.stdout, p.stderr[-3000:])
    files = profiles_in(prof)
    assert len(files) == 2 * n, files
    restart_files = [f for f in files if "-restart1-" in f.name]
    assert sorted(f.name.split("-")[1] for f in restart_files) == ["rank0", "rank1"], files
    pid_of = {(k, a): int((tmp_path / f"pid.{k}.attempt{a}").read_text().split()[0]) for k in range(n) for a in (0, 1)}
    assert "restart 1" in (tmp_path / "pid.0.attempt1").read_text()
    r = report_json(prof)
    got = [(x["rank"], x["restart_count"], x["pid"]) for x in r["ranks"]]
    assert got == [(k, a, pid_of[(k, a)]) for k in range(n) for a in (0, 1)], r["ranks"]
    by = {(x["rank"], x["restart_count"]): x for x in r["ranks"]}
    assert by[(victim, 0)]["steps"] == 4 and "step 3" in by[(victim, 0)]["stopped_inside"], by[(victim, 0)]
    assert all(by[(k, 1)]["steps"] == steps and by[(k, 1)]["stopped_inside"] == [] for k in range(n)), by
    attempts = r["distributed"]["attempts"]
    assert [(a["restart_count"], a["ranks"]) for a in attempts] == [(0, [0, 1]), (1, [0, 1])], attempts
    assert sorted(Path(f).name for f in attempts[1]["profiles"]) == sorted(f.name for f in restart_files)
    first = r["distributed"]["first_failure"]
    assert (first["rank"], first["restart_count"], first["pid"]) == (victim, 0, pid_of[(victim, 0)]), first
    assert not any("rank 0 is in" in w for w in r["distributed"]["warnings"]), r["distributed"]["warnings"]
    # The last attempt's imbalance: rank 1's 32 MiB ballast against rank 0, not rank 0 against itself.
    imb = {i["what"]: i for i in r["distributed"]["imbalance"]}["phase forward: peak CPU RSS"]
    assert (imb["max_rank"], imb["min_rank"]) == (1, 0) and 24 * MIB < imb["max_minus_min_bytes"] < 40 * MIB, imb
    text = torchmem("report", str(prof)).stdout
    head = text.split("Ranks", 1)[0]
    assert re.search(r"restart 0 +ranks 0, 1: ", head) and re.search(r"restart 1 +ranks 0, 1: ", head), head
    assert all(f.name in head.split("restart 1", 1)[1] for f in restart_files), head
    assert "rank 1 restart 0" in text and "rank 1 restart 1" in text, "step columns name the attempt"
    assert f"first to fail rank {victim} (pid {pid_of[(victim, 0)]}" in head and ", restart 0)" in head, head


# A rank's program for the metrics tests: a Monitor step, then waits for the test's stop file.
WAITER = """
import os, sys, time
import torch, torchmem
mon = torchmem.Monitor(verbose=False)
with mon.epoch():
    with mon.step():
        x = torch.ones(1 << 20)
deadline = time.monotonic() + 240
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


class Recorder:
    """One `torchmem run` of one rank of a node, in the background; its stderr is collected by a thread."""

    def __init__(self, args: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torchmem", "run", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def address(self) -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = next((x for x in self.stderr if "Prometheus metrics at" in x), None)
            if line:
                return line.split("http://", 1)[1].split("/metrics")[0]
            assert self.proc.poll() is None, self.stderr
            time.sleep(0.1)
        raise AssertionError(f"no metrics address: {self.stderr}")


def scrape_until(addr: str, want: str) -> str:
    """The metrics text once it holds `want` (the rank's program reaches its step after importing torch)."""
    deadline = time.monotonic() + 120
    text = ""
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            text = r.read().decode()
        if want in text:
            return text
        time.sleep(0.2)
    raise AssertionError(f"{want!r} never in the metrics of {addr}:\n{text}")


def free_port_pair() -> int:
    """A port P with P and P+1 both free now."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no two adjacent free ports")


def test_two_ranks_of_a_node_each_serve_metrics_on_their_own_port(tmp_path: Path) -> None:
    """`--metrics :PORT --metrics-port-offset local-rank`, one recorder per rank (Slurm-style variables): local rank
    0 serves on PORT, 1 on PORT+1, both scrapeable at once with their rank labels; without the offset a second
    rank whose port is taken serves on a free port (and says so) instead of ending its rank."""
    script = tmp_path / "wait.py"
    script.write_text(WAITER)
    stop = tmp_path / "stop"
    port = free_port_pair()

    def rank_env(k: int) -> dict:
        return dict(ENV, SLURM_PROCID=str(k), SLURM_LOCALID=str(k), SLURM_NTASKS="2", SLURM_NODEID="0")

    def run(k: int, *metrics: str) -> Recorder:
        out = tmp_path / ("prof" + "-".join(metrics).replace(":", "_").replace("-", "_"))
        return Recorder(["-q", "-o", f"{out}/", *metrics, "--", str(script), str(stop)], rank_env(k))

    ranks = [run(k, "--metrics", f"127.0.0.1:{port}", "--metrics-port-offset", "local-rank") for k in (0, 1)]
    try:
        addrs = [r.address() for r in ranks]
        assert addrs == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"], (addrs, ranks[0].stderr, ranks[1].stderr)
        for k, addr in enumerate(addrs):
            text = scrape_until(addr, "torchmem_step{")
            assert f'torchmem_tree_rss_bytes{{rank="{k}",local_rank="{k}"}}' in text, text
            assert f'rank="{k}",local_rank="{k}"' in text.split("torchmem_step{", 1)[1].splitlines()[0], text
        # Without the offset: both ask for PORT; the second is told, and serves elsewhere.
        same = [run(k, "--metrics", f"127.0.0.1:{port}") for k in (0, 1)]
        try:
            for r in same:
                deadline = time.monotonic() + 120
                while not any("Prometheus metrics at" in x or "error" in x for x in r.stderr):
                    assert time.monotonic() < deadline and r.proc.poll() is None, r.stderr
                    time.sleep(0.1)
            moved = [r for r in same if any("serves on a free port instead" in x for x in r.stderr)]
            assert len(moved) == 2, [r.stderr for r in same]  # PORT is still held by the first pair's rank 0
            for k, r in enumerate(same):
                scrape_until(r.address(), f'rank="{k}"')
        finally:
            stop.write_text("")
            for r in same:
                assert r.proc.wait(timeout=180) == 0, r.stderr
    finally:
        stop.write_text("")
        for r in ranks:
            assert r.proc.wait(timeout=180) == 0, r.stderr
