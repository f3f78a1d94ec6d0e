"""torchmem's distributed report on a real NVIDIA GPU (formerly scripts/gpu_check_distributed.py; written for one
H200; needs `pynvml`).

Several processes share the GPU, launched the ways users do:

1. `torchmem run -- torchrun --nproc-per-node 3 worker.py` (gloo process group: NCCL refuses two ranks on one
   GPU). Rank 0 allocates 1 GiB, rank 1 512 MiB, each through a Monitor loop; rank 2 only makes a CUDA
   context on purpose (`torch.cuda.init()` + `mem_get_info()`, no tensor): the stray context of issue 13.
   While they all still hold their memory, each rank reads NVML's per-process bytes for its own pid
   (pynvml), torch's peaks and the GPU's UUID, and writes them to a JSON file.
2. Slurm-style: two `torchmem run` processes with SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS (no RANK), one
   profile each, into one directory, merged by `torchmem report DIR`.
3. One recorder per rank (`torchrun -m torchmem run -o prof/`): one profile per rank, `stats()` in each rank
   says its rank and GPU, each rank's `on_oom` files (after a real CUDA OOM) carry its rank and pid, and the
   merged report's first failure is the OOM.

Checked: every rank recorded with its pid; its GPU (NVML index) and UUID; its peak allocated/reserved equal
torch's own peak counters; the rank × GPU matrix gives each process the NVML bytes NVML gives its pid;
non-torch = NVML − reserved and it is a context's size; the stray context is marked "context only"; no foreign
context is flagged when every rank is on its own GPU; torchmem itself (the recorder, torchrun's agent) holds no
CUDA context; in the Slurm layout each task's profile attributes only its own process. With 2+ GPUs visible, a
real foreign context (CUDA used before `set_device(1)`) must be flagged on GPU 0 with the set_device cause; on
one GPU that test skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

MIB = 1 << 20
GIB = 1 << 30
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))
CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
}


def mib(b) -> str:
    return "None" if b is None else f"{b / MIB:.1f} MiB ({b} B)"


WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    import pynvml
    import torch
    import torch.distributed as dist
    import torchmem

    out = sys.argv[1]
    mode = sys.argv[2]  # "share": all on cuda:0; "foreign": rank 1 touches cuda:0 before set_device(1)
    init = sys.argv[3] if len(sys.argv) > 3 else "env://"
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    sizes = {0: 1 << 30, 1: 512 << 20}
    if mode == "foreign" and rank == 1:
        torch.cuda.mem_get_info()  # the bug: CUDA used before set_device -> a context on GPU 0
        torch.cuda.set_device(1)
    else:
        torch.cuda.set_device(0 if mode == "share" else rank)
    dev = torch.cuda.current_device()
    if rank in sizes:
        model = torch.nn.Linear(256, 256).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mon = torchmem.Monitor(model, opt, verbose=False)
        hold = torch.empty(sizes[rank], dtype=torch.uint8, device="cuda")
        for _ in range(5):
            with mon.step():
                model(torch.randn(64, 256, device="cuda")).sum().backward()
                opt.step()
                opt.zero_grad()
    else:
        torch.cuda.init()
        torch.cuda.mem_get_info()  # a context, no tensor: the stray context
    torch.cuda.synchronize()
    dist.barrier()
    time.sleep(1.5)  # every rank holds its memory: NVML sampled by the recorder, and read here
    pynvml.nvmlInit()
    nv = {}
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid():
                nv[i] = p.usedGpuMemory
    uuid = str(torch.cuda.get_device_properties(dev).uuid)
    json.dump({
        "pid": os.getpid(),
        "nvml_bytes_by_gpu": nv,
        "uuid": uuid,
        "max_allocated": torch.cuda.max_memory_allocated(dev),
        "max_reserved": torch.cuda.max_memory_reserved(dev),
    }, open(f"{out}.{rank}.json", "w"))
    dist.barrier()
    dist.destroy_process_group()
    """
)


OOM_WORKER = textwrap.dedent(
    """
    import json, os, sys
    import torch, torchmem
    torch.cuda.set_device(0)  # one GPU: every rank shares it
    torch.ones(1 << 20, device="cuda")
    handler = torchmem.on_oom(sys.argv[1])
    s = torchmem.stats()
    mine = {"pid": os.getpid(), "line": s.rank_line(), "device": s.device}
    json.dump(mine, open(sys.argv[2] + os.environ["RANK"], "w"))
    try:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB: a real CUDA OOM
    except torch.OutOfMemoryError:
        pass
    """
)


def torchmem(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([PY, "-m", "torchmem", *args], capture_output=True, text=True, env=env or CLEAN_ENV)
    if check and p.returncode != 0:
        raise RuntimeError(f"torchmem {' '.join(args)} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def load_truth(out: Path, n: int) -> dict[int, dict]:
    truth = {}
    for r in range(n):
        t = json.loads(Path(f"{out}.{r}.json").read_text())
        t["nvml_bytes_by_gpu"] = {int(k): v for k, v in t["nvml_bytes_by_gpu"].items()}
        truth[r] = t
    return truth


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tmp_path_factory.mktemp("torchmem-gpu-dist") / "worker.py"
    w.write_text(WORKER)
    return w


# --- 1. torchrun, 3 ranks sharing the GPU ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun_job(worker: Path) -> dict:
    tmp = worker.parent
    prof = tmp / "job.sqlite"
    out = tmp / "truth"
    torchmem(
        "run",
        "-q",
        "-o",
        str(prof),
        "--",
        TORCHRUN,
        "--standalone",
        "--nproc-per-node=3",
        str(worker),
        str(out),
        "share",
    )
    truth = load_truth(out, 3)
    r = json.loads(torchmem("report", "--format", "json", str(prof)).stdout)
    print(torchmem("report", str(prof)).stdout.split("torchmem distributed report", 1)[-1])
    plot = torchmem("plot", str(prof), "-o", str(tmp / "job.html"), check=False)
    ranks = {x["rank"]: x for x in r["ranks"]}
    dist = r["distributed"]
    return {
        "truth": truth,
        "ranks": ranks,
        "dist": dist,
        "cells": {(c["pid"], c["device"]): c for c in dist["matrix"]},
        "page": (tmp / "job.html").read_text() if plot.returncode == 0 else "",
        "plot": plot,
    }


def test_ranks_recorded(torchrun_job: dict) -> None:
    ranks, truth = torchrun_job["ranks"], torchrun_job["truth"]
    assert sorted(ranks) == [0, 1, 2] and all(ranks[k]["pid"] == truth[k]["pid"] for k in ranks), (
        f"ranks {sorted(ranks)}, pids {[x['pid'] for x in ranks.values()]} vs {[t['pid'] for t in truth.values()]}"
    )


@pytest.mark.parametrize("k", [0, 1])
def test_rank_gpu_and_uuid(torchrun_job: dict, k: int) -> None:
    x, t = torchrun_job["ranks"][k], torchrun_job["truth"][k]
    assert x["device"] == 0 and x["gpu_uuid"] is not None and x["gpu_uuid"].endswith(t["uuid"].removeprefix("GPU-")), (
        f"rank{k}: device {x['device']} ({x['device_source']}), uuid {x['gpu_uuid']} vs torch {t['uuid']}"
    )


@pytest.mark.parametrize("k", [0, 1])
def test_rank_peaks_equal_torch(torchrun_job: dict, k: int) -> None:
    x, t = torchrun_job["ranks"][k], torchrun_job["truth"][k]
    assert x["peak_allocated_bytes"] == t["max_allocated"] and x["peak_reserved_bytes"] == t["max_reserved"], (
        f"rank{k}: allocated {mib(x['peak_allocated_bytes'])} vs {mib(t['max_allocated'])}, "
        f"reserved {mib(x['peak_reserved_bytes'])} vs {mib(t['max_reserved'])}"
    )


@pytest.mark.parametrize("k", [0, 1])
def test_rank_nvml_bytes(torchrun_job: dict, k: int) -> None:
    x, t = torchrun_job["ranks"][k], torchrun_job["truth"][k]
    nv = t["nvml_bytes_by_gpu"].get(0)
    assert nv is not None and nv <= x["peak_nvml_bytes"] <= nv + 64 * MIB, (
        f"rank{k}: report {mib(x['peak_nvml_bytes'])}, NVML for pid {t['pid']} {mib(nv)} (peak ≥ the moment's value)"
    )


@pytest.mark.parametrize("k", [0, 1])
def test_rank_non_torch(torchrun_job: dict, k: int) -> None:
    x = torchrun_job["ranks"][k]
    nt = x["non_torch_bytes"]
    assert nt == x["peak_nvml_bytes"] - x["peak_reserved_bytes"] and 100 * MIB < nt < 3 * GIB, (
        f"rank{k}: non-torch {mib(nt)} = NVML {mib(x['peak_nvml_bytes'])} − reserved {mib(x['peak_reserved_bytes'])}"
    )


def test_stray_context_attributed(torchrun_job: dict) -> None:
    truth, cells = torchrun_job["truth"], torchrun_job["cells"]
    stray = cells.get((truth[2]["pid"], 0))
    nv2 = truth[2]["nvml_bytes_by_gpu"].get(0)
    assert (
        stray is not None
        and stray["rank"] == 2
        and stray["context_only"]
        and nv2 is not None
        and nv2 <= stray["peak_bytes"] <= nv2 + 64 * MIB
    ), f"rank 2's cell {stray}, NVML {mib(nv2)}"


def test_allocating_ranks_not_context_only(torchrun_job: dict) -> None:
    truth, cells = torchrun_job["truth"], torchrun_job["cells"]
    assert all(not cells[(truth[k]["pid"], 0)]["context_only"] for k in (0, 1)), str(
        [cells.get((truth[k]["pid"], 0)) for k in (0, 1)]
    )


def test_no_false_foreign_flag(torchrun_job: dict) -> None:
    dist = torchrun_job["dist"]
    assert dist["foreign_contexts"] == [], f"foreign {dist['foreign_contexts']}"


def test_torchmem_makes_no_context(torchrun_job: dict) -> None:
    strangers = [c for c in torchrun_job["dist"]["matrix"] if c["rank"] is None]
    assert strangers == [], f"non-rank processes on a GPU: {strangers}"


def test_html_rank_charts_and_matrix(torchrun_job: dict) -> None:
    plot = torchrun_job["plot"]
    assert plot.returncode == 0, f"torchmem plot -> {plot.returncode}\n{plot.stdout}\n{plot.stderr}"
    page = torchrun_job["page"]
    charts = page.count('class="rank-chart"')
    assert charts == 3 and "Rank × GPU" in page, f"{charts} rank charts"


# --- 2. Slurm-style tasks -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm_job(worker: Path) -> dict:
    tmp = worker.parent
    job = tmp / "slurm"
    job.mkdir()
    out = tmp / "slurm-truth"
    procs = []
    for task in (0, 1):
        env = dict(CLEAN_ENV, SLURM_PROCID=str(task), SLURM_LOCALID=str(task), SLURM_NTASKS="2")
        cmd = [PY, "-m", "torchmem", "run", "-q", "-o", str(job / f"task-{task}.sqlite"), "--"]
        cmd += [PY, str(worker), str(out), "share", f"file://{tmp}/rdv"]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait(timeout=600) for p in procs]
    truth = load_truth(out, 2)
    r = json.loads(torchmem("report", "--format", "json", str(job)).stdout)
    one = {t: json.loads(torchmem("report", "--format", "json", str(job / f"task-{t}.sqlite")).stdout) for t in (0, 1)}
    return {"codes": codes, "truth": truth, "merged": r, "one": one}


def test_slurm_ranks_merged(slurm_job: dict) -> None:
    truth = slurm_job["truth"]
    got = [(x["rank"], x["pid"]) for x in slurm_job["merged"]["ranks"]]
    assert slurm_job["codes"] == [0, 0] and got == [(0, truth[0]["pid"]), (1, truth[1]["pid"])], (
        f"exit {slurm_job['codes']}, ranks {got}"
    )


@pytest.mark.parametrize("task", [0, 1])
def test_slurm_task_attributes_only_its_process(slurm_job: dict, task: int) -> None:
    pids = {c["pid"] for c in slurm_job["one"][task]["distributed"]["matrix"]}
    own = slurm_job["truth"][task]["pid"]
    assert pids == {own}, f"task {task}: matrix pids {pids}, its own {own} (the other task shares the GPU)"


# --- a real foreign context (2+ GPUs) ------------------------------------------------------------------------------


def test_foreign_context_flagged(worker: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"foreign_context_flagged: {torch.cuda.device_count()} GPU visible, a real foreign context needs 2")
    tmp = worker.parent
    prof = tmp / "foreign.sqlite"
    out = tmp / "foreign-truth"
    torchmem(
        "run",
        "-q",
        "-o",
        str(prof),
        "--",
        TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        str(worker),
        str(out),
        "foreign",
    )
    truth = load_truth(out, 2)
    dist = json.loads(torchmem("report", "--format", "json", str(prof)).stdout)["distributed"]
    f = [x for x in dist["foreign_contexts"] if x["rank"] == 1]
    assert (
        len(f) == 1
        and f[0]["device"] == 0
        and f[0]["own_device"] == 1
        and "set_device" in f[0]["cause"]
        and f[0]["pid"] == truth[1]["pid"]
    ), f"{dist['foreign_contexts']}; NVML of rank 1's pid: {truth[1]['nvml_bytes_by_gpu']}"


# --- 3. one recorder per rank, a real OOM in each ------------------------------------------------------------------


@pytest.fixture(scope="module")
def per_rank(worker: Path) -> dict:
    """`torchrun -m torchmem run -o prof/`: one profile per rank on the GPU, `stats()` knows its rank and GPU, and
    each rank's `on_oom` files carry its rank (no clobbering), the merged report's first failure an OOM."""
    tmp = worker.parent
    w = tmp / "oom_worker.py"
    w.write_text(OOM_WORKER)
    prof, oomdir, info = tmp / "prof", tmp / "ooms", tmp / "info."
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "torchmem", "run", "-q", "-o", f"{prof}/", "--"]
    p = subprocess.run([*cmd, str(w), str(oomdir), str(info)], capture_output=True, text=True, env=CLEAN_ENV)
    return {"proc": p, "prof": prof, "oomdir": oomdir, "info": info}


def test_per_rank_run(per_rank: dict) -> None:
    p = per_rank["proc"]
    assert p.returncode == 0, f"rc {p.returncode} {p.stderr[-500:]}"


def test_per_rank_files(per_rank: dict) -> None:
    files = sorted(f.name for f in per_rank["prof"].glob("*.sqlite"))
    assert len(files) == 2 and any("-rank0-" in f for f in files) and any("-rank1-" in f for f in files), f"{files}"


@pytest.mark.parametrize("r", [0, 1])
def test_stats_knows_rank_and_gpu(per_rank: dict, r: int) -> None:
    got = json.loads(Path(f"{per_rank['info']}{r}").read_text())
    want = f"rank {r} of 2 (local rank {r}, node 0, restart 0)"
    assert got["line"] == want and got["device"] == 0, f"stats_rank_{r}: {got}"


@pytest.mark.parametrize("r", [0, 1])
def test_on_oom_files_carry_the_rank(per_rank: dict, r: int) -> None:
    got = json.loads(Path(f"{per_rank['info']}{r}").read_text())
    oomdir = per_rank["oomdir"]
    mine = sorted(f.name for f in oomdir.glob(f"oom-rank{r}-{got['pid']}-*-report.json"))
    assert len(mine) == 1, f"on_oom_files_rank_{r}: {sorted(f.name for f in oomdir.iterdir())}"


@pytest.fixture(scope="module")
def per_rank_report(per_rank: dict) -> dict:
    return json.loads(torchmem("report", "--format", "json", str(per_rank["prof"])).stdout)


def test_per_rank_report(per_rank_report: dict) -> None:
    ranks = [(x["rank"], x["device"], x["restart_count"]) for x in per_rank_report["ranks"]]
    assert ranks == [(0, 0, 0), (1, 0, 0)], f"{ranks}"


def test_per_rank_first_failure_is_the_oom(per_rank_report: dict) -> None:
    first = per_rank_report["distributed"]["first_failure"]
    assert first is not None and first["what"] == "CUDA out of memory", f"{first}"
