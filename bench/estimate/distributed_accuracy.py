"""Per-rank accuracy of the distributed estimate against the H200 truth (issue 24).

    .venv/bin/python bench/estimate/distributed_accuracy.py [TRUTH] [--only NAME,...] [--jobs 2] [--json OUT]

TRUTH is `tests/fixtures/distributed-h200/distributed-truth.json.gz` by default, recorded on one H200 (torch 2.11)
by `scripts/gpu_distributed_truth.py`: each config ran in a fresh process as rank R of a world of N on torch's fake
process group, and `torch.cuda.memory_stats()` peaks were read after each optimizer step. Those peaks are never
reset, so the last step's peak is also the peak over all the steps; that is what is compared here.

Each config is estimated as a user would, with the venv's CLI, from a temporary folder:

    torchmem estimate --gpu H200 --nnodes NN --nproc-per-node P --rank R --json \\
        -- python scripts/gpu_distributed_truth.py --child NAME

(P = min(N, 8), NN = N / P). Configs that are ranks of one job (the same kind, world and options: the classes of
uneven shards, a pipeline's stages) are one estimate, which traces one rank of each class itself; each config is
compared with its rank's class. The table gives, per config, the world size, the rank and its class (the ranks the
estimate groups with it), the measured and predicted peak allocated and reserved bytes and the error in percent
((predicted - measured) / measured); then the median and the maximum of the absolute errors, over all configs and
over the configs named `--held-out` (those not looked at while fixing the estimator). Exit status 0.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from compile_accuracy import gpu_key  # the truth's device name -> its `--gpu` key (one lookup)

ROOT = Path(__file__).resolve().parents[2]
TRUTH = ROOT / "tests/fixtures/distributed-h200/distributed-truth.json.gz"
SCRIPT = ROOT / "scripts/gpu_distributed_truth.py"
GIB = 1 << 30


def load_truth(path: Path) -> list[dict]:
    """The configs that ran, each with the `--gpu` key of the device it was recorded on (`gpu`)."""
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    gpu = gpu_key(doc.get("device") or "NVIDIA H200")
    return [{**c, "gpu": gpu} for c in doc["configs"] if c.get("steps")]


def launch_args(world: int) -> list[str]:
    per_node = min(world, 8)
    return ["--nnodes", str(world // per_node), "--nproc-per-node", str(per_node)]


def estimate(cfg: dict, steps: int | None = None, gpu: str = "H200", python: str | None = None) -> dict:
    """The CLI's `--json` report for one truth config (rank `cfg['rank']` of `cfg['world_size']`); `python`: the
    interpreter the program runs under (another torch than this venv's; torchmem importable there)."""
    torchmem = Path(sys.executable).with_name("torchmem")
    exe = python or sys.executable
    cmd = [str(torchmem), "estimate", "--gpu", gpu, *launch_args(cfg["world_size"]), "--rank", str(cfg["rank"]),
           "--json", "--", str(exe), str(SCRIPT), "--child", cfg["name"]]  # fmt: skip
    if steps is not None:
        cmd += ["--steps", str(steps)]
    env = dict(os.environ, TORCHMEM_PYTHON=str(exe))
    with tempfile.TemporaryDirectory() as tmp:  # not the repo root: it has a `python/` folder
        p = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=900, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"{cfg['name']}: torchmem estimate exited {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(p.stdout)


def rank_class(report: dict, rank: int) -> list[int]:
    for r in report.get("ranks") or []:
        if rank in r.get("ranks", []):
            return list(r["ranks"])
    return [rank]


def class_peaks(report: dict, rank: int) -> tuple[int, int]:
    """Peak allocated and reserved of the class holding `rank` (the top-level keys are the worst rank's)."""
    for r in report.get("ranks") or []:
        if rank in r.get("ranks", []):
            return int(r["peak_allocated_bytes"]), int(r["peak_reserved_bytes"])
    return int(report["peak_allocated_bytes"]), int(report["peak_reserved_bytes"])


def err(pred: int, meas: int) -> float:
    return 100.0 * (pred - meas) / meas


def describe_class(ranks: list[int]) -> str:
    if len(ranks) <= 3:
        return ",".join(map(str, ranks))
    contiguous = ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    return f"{ranks[0]}-{ranks[-1]}" if contiguous else f"{ranks[0]},{ranks[1]},..,{ranks[-1]} ({len(ranks)})"


def compare(cfg: dict, report: dict) -> dict:
    last = cfg["steps"][-1]
    meas_a = int(last["allocated_bytes.all.peak"])
    meas_r = int(last["reserved_bytes.all.peak"])
    pred_a, pred_r = class_peaks(report, cfg["rank"])
    return {
        "name": cfg["name"], "kind": cfg["kind"], "world_size": cfg["world_size"], "rank": cfg["rank"],
        "class": rank_class(report, cfg["rank"]), "classes": len(report.get("ranks") or [1]),
        "measured_allocated": meas_a, "predicted_allocated": pred_a, "allocated_error_pct": err(pred_a, meas_a),
        "measured_reserved": meas_r, "predicted_reserved": pred_r, "reserved_error_pct": err(pred_r, meas_r),
        "seconds": report.get("_seconds"),
    }  # fmt: skip


def summary(rows: list[dict]) -> dict:
    errs = [abs(r[k]) for r in rows for k in ("allocated_error_pct", "reserved_error_pct")]
    alloc = [abs(r["allocated_error_pct"]) for r in rows]
    res = [abs(r["reserved_error_pct"]) for r in rows]
    if not rows:
        return {}
    return {
        "configs": len(rows),
        "median_abs_error_pct": statistics.median(errs), "max_abs_error_pct": max(errs),
        "allocated_median_pct": statistics.median(alloc), "allocated_max_pct": max(alloc),
        "reserved_median_pct": statistics.median(res), "reserved_max_pct": max(res),
    }  # fmt: skip


def table(rows: list[dict]) -> str:
    head = "| config | world | rank (class) | allocated: measured | predicted | error | reserved: measured | predicted | error |"  # noqa: E501
    out = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(
            f"| {r['name']} | {r['world_size']} | {r['rank']} ({describe_class(r['class'])}) "
            f"| {r['measured_allocated'] / GIB:.3f} GiB | {r['predicted_allocated'] / GIB:.3f} GiB "
            f"| {r['allocated_error_pct']:+.2f} % "
            f"| {r['measured_reserved'] / GIB:.3f} GiB | {r['predicted_reserved'] / GIB:.3f} GiB "
            f"| {r['reserved_error_pct']:+.2f} % |"
        )
    return "\n".join(out)


def fmt_summary(label: str, s: dict) -> str:
    if not s:
        return f"{label}: no configs"
    return (
        f"{label} ({s['configs']} configs): allocated median {s['allocated_median_pct']:.2f} % max "
        f"{s['allocated_max_pct']:.2f} %; reserved median {s['reserved_median_pct']:.2f} % max "
        f"{s['reserved_max_pct']:.2f} %; both median {s['median_abs_error_pct']:.2f} % "
        f"max {s['max_abs_error_pct']:.2f} %"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("truth", nargs="?", default=str(TRUTH))
    ap.add_argument("--only", help="comma-separated config names")
    ap.add_argument("--jobs", type=int, default=2, help="estimates run side by side (default 2)")
    ap.add_argument("--held-out", default="", help="comma-separated names or name prefixes not used while fixing")
    ap.add_argument("--python", help="run the programs under this interpreter (e.g. a venv with the truth's torch "
                    "version and torchmem importable); default: this one")  # fmt: skip
    ap.add_argument("--json", help="write the rows and summaries to this file ('-': stdout, no table)")
    a = ap.parse_args()
    cfgs = load_truth(Path(a.truth))
    if a.only:
        wanted = set(a.only.split(","))
        cfgs = [c for c in cfgs if c["name"] in wanted]

    # Configs of one program and world (the ranks of one job: fsdp2-uneven-w24 and fsdp2-uneven-w24-rank23, a
    # pipeline's stages) are one estimate: it traces one rank of each class and lists every class.
    jobs: dict[str, list[dict]] = {}
    for c in cfgs:
        key = json.dumps([c["kind"], c["world_size"], c.get("options", {})], sort_keys=True)
        jobs.setdefault(key, []).append(c)

    def one(group: list[dict]) -> list[dict]:
        t0 = time.time()
        rep = estimate(group[0], gpu=group[0]["gpu"], python=a.python)
        rep["_seconds"] = round(time.time() - t0, 1)
        return [compare(cfg, rep) for cfg in group]

    with ThreadPoolExecutor(max(1, a.jobs)) as ex:
        by_name = {r["name"]: r for rows_ in ex.map(one, jobs.values()) for r in rows_}
    rows = [by_name[c["name"]] for c in cfgs]
    held = [p for p in a.held_out.split(",") if p]
    held_rows = [r for r in rows if any(r["name"].startswith(p) for p in held)]
    doc = {"truth": str(a.truth), "rows": rows, "summary": summary(rows)}
    if held:
        doc["held_out"] = [r["name"] for r in held_rows]
        doc["summary_held_out"] = summary(held_rows)
        doc["summary_tuned"] = summary([r for r in rows if r not in held_rows])
    if a.json == "-":
        print(json.dumps(doc, indent=2))
        return 0
    print(table(rows))
    print()
    print(fmt_summary("all", doc["summary"]))
    if held:
        print(fmt_summary("held out", doc["summary_held_out"]))
        print(fmt_summary("looked at while fixing", doc["summary_tuned"]))
    if a.json:
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
