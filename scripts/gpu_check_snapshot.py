"""GPU checks for allocator snapshots (issue 4): run standalone on a CUDA machine with torchmem installed.

    python scripts/gpu_check_snapshot.py [--keep DIR]

1. `torchmem.capture` around a real training step writes a snapshot; `torchmem snapshot --json` on it gives
   reserved/allocated bytes equal to torch.cuda.memory_reserved()/memory_allocated() at the dump, and `--top`
   names this script as the top allocation site.
2. `torchmem.on_oom` in a child process that runs out of memory on purpose: the snapshot and the report are
   written, and the report's numbers match the allocator at the failure (memory_stats() right after the
   error, and the numbers in PyTorch's own OOM message, within its 2-decimal rounding).
3. The torch 2.11 hazard: GPT-2 (transformers, built from a config, no download) with gradient checkpointing
   trains under `torchmem.capture` and under `torchmem.on_oom` without crashing. The raw hazard (plain
   `_record_memory_history(stacks="python")`) is measured and printed for information.

Prints one PASS/FAIL line per check with measured vs expected numbers; exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import traceback
from pathlib import Path

RESULTS: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def check(fn):  # noqa: ANN001, ANN201 - decorator that never lets one check crash the script
    def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
        try:
            fn(*a, **k)
        except Exception:
            record(fn.__name__, False, "raised:\n" + textwrap.indent(traceback.format_exc(), "    "))

    return run


def torchmem_cmd() -> list[str]:
    exe = shutil.which("torchmem")
    return [exe] if exe else [sys.executable, "-m", "torchmem"]


def cli_json(*args: str) -> dict:
    r = subprocess.run([*torchmem_cmd(), *args, "--json"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"torchmem {' '.join(args)} failed: {r.stderr}")
    return json.loads(r.stdout)


@check
def capture_training_step(work: Path) -> None:
    import torch
    import torchmem

    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1000)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    path = work / "step.pickle"
    with torchmem.capture(path, max_entries=100_000, stacks="python") as cap:
        for _ in range(2):
            x = torch.randn(256, 4096, device="cuda")
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    torch.cuda.synchronize()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
    record("capture.written", cap.written and path.exists(), f"{path} exists={path.exists()}")
    data = cli_json("snapshot", str(path))
    dev = data["summary"]["devices"][0]
    record(
        "capture.reserved_bytes",
        dev["reserved_bytes"] == reserved,
        f"snapshot {dev['reserved_bytes']} vs torch.cuda.memory_reserved() {reserved}",
    )
    record(
        "capture.allocated_bytes",
        dev["allocated_bytes"] == allocated,
        f"snapshot {dev['allocated_bytes']} vs torch.cuda.memory_allocated() {allocated}",
    )
    peak = torch.cuda.max_memory_allocated()
    record(
        "capture.traced_peak<=max_memory_allocated",
        0 < dev["peak_requested_bytes"] <= peak,
        f"traced peak (requested) {dev['peak_requested_bytes']} vs max_memory_allocated {peak}",
    )
    top = cli_json("snapshot", str(path), "--top", "5")["top"][0]["rows"]
    me = os.path.basename(__file__)
    mine = [r for r in top if me in r["site"]]
    # AdamW's state (2 x 80 MiB) is allocated by opt.step() in this script during the capture.
    record(
        "capture.user_site_in_top5",
        bool(mine) and mine[0]["bytes"] >= 160 << 20,
        f"sites {[(r['site'], r['bytes']) for r in top]} (expected a {me} site holding >= 160 MiB)",
    )
    html = work / "step.html"
    r = subprocess.run([*torchmem_cmd(), "snapshot", str(path), "--html", str(html)], capture_output=True, text=True)
    record("capture.html", r.returncode == 0 and html.stat().st_size > 1000, f"rc={r.returncode} {html}")
    del model, opt
    torch.cuda.empty_cache()


OOM_CHILD = r"""
import json, sys, torch, torchmem
out = sys.argv[1]
h = torchmem.on_oom(out, max_entries=50_000)
held = []
try:
    while True:
        held.append(torch.empty(4 << 30, dtype=torch.uint8, device="cuda"))  # 4 GiB at a time
except torch.OutOfMemoryError as e:
    stats = torch.cuda.memory_stats()
    info = {
        "message": str(e),
        "allocated_bytes": stats["allocated_bytes.all.current"],
        "reserved_bytes": stats["reserved_bytes.all.current"],
        "num_ooms": stats["num_ooms"],
        "reports": [str(p) for p in h.reports],
        "snapshots": [str(p) for p in h.snapshots],
        "held": len(held),
    }
    print("RESULT " + json.dumps(info))
"""


@check
def on_oom_report_matches_allocator(work: Path) -> None:
    out = work / "oom"
    r = subprocess.run([sys.executable, "-c", OOM_CHILD, str(out)], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    record(
        "on_oom.child_ran", r.returncode == 0 and line is not None, f"rc={r.returncode} stderr tail={r.stderr[-400:]!r}"
    )
    if line is None:
        return
    info = json.loads(line[7:])
    record("on_oom.report_written", len(info["reports"]) == 1, f"reports={info['reports']}")
    record("on_oom.snapshot_written", len(info["snapshots"]) == 1, f"snapshots={info['snapshots']}")
    if not info["reports"]:
        return
    txt = Path(info["reports"][0])
    rep = json.loads(txt.with_name(txt.name.replace("-report.txt", "-report.json")).read_text())
    record(
        "on_oom.allocated_matches_allocator",
        rep["allocated_bytes"] == info["allocated_bytes"],
        f"report {rep['allocated_bytes']} vs memory_stats after the error {info['allocated_bytes']}",
    )
    record(
        "on_oom.reserved_matches_allocator",
        rep["reserved_bytes"] == info["reserved_bytes"],
        f"report {rep['reserved_bytes']} vs memory_stats after the error {info['reserved_bytes']}",
    )
    # PyTorch's message prints each number with 2 decimals in its unit: allow half a unit step.
    from torchmem import _native

    msg = _native.explain_oom(info["message"])["numbers"]

    def close(a: int, b: int) -> bool:
        unit = 1 << (10 * max(0, (max(a, b).bit_length() - 1) // 10))
        return abs(a - b) <= unit * 0.005 + 1

    for key, rkey in [
        ("requested_bytes", "requested_bytes"),
        ("allocated_bytes", "allocated_bytes"),
        ("reserved_unallocated_bytes", "reserved_unallocated_bytes"),
        ("free_bytes", "device_free_bytes"),
    ]:
        record(f"on_oom.{key}_matches_message", close(rep[rkey], msg[key]), f"report {rep[rkey]} vs message {msg[key]}")
    snap = cli_json("snapshot", info["snapshots"][0])
    ooms = snap["summary"]["action_counts"].get("oom", 0)
    record("on_oom.snapshot_has_oom_entry", ooms >= 1, f"oom trace entries {ooms}")
    text = Path(info["reports"][0]).read_text()
    record(
        "on_oom.report_has_next_steps", "Next steps" in text and "Top holders" in text, text[:300].replace("\n", " | ")
    )


HF_CHILD = r"""
import sys, warnings, torch
from transformers import GPT2Config, GPT2LMHeadModel
mode, out = sys.argv[1], sys.argv[2]
model = GPT2LMHeadModel(GPT2Config()).cuda()
model.gradient_checkpointing_enable()
model.train()
opt = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, 50257, (2, 256), device="cuda")

def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()

if mode == "raw":
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=100000)
    step()
    print("RAW_OK")
elif mode == "capture":
    import torchmem
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with torchmem.capture(out, stacks="python") as cap:
            step()
    print("CAPTURE_OK written=%s warned=%s" % (cap.written, any("gradient checkpointing" in str(x.message) for x in w)))
elif mode == "on_oom":
    import torchmem
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = torchmem.on_oom(out)
    step()
    step()
    print("ONOOM_OK")
"""


@check
def hf_checkpointing_hazard(work: Path) -> None:
    def child(mode: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", HF_CHILD, mode, str(work / f"hf_{mode}.pickle")],
            capture_output=True,
            text=True,
            timeout=600,
        )

    raw = child("raw")
    hazard = "RAW_OK" not in raw.stdout
    print(
        f"INFO raw _record_memory_history(stacks='python') + GPT2 checkpointing: "
        f"{'FAILS (hazard present)' if hazard else 'works on this torch'}; tail: {raw.stderr[-300:]!r}"
    )
    cap = child("capture")
    record(
        "hazard.capture_does_not_crash",
        cap.returncode == 0 and "CAPTURE_OK written=True" in cap.stdout,
        f"rc={cap.returncode} stdout={cap.stdout.strip()!r} stderr tail={cap.stderr[-300:]!r}",
    )
    record("hazard.capture_warned", "warned=True" in cap.stdout, cap.stdout.strip())
    if (work / "hf_capture.pickle").exists():
        s = cli_json("snapshot", str(work / "hf_capture.pickle"))["summary"]
        record("hazard.snapshot_readable", s["trace_entries"] > 0, f"trace entries {s['trace_entries']}")
    oom = child("on_oom")
    record(
        "hazard.on_oom_does_not_crash",
        oom.returncode == 0 and "ONOOM_OK" in oom.stdout,
        f"rc={oom.returncode} stderr tail={oom.stderr[-300:]!r}",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", help="directory to keep the snapshots and reports in")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("FAIL setup: no CUDA device")
        return 1
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, python {sys.version.split()[0]}")
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="torchmem-snap-"))
    work.mkdir(parents=True, exist_ok=True)
    capture_training_step(work)
    on_oom_report_matches_allocator(work)
    hf_checkpointing_hazard(work)
    failed = [n for n, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
