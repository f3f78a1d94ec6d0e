"""GPU check of torchmem's distributed report on a real NVIDIA GPU (written for one H200).

Several processes share the GPU, launched the two ways users do:

1. `torchmem run -- torchrun --nproc-per-node 3 worker.py` (gloo process group: NCCL refuses two ranks on one
   GPU). Rank 0 allocates 1 GiB, rank 1 512 MiB, each through a Monitor loop; rank 2 only makes a CUDA
   context on purpose (`torch.cuda.init()` + `mem_get_info()`, no tensor): the stray context of issue 13.
   While they all still hold their memory, each rank reads NVML's per-process bytes for its own pid
   (pynvml), torch's peaks and the GPU's UUID, and writes them to a JSON file.
2. Slurm-style: two `torchmem run` processes with SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS (no RANK), one
   profile each, into one directory, merged by `torchmem report DIR`.

Checks (one PASS/FAIL line each, exit 1 if any fails): every rank recorded with its pid; its GPU (NVML index)
and UUID; its peak allocated/reserved equal torch's own peak counters; the rank × GPU matrix gives each
process the NVML bytes NVML gives its pid; non-torch = NVML − reserved and it is a context's size; the
stray context is marked "context only"; no foreign context is flagged when every rank is on its own GPU;
torchmem itself (the recorder, torchrun's agent) holds no CUDA context; in the Slurm layout each task's
profile attributes only its own process. With 2+ GPUs visible, a real foreign context (CUDA used before
`set_device(1)`) must be flagged on GPU 0 with the set_device cause; on one GPU that check prints SKIP.
3. One recorder per rank (`torchrun -m torchmem run -o prof/`): one profile per rank, `stats()` in each rank
   says its rank and GPU, each rank's `on_oom` files (after a real CUDA OOM) carry its rank and pid, and the
   merged report's first failure is the OOM.

    python scripts/gpu_check_distributed.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path

MIB = 1 << 20
GIB = 1 << 30
FAILURES: list[str] = []
ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
TORCHRUN = str(Path(PY).with_name("torchrun"))
CLEAN_ENV = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
}


def report(ok: bool, name: str, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


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


def check_torchrun(tmp: Path, worker: Path) -> None:
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
    ranks = {x["rank"]: x for x in r["ranks"]}
    dist = r["distributed"]
    print(torchmem("report", str(prof)).stdout.split("torchmem distributed report", 1)[-1])
    report(
        sorted(ranks) == [0, 1, 2] and all(ranks[k]["pid"] == truth[k]["pid"] for k in ranks),
        "ranks_recorded",
        f"ranks {sorted(ranks)}, pids {[x['pid'] for x in ranks.values()]} vs {[t['pid'] for t in truth.values()]}",
    )
    for k in (0, 1):
        x, t = ranks[k], truth[k]
        report(
            x["device"] == 0 and x["gpu_uuid"] is not None and x["gpu_uuid"].endswith(t["uuid"].removeprefix("GPU-")),
            f"rank{k}_gpu_and_uuid",
            f"device {x['device']} ({x['device_source']}), uuid {x['gpu_uuid']} vs torch {t['uuid']}",
        )
        report(
            x["peak_allocated_bytes"] == t["max_allocated"] and x["peak_reserved_bytes"] == t["max_reserved"],
            f"rank{k}_peaks_equal_torch",
            f"allocated {mib(x['peak_allocated_bytes'])} vs {mib(t['max_allocated'])}, "
            f"reserved {mib(x['peak_reserved_bytes'])} vs {mib(t['max_reserved'])}",
        )
        nv = t["nvml_bytes_by_gpu"].get(0)
        report(
            nv is not None and nv <= x["peak_nvml_bytes"] <= nv + 64 * MIB,
            f"rank{k}_nvml_bytes",
            f"report {mib(x['peak_nvml_bytes'])}, NVML for pid {t['pid']} {mib(nv)} (peak ≥ the moment's value)",
        )
        nt = x["non_torch_bytes"]
        report(
            nt == x["peak_nvml_bytes"] - x["peak_reserved_bytes"] and 100 * MIB < nt < 3 * GIB,
            f"rank{k}_non_torch",
            f"non-torch {mib(nt)} = NVML {mib(x['peak_nvml_bytes'])} − reserved {mib(x['peak_reserved_bytes'])}",
        )
    cells = {(c["pid"], c["device"]): c for c in dist["matrix"]}
    stray = cells.get((truth[2]["pid"], 0))
    nv2 = truth[2]["nvml_bytes_by_gpu"].get(0)
    report(
        stray is not None
        and stray["rank"] == 2
        and stray["context_only"]
        and nv2 is not None
        and nv2 <= stray["peak_bytes"] <= nv2 + 64 * MIB,
        "stray_context_attributed",
        f"rank 2's cell {stray}, NVML {mib(nv2)}",
    )
    report(
        all(not cells[(truth[k]["pid"], 0)]["context_only"] for k in (0, 1)),
        "allocating_ranks_not_context_only",
        str([cells.get((truth[k]["pid"], 0)) for k in (0, 1)]),
    )
    report(dist["foreign_contexts"] == [], "no_false_foreign_flag", f"foreign {dist['foreign_contexts']}")
    strangers = [c for c in dist["matrix"] if c["rank"] is None]
    report(strangers == [], "torchmem_makes_no_context", f"non-rank processes on a GPU: {strangers}")
    torchmem("plot", str(prof), "-o", str(tmp / "job.html"))
    page = (tmp / "job.html").read_text()
    charts = page.count('class="rank-chart"')
    report(charts == 3 and "Rank × GPU" in page, "html_rank_charts_and_matrix", f"{charts} rank charts")


def check_slurm(tmp: Path, worker: Path) -> None:
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
    got = [(x["rank"], x["pid"]) for x in r["ranks"]]
    report(
        codes == [0, 0] and got == [(0, truth[0]["pid"]), (1, truth[1]["pid"])],
        "slurm_ranks_merged",
        f"exit {codes}, ranks {got}",
    )
    for task in (0, 1):
        one = json.loads(torchmem("report", "--format", "json", str(job / f"task-{task}.sqlite")).stdout)
        pids = {c["pid"] for c in one["distributed"]["matrix"]}
        report(
            pids == {truth[task]["pid"]},
            f"slurm_task{task}_attributes_only_its_process",
            f"matrix pids {pids}, its own {truth[task]['pid']} (the other task shares the GPU)",
        )


def check_foreign(tmp: Path, worker: Path) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        print(f"SKIP foreign_context_flagged: {torch.cuda.device_count()} GPU visible, a real foreign context needs 2")
        return
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
    report(
        len(f) == 1
        and f[0]["device"] == 0
        and f[0]["own_device"] == 1
        and "set_device" in f[0]["cause"]
        and f[0]["pid"] == truth[1]["pid"],
        "foreign_context_flagged",
        f"{dist['foreign_contexts']}; NVML of rank 1's pid: {truth[1]['nvml_bytes_by_gpu']}",
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


def check_per_rank_files(tmp: Path, worker: Path) -> None:
    """`torchrun -m torchmem run -o prof/`: one profile per rank on the GPU, `stats()` knows its rank and GPU, and
    each rank's `on_oom` files carry its rank (no clobbering), the merged report's first failure an OOM."""
    w = tmp / "oom_worker.py"
    w.write_text(OOM_WORKER)
    prof, oomdir, info = tmp / "prof", tmp / "ooms", tmp / "info."
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "torchmem", "run", "-q", "-o", f"{prof}/", "--"]
    p = subprocess.run([*cmd, str(w), str(oomdir), str(info)], capture_output=True, text=True, env=CLEAN_ENV)
    report(p.returncode == 0, "per_rank_run", f"rc {p.returncode} {p.stderr[-500:]}")
    files = sorted(f.name for f in prof.glob("*.sqlite"))
    report(
        len(files) == 2 and any("-rank0-" in f for f in files) and any("-rank1-" in f for f in files),
        "per_rank_files",
        f"{files}",
    )
    for r in (0, 1):
        got = json.loads(Path(f"{info}{r}").read_text())
        want = f"rank {r} of 2 (local rank {r}, node 0, restart 0)"
        report(got["line"] == want and got["device"] == 0, f"stats_rank_{r}", f"{got}")
        mine = sorted(f.name for f in oomdir.glob(f"oom-rank{r}-{got['pid']}-*-report.json"))
        report(len(mine) == 1, f"on_oom_files_rank_{r}", f"{sorted(f.name for f in oomdir.iterdir())}")
    r = json.loads(torchmem("report", "--format", "json", str(prof)).stdout)
    ranks = [(x["rank"], x["device"], x["restart_count"]) for x in r["ranks"]]
    report(ranks == [(0, 0, 0), (1, 0, 0)], "per_rank_report", f"{ranks}")
    first = r["distributed"]["first_failure"]
    report(first is not None and first["what"] == "CUDA out of memory", "per_rank_first_oom", f"{first}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="torchmem-gpu-dist-") as d:
        tmp = Path(d)
        worker = tmp / "worker.py"
        worker.write_text(WORKER)
        for c in (check_torchrun, check_slurm, check_foreign, check_per_rank_files):
            try:
                c(tmp, worker)
            except Exception as e:  # noqa: BLE001 - one failing check must not stop the others
                report(False, c.__name__, f"raised {type(e).__name__}: {e}")
                traceback.print_exc()
    print(f"\n{len(FAILURES)} failed: {FAILURES}" if FAILURES else "\nall distributed GPU checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
