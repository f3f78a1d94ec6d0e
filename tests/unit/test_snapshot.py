"""Allocator snapshots: the Rust reader against an independent computation with Python's pickle on the real
H200 fixtures (byte for byte), other protocols and the JSON form, malicious and truncated pickles (clear
errors, non-zero exits, nothing executed), the `torchmem snapshot` / `diff` / `explain-oom` command line,
and `capture` / `on_oom` on this CPU-only machine."""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torchmem
from torchmem import _native
from torchmem import snapshot as tsnap

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"
PICKLES = sorted(FIX.glob("*.pickle"))
OOM_MESSAGE = (FIX / "oom_message_2.11.txt").read_text().strip()


def torchmem_cli(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, timeout=120, input=input
    )


def load_py(path: Path) -> dict[str, Any]:
    # The fixtures are our own trusted files; the independent computation uses Python's pickle.
    with open(path, "rb") as f:
        return pickle.load(f)


def independent(snap: dict[str, Any]) -> dict[int, dict[str, int]]:
    """Per-device totals computed in plain Python, independently of the Rust code."""
    out: dict[int, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    for seg in snap["segments"]:
        d = out[seg["device"]]
        d["segments"] += 1
        d["reserved_bytes"] += seg["total_size"]
        d["allocated_bytes"] += seg["allocated_size"]
        d["active_bytes"] += seg["active_size"]
        d["requested_bytes"] += seg["requested_size"]
        inactive = [b["size"] for b in seg["blocks"] if b["state"] == "inactive"]
        if seg["active_size"] > 0:
            d["inactive_split_bytes"] += sum(inactive)
        d["largest_free_block_bytes"] = max(d["largest_free_block_bytes"], max(inactive, default=0))
        for b in seg["blocks"]:
            d[
                {"active_allocated": "blocks_allocated", "active_pending_free": "blocks_pending_free"}.get(
                    b["state"], "blocks_inactive"
                )
            ] += 1
    for dev, trace in enumerate(snap["device_traces"]):
        d = out[dev]
        d["trace_entries"] = len(trace)
        # Replay: requested bytes alive, starting from the blocks allocated before the history.
        live: dict[int, int] = {}
        cur = low = peak = 0
        frees_without_alloc = 0
        for e in trace:
            if e["action"] == "alloc":
                live[e["addr"]] = e["size"]
                cur += e["size"]
            elif e["action"] == "free_completed":
                if e["addr"] in live:
                    cur -= live.pop(e["addr"])
                else:
                    frees_without_alloc += e["size"]
                    cur -= e["size"]
            peak = max(peak, cur)
            low = min(low, cur)
        end_live = [b for s in snap["segments"] if s["device"] == dev for b in s["blocks"] if b["state"] != "inactive"]
        before = frees_without_alloc + sum(b["requested_size"] for b in end_live if b["address"] not in live)
        d["peak_requested_bytes"] = before + peak
        d["end_requested_bytes"] = before + cur
    return out


@pytest.mark.parametrize("path", PICKLES, ids=[p.name for p in PICKLES])
def test_rust_totals_equal_python_pickle_byte_for_byte(path: Path) -> None:
    assert len(PICKLES) == 5
    ref = independent(load_py(path))
    got = _native.snapshot_summary(str(path))["summary"]
    assert [d["device"] for d in got["devices"]] == sorted(ref)
    for d in got["devices"]:
        r = ref[d["device"]]
        for key, value in r.items():
            assert d[key] == value, (path.name, key)
        assert d["reserved_unallocated_bytes"] == r["reserved_bytes"] - r["allocated_bytes"]
    snap = load_py(path)
    counts = collections.Counter(e["action"] for t in snap["device_traces"] for e in t)
    assert got["action_counts"] == dict(counts)
    assert got["trace_entries"] == sum(counts.values())
    # unique frames: distinct (filename, line, name) triples anywhere in the file
    frames = {
        (f["filename"], f["line"], f["name"]) for t in snap["device_traces"] for e in t for f in e.get("frames", [])
    } | {(f["filename"], f["line"], f["name"]) for s in snap["segments"] for b in s["blocks"] for f in b["frames"]}
    assert got["unique_frames"] == len(frames)
    assert got["allocator_settings"] == json.loads(json.dumps(snap["allocator_settings"]))


def live_at_peak_python(snap: dict[str, Any]) -> int:
    trace = snap["device_traces"][0]
    live: dict[int, int] = {}
    cur = best = 0
    best_live: dict[int, int] = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])
        if cur > best:
            best, best_live = cur, dict(live)
    return sum(best_live.values())


@pytest.mark.parametrize("path", PICKLES, ids=[p.name for p in PICKLES])
def test_top_sites_cover_the_blocks_alive_at_the_peak(path: Path) -> None:
    snap = load_py(path)
    got = _native.snapshot_summary(str(path), top=100000)
    top = got["top"][0]
    assert top["moment"] == "peak"
    dev = got["summary"]["devices"][0]
    assert top["total_bytes"] == dev["peak_requested_bytes"]
    assert sum(r["bytes"] for r in top["rows"]) == top["total_bytes"]
    # the blocks the trace itself allocated and still holds at the peak, plus blocks from before the history
    assert top["total_bytes"] >= live_at_peak_python(snap)
    assert top["rows"] == sorted(top["rows"], key=lambda r: (-r["bytes"], r["site"]))


def test_python_stack_sites_name_user_code() -> None:
    got = _native.snapshot_summary(str(FIX / "snapshot_mlp_adam_pystacks.pickle"), top=3)
    sites = [r["site"] for r in got["top"][0]["rows"]]
    assert sites[0].startswith("/home/user/train/probe.py:"), sites


def test_at_time_moves_the_moment() -> None:
    path = str(FIX / "snapshot_mlp_adam_pystacks.pickle")
    snap = load_py(FIX / "snapshot_mlp_adam_pystacks.pickle")
    first = snap["device_traces"][0][0]
    got = _native.snapshot_summary(path, top=5, at_time_us=first["time_us"])
    top = got["top"][0]
    assert top["moment"] == "time"
    peak = _native.snapshot_summary(path, top=5)["top"][0]
    assert top["total_bytes"] < peak["total_bytes"]


@pytest.mark.parametrize("protocol", [2, 3, 5])
def test_other_protocols_and_json_give_the_same_summary(tmp_path: Path, protocol: int) -> None:
    src = FIX / "snapshot_mlp_adam_cppstacks.pickle"
    snap = load_py(src)
    want = _native.snapshot_summary(str(src))["summary"]
    p = tmp_path / f"p{protocol}.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=protocol))
    got = _native.snapshot_summary(str(p))["summary"]
    assert got == want
    j = tmp_path / "s.json"
    j.write_text(json.dumps(snap))
    assert _native.snapshot_summary(str(j))["summary"] == want
    assert _native.snapshot_summary_bytes(pickle.dumps(snap, protocol=protocol))["summary"] == want


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_never_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil(str(marker))]]}, protocol=4))
    with pytest.raises(torchmem.SnapshotError, match=r"STACK_GLOBAL \(0x93\) at byte offset \d+"):
        _native.snapshot_summary(str(evil))
    r = torchmem_cli("snapshot", str(evil))
    assert r.returncode == 1
    assert "refusing opcode STACK_GLOBAL" in r.stderr and "byte offset" in r.stderr
    for proto, opcode in [(0, "GLOBAL"), (2, "GLOBAL")]:
        p = tmp_path / f"evil{proto}.pickle"
        p.write_bytes(pickle.dumps(Evil(str(marker)), protocol=proto))
        r = torchmem_cli("snapshot", str(p))
        assert r.returncode == 1 and f"refusing opcode {opcode} " in r.stderr, r.stderr
    # REDUCE / BUILD reached directly (no global first) are refused too
    for raw, name in [(b"\x80\x04N)R.", "REDUCE"), (b"\x80\x04}}b.", "BUILD"), (b"\x80\x04N)\x81.", "NEWOBJ")]:
        with pytest.raises(torchmem.SnapshotError, match=f"refusing opcode {name} "):
            _native.snapshot_summary_bytes(raw)
    assert not marker.exists()


def test_truncated_and_garbage_files_give_clear_errors(tmp_path: Path) -> None:
    data = (FIX / "snapshot_mlp_adam_pystacks.pickle").read_bytes()
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(data[: len(data) // 2])
    r = torchmem_cli("snapshot", str(cut))
    assert r.returncode == 1
    assert "truncated" in r.stderr and "byte offset" in r.stderr
    with pytest.raises(torchmem.SnapshotError, match="truncated"):
        _native.snapshot_summary(str(cut))
    junk = tmp_path / "junk.pickle"
    junk.write_bytes(b"\x80\x04\xff\xff")
    r = torchmem_cli("snapshot", str(junk))
    assert r.returncode == 1 and "unknown pickle opcode 0xff at byte offset 2" in r.stderr
    notsnap = tmp_path / "list.pickle"
    notsnap.write_bytes(pickle.dumps({"a": 1}))
    r = torchmem_cli("snapshot", str(notsnap))
    assert r.returncode == 1 and "not an allocator snapshot" in r.stderr
    r = torchmem_cli("snapshot", str(tmp_path / "missing.pickle"))
    assert r.returncode == 1 and "no such snapshot file" in r.stderr
    empty = tmp_path / "empty.pickle"
    empty.write_bytes(b"")
    assert torchmem_cli("snapshot", str(empty)).returncode == 1


def test_cli_summary_top_json_and_diff(tmp_path: Path) -> None:
    f = str(FIX / "snapshot_gpt2_bs8_amp_cppstacks.pickle")
    r = torchmem_cli("snapshot", f)
    assert r.returncode == 0, r.stderr
    assert "reserved     8.33 GiB" in r.stdout and "Trace actions" in r.stdout and "alloc" in r.stdout
    assert "Most fragmented segments" in r.stdout and "Allocator settings" in r.stdout
    r = torchmem_cli("snapshot", f, "--top", "3")
    assert r.returncode == 0 and "top allocation sites at the traced peak" in r.stdout
    assert "probe.py:149:step_fn" in r.stdout
    r = torchmem_cli("snapshot", f, "--json")
    data = json.loads(r.stdout)
    assert data["summary"]["devices"][0]["reserved_bytes"] == independent(load_py(Path(f)))[0]["reserved_bytes"]
    a = str(FIX / "snapshot_resnet50_bs64_fp32_cppstacks.pickle")
    b = str(FIX / "snapshot_resnet50_bs64_amp_cppstacks.pickle")
    r = torchmem_cli("snapshot", "diff", a, b, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["diff"]
    ra, rb = load_py(Path(a)), load_py(Path(b))
    assert d["reserved_before_bytes"] == sum(s["total_size"] for s in ra["segments"])
    assert d["reserved_after_bytes"] == sum(s["total_size"] for s in rb["segments"])
    assert sum(row["delta_bytes"] for row in d["rows"]) == d["allocated_after_bytes"] - d["allocated_before_bytes"]
    r = torchmem_cli("snapshot", "diff", a)
    assert r.returncode == 2 and "usage: torchmem snapshot diff" in r.stderr


def test_explain_oom_parses_the_real_message() -> None:
    r = torchmem_cli("explain-oom", OOM_MESSAGE, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    n = d["numbers"]
    gib = 1 << 30
    assert n["requested_bytes"] == 60 * gib
    assert n["free_bytes"] == 39 * gib
    assert n["reserved_unallocated_bytes"] == 1024 * 1024
    assert n["allocated_bytes"] == round(100.06 * gib)
    assert d["verdict"] == "capacity"
    assert 0 < d["batch_factor"] < 1
    # shortfall: 60 GiB request − (39 GiB free + 1 MiB cached)
    assert d["shortfall_bytes"] == 60 * gib - 39 * gib - 1024 * 1024
    text = torchmem_cli("explain-oom", "-", input=OOM_MESSAGE)
    assert text.returncode == 0 and "Reduce the batch size" in text.stdout
    bad = torchmem_cli("explain-oom", "segmentation fault")
    assert bad.returncode == 1 and "out-of-memory message" in bad.stderr


def test_oom_diagnosis_from_numbers_calls_fragmentation() -> None:
    mib = 1 << 20
    d = _native.oom_diagnosis(512 * mib, 6000 * mib, 7000 * mib, 8192 * mib, 100 * mib)
    assert d["verdict"] == "fragmentation"
    assert any("expandable_segments:True" in s for s in d["next_steps"])
    d = _native.oom_diagnosis(4096 * mib, 6000 * mib, 6100 * mib, 8192 * mib, 100 * mib)
    assert d["verdict"] == "capacity" and d["batch_factor"] is not None


def test_capture_and_on_oom_without_cuda_warn_and_do_not_crash(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this test is about machines without CUDA")
    out = tmp_path / "snap.pickle"
    with pytest.warns(RuntimeWarning, match="no CUDA device"):
        with torchmem.capture(out) as cap:
            x = torch.ones(1000)
            del x
    assert not cap.written and not out.exists()
    with pytest.raises(FileNotFoundError):
        cap.summary()
    with pytest.warns(RuntimeWarning, match="no CUDA device"):
        h = torchmem.on_oom(tmp_path / "oom")
    assert not h.active
    h.disable()
    with pytest.raises(ValueError, match="stacks must be"):
        torchmem.capture(out, stacks="cpp")


def test_checkpointing_hazard_is_detected_and_avoided() -> None:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.gradient_checkpointing = False

    m = Block()
    assert tsnap.checkpointing_hazard() is None or tsnap.checkpointing_hazard() != "Block"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if tsnap.checkpointing_hazard() is None:
            assert tsnap._safe_context("python", "all") == ("all", "python", None)
    m.gradient_checkpointing = True
    assert tsnap.checkpointing_hazard() == "Block"
    ctx, stacks, warning = tsnap._safe_context("python", "all")
    assert ctx is None and warning is not None and "Block" in warning
    del m


class FakeCudaTorch:
    """A fake of the few torch.cuda calls `OomHandler._on_oom` makes, to test the report logic without a
    GPU: `_dump_snapshot` copies a real H200 snapshot fixture; memory_stats returns fixed numbers."""

    class cuda:  # noqa: N801
        class memory:  # noqa: N801
            @staticmethod
            def _dump_snapshot(path: str) -> None:
                Path(path).write_bytes((FIX / "snapshot_mlp_adam_pystacks.pickle").read_bytes())

        @staticmethod
        def memory_stats(device: int) -> dict[str, int]:
            return {"allocated_bytes.all.current": 100 << 30, "reserved_bytes.all.current": (100 << 30) + (1 << 20)}


def test_oom_report_logic_with_a_fake_cuda(tmp_path: Path) -> None:
    h = tsnap.OomHandler(tmp_path / "oom", True, None, FakeCudaTorch)
    gib = 1 << 30
    h._on_oom(0, 60 * gib, 140 * gib, 39 * gib)
    assert len(h.reports) == 1 and len(h.snapshots) == 1
    rep = json.loads(h.reports[0].with_name(h.reports[0].name.replace("-report.txt", "-report.json")).read_text())
    assert rep["requested_bytes"] == 60 * gib
    assert rep["allocated_bytes"] == 100 * gib
    assert rep["reserved_unallocated_bytes"] == 1 << 20
    assert rep["diagnosis"]["verdict"] == "capacity"
    assert rep["top_holders"] and rep["top_holders"][0]["bytes"] > 0
    assert any("test_snapshot.py" in f for f in rep["allocating_frames"])
    text = h.reports[0].read_text()
    assert "Next steps" in text and "Top holders" in text and "Reduce the batch size" in text
    # the holders are the blocks alive at the end of the snapshot (the moment of the failure)
    summary = _native.snapshot_summary(str(h.snapshots[0]))["summary"]["devices"][0]
    assert sum(r["bytes"] for r in rep["top_holders"]) <= summary["end_requested_bytes"]


def test_ring_buffer_wrap_is_reported(tmp_path: Path) -> None:
    snap = load_py(FIX / "snapshot_mlp_adam_pystacks.pickle")
    full = _native.snapshot_summary_bytes(pickle.dumps(snap))["summary"]["devices"][0]
    assert full["history"]["wrapped"] is None  # one block predates recording: cannot tell
    # What a wrapped ring buffer of max_entries=100 leaves: the last 100 entries only.
    snap["device_traces"][0] = snap["device_traces"][0][-100:]
    d = _native.snapshot_summary_bytes(pickle.dumps(snap))["summary"]["devices"][0]
    assert d["trace_entries"] == 100
    assert d["history"]["wrapped"] is True
    assert d["history"]["frees_without_alloc"] > 0
    assert "ring buffer wrapped" in d["history"]["note"]
    # Newer torch says so itself.
    snap["device_traces"][0] = snap["device_traces"][0][-97:]
    snap["allocator_settings"]["trace_alloc_overflowed"] = True
    snap["allocator_settings"]["trace_alloc_max_entries"] = 97
    d = _native.snapshot_summary_bytes(pickle.dumps(snap))["summary"]["devices"][0]
    assert d["history"]["wrapped"] is True and d["history"]["max_entries"] == 97
    assert "max_entries=97" in d["history"]["note"]
    # The totals of the segments do not depend on the trace.
    assert d["reserved_bytes"] == full["reserved_bytes"] and d["allocated_bytes"] == full["allocated_bytes"]


def test_oom_entries_and_big_addresses() -> None:
    # The `oom` entry shape recorded on the H200 (allocator_probe1_main_log.txt), addresses above 2**63.
    top_addr = 2**64 - 2**21
    snap = {
        "segments": [
            {
                "device": 0,
                "address": top_addr,
                "total_size": 2 << 20,
                "allocated_size": 512,
                "active_size": 512,
                "requested_size": 40,
                "stream": 0,
                "segment_type": "small",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": [
                    {"address": top_addr, "size": 512, "requested_size": 40, "state": "active_allocated", "frames": []},
                    {"address": top_addr + 512, "size": (2 << 20) - 512, "requested_size": 0, "state": "inactive"},
                ],
            }
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": top_addr, "size": 40, "stream": 0, "time_us": 1796056088782000},
                {
                    "action": "oom",
                    "device_free": 41870819328,
                    "size": 64424509440,
                    "stream": 0,
                    "time_us": 1796056088782781,
                    "compile_context": "N/A",
                    "user_metadata": "phase=train",
                },
            ]
        ],
        "allocator_settings": {},
        "external_annotations": [],
    }
    for proto in (2, 4, 5):
        d = _native.snapshot_summary_bytes(pickle.dumps(snap, protocol=proto))["summary"]
        dev = d["devices"][0]
        assert dev["ooms"] == [
            {"size_bytes": 64424509440, "device_free_bytes": 41870819328, "time_us": 1796056088782781}
        ]
        assert d["segments"][0]["address"] == top_addr
        assert dev["inactive_split_bytes"] == (2 << 20) - 512
        assert dev["history"]["wrapped"] is False


