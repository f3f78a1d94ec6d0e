"""Allocator snapshots (issue 4) on a CUDA machine with torchmem installed (was scripts/gpu_check_snapshot.py).

1. `torchmem.capture` around a real training step (in this process) writes a snapshot; `torchmem snapshot --json`
   on it gives reserved/allocated bytes equal to torch.cuda.memory_reserved()/memory_allocated() at the dump, and
   `--top` names this file as the top allocation site.
2. `torchmem.on_oom` in a child process that runs out of memory on purpose: the snapshot and the report are
   written, and the report's numbers match the allocator at the failure (memory_stats() right after the
   error, and the numbers in PyTorch's own OOM message, within its 2-decimal rounding).
3. The torch 2.11 hazard: GPT-2 (transformers, built from a config, no download) with gradient checkpointing
   trains under `torchmem.capture` and under `torchmem.on_oom` without crashing. The raw hazard (plain
   `_record_memory_history(stacks="python")`) is measured and printed for information (test_info_raw_hazard).

Each scenario runs once in a module-scoped fixture; each check is a test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def torchmem_cmd() -> list[str]:
    exe = shutil.which("torchmem")
    return [exe] if exe else [sys.executable, "-m", "torchmem"]


def cli_json(*args: str) -> dict:
    r = subprocess.run([*torchmem_cmd(), *args, "--json"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"torchmem {' '.join(args)} failed: {r.stderr}")
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, python {sys.version.split()[0]}")
    return tmp_path_factory.mktemp("torchmem-snap")


# --- 1. capture around a training step ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def capture(work: Path) -> dict:
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
    res = {
        "path": path,
        "written": cap.written,
        "reserved": torch.cuda.memory_reserved(),
        "allocated": torch.cuda.memory_allocated(),
        "peak": torch.cuda.max_memory_allocated(),
    }
    del model, opt, x, loss
    torch.cuda.empty_cache()
    return res


def test_capture_written(capture: dict) -> None:
    path = capture["path"]
    assert capture["written"] and path.exists(), f"{path} exists={path.exists()}, written={capture['written']}"


@pytest.fixture(scope="module")
def capture_summary(capture: dict) -> dict:
    return cli_json("snapshot", str(capture["path"]))["summary"]["devices"][0]


def test_capture_reserved_bytes(capture: dict, capture_summary: dict) -> None:
    dev = capture_summary
    assert dev["reserved_bytes"] == capture["reserved"], (
        f"snapshot {dev['reserved_bytes']} vs torch.cuda.memory_reserved() {capture['reserved']}"
    )


def test_capture_allocated_bytes(capture: dict, capture_summary: dict) -> None:
    dev = capture_summary
    assert dev["allocated_bytes"] == capture["allocated"], (
        f"snapshot {dev['allocated_bytes']} vs torch.cuda.memory_allocated() {capture['allocated']}"
    )


def test_capture_traced_peak_at_most_max_memory_allocated(capture: dict, capture_summary: dict) -> None:
    dev = capture_summary
    assert 0 < dev["peak_requested_bytes"] <= capture["peak"], (
        f"traced peak (requested) {dev['peak_requested_bytes']} vs max_memory_allocated {capture['peak']}"
    )


def test_capture_user_site_in_top5(capture: dict) -> None:
    top = cli_json("snapshot", str(capture["path"]), "--top", "5")["top"][0]["rows"]
    me = os.path.basename(__file__)
    mine = [r for r in top if me in r["site"]]
    # AdamW's state (2 x 80 MiB) is allocated by opt.step() in this file during the capture.
    assert bool(mine) and mine[0]["bytes"] >= 160 << 20, (
        f"sites {[(r['site'], r['bytes']) for r in top]} (expected a {me} site holding >= 160 MiB)"
    )


def test_capture_html(capture: dict, work: Path) -> None:
    html = work / "step.html"
    r = subprocess.run(
        [*torchmem_cmd(), "snapshot", str(capture["path"]), "--html", str(html)], capture_output=True, text=True
    )
    assert r.returncode == 0 and html.exists() and html.stat().st_size > 1000, f"rc={r.returncode} {html} {r.stderr}"


# --- 2. on_oom in a child that runs out of memory -------------------------------------------------------------

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


@pytest.fixture(scope="module")
def on_oom(work: Path) -> dict:
    out = work / "oom"
    r = subprocess.run([sys.executable, "-c", OOM_CHILD, str(out)], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return {"proc": r, "info": json.loads(line[7:]) if line is not None else None}


def _info(on_oom: dict) -> dict:
    if on_oom["info"] is None:
        r = on_oom["proc"]
        pytest.fail(f"the on_oom child did not run to its RESULT: rc={r.returncode} stderr tail={r.stderr[-400:]!r}")
    return on_oom["info"]


def _report(on_oom: dict) -> dict:
    info = _info(on_oom)
    if not info["reports"]:
        pytest.fail(f"no report written: reports={info['reports']}")
    txt = Path(info["reports"][0])
    return json.loads(txt.with_name(txt.name.replace("-report.txt", "-report.json")).read_text())


def test_on_oom_child_ran(on_oom: dict) -> None:
    r = on_oom["proc"]
    assert r.returncode == 0 and on_oom["info"] is not None, f"rc={r.returncode} stderr tail={r.stderr[-400:]!r}"


def test_on_oom_report_written(on_oom: dict) -> None:
    info = _info(on_oom)
    assert len(info["reports"]) == 1, f"reports={info['reports']}"


def test_on_oom_snapshot_written(on_oom: dict) -> None:
    info = _info(on_oom)
    assert len(info["snapshots"]) == 1, f"snapshots={info['snapshots']}"


def test_on_oom_allocated_matches_allocator(on_oom: dict) -> None:
    info, rep = _info(on_oom), _report(on_oom)
    assert rep["allocated_bytes"] == info["allocated_bytes"], (
        f"report {rep['allocated_bytes']} vs memory_stats after the error {info['allocated_bytes']}"
    )


def test_on_oom_reserved_matches_allocator(on_oom: dict) -> None:
    info, rep = _info(on_oom), _report(on_oom)
    assert rep["reserved_bytes"] == info["reserved_bytes"], (
        f"report {rep['reserved_bytes']} vs memory_stats after the error {info['reserved_bytes']}"
    )


def close(a: int, b: int) -> bool:
    """PyTorch's message prints each number with 2 decimals in its unit: allow half a unit step."""
    unit = 1 << (10 * max(0, (max(a, b).bit_length() - 1) // 10))
    return abs(a - b) <= unit * 0.005 + 1


@pytest.mark.parametrize(
    ("key", "rkey"),
    [
        ("requested_bytes", "requested_bytes"),
        ("allocated_bytes", "allocated_bytes"),
        ("reserved_unallocated_bytes", "reserved_unallocated_bytes"),
        ("free_bytes", "device_free_bytes"),
    ],
)
def test_on_oom_matches_message(key: str, rkey: str, on_oom: dict) -> None:
    from torchmem import _native

    info, rep = _info(on_oom), _report(on_oom)
    msg = _native.explain_oom(info["message"])["numbers"]
    assert close(rep[rkey], msg[key]), f"on_oom.{key}_matches_message: report {rep[rkey]} vs message {msg[key]}"


def test_on_oom_snapshot_has_oom_entry(on_oom: dict) -> None:
    info = _info(on_oom)
    if not info["snapshots"]:
        pytest.fail(f"no snapshot written: snapshots={info['snapshots']}")
    snap = cli_json("snapshot", info["snapshots"][0])
    ooms = snap["summary"]["action_counts"].get("oom", 0)
    assert ooms >= 1, f"oom trace entries {ooms}"


def test_on_oom_report_has_next_steps(on_oom: dict) -> None:
    info = _info(on_oom)
    if not info["reports"]:
        pytest.fail(f"no report written: reports={info['reports']}")
    text = Path(info["reports"][0]).read_text()
    assert "Next steps" in text and "Top holders" in text, text[:300].replace("\n", " | ")


# --- 3. GPT-2 with gradient checkpointing: the torch 2.11 hazard ----------------------------------------------

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


def hf_child(work: Path, mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HF_CHILD, mode, str(work / f"hf_{mode}.pickle")],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_info_raw_hazard(work: Path, record_property) -> None:  # noqa: ANN001 - pytest's fixture
    """INFO, not a check: does plain `_record_memory_history(stacks="python")` break checkpointed GPT-2 here?"""
    raw = hf_child(work, "raw")
    hazard = "RAW_OK" not in raw.stdout
    line = (
        f"INFO raw _record_memory_history(stacks='python') + GPT2 checkpointing: "
        f"{'FAILS (hazard present)' if hazard else 'works on this torch'}; tail: {raw.stderr[-300:]!r}"
    )
    print(line)
    record_property("raw_hazard", line)


@pytest.fixture(scope="module")
def hf_capture(work: Path) -> subprocess.CompletedProcess[str]:
    return hf_child(work, "capture")


def test_hazard_capture_does_not_crash(hf_capture: subprocess.CompletedProcess[str]) -> None:
    cap = hf_capture
    assert cap.returncode == 0 and "CAPTURE_OK written=True" in cap.stdout, (
        f"rc={cap.returncode} stdout={cap.stdout.strip()!r} stderr tail={cap.stderr[-300:]!r}"
    )


def test_hazard_capture_warned(hf_capture: subprocess.CompletedProcess[str]) -> None:
    assert "warned=True" in hf_capture.stdout, f"{hf_capture.stdout.strip()!r} stderr tail={hf_capture.stderr[-300:]!r}"


def test_hazard_snapshot_readable(hf_capture: subprocess.CompletedProcess[str], work: Path) -> None:
    path = work / "hf_capture.pickle"
    if not path.exists():
        pytest.fail(
            f"no snapshot written by the capture child: rc={hf_capture.returncode} {hf_capture.stderr[-300:]!r}"
        )
    s = cli_json("snapshot", str(path))["summary"]
    assert s["trace_entries"] > 0, f"trace entries {s['trace_entries']}"


def test_hazard_on_oom_does_not_crash(work: Path) -> None:
    oom = hf_child(work, "on_oom")
    assert oom.returncode == 0 and "ONOOM_OK" in oom.stdout, f"rc={oom.returncode} stderr tail={oom.stderr[-300:]!r}"
