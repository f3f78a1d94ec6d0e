"""torchmem.simulate and `torchmem simulate` on the real H200 ground truth (tests/fixtures/sim-h200, torch 2.11):
the recorded settings reproduce the recording; what-ifs reproduce the real allocator's replay; bad input gets
the same refusals as `torchmem snapshot`."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torchmem

TRUTH_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "sim-h200"
TRUTH = json.loads((TRUTH_DIR / "truth.json").read_text())
SNAPS = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torchmem", *args], capture_output=True, text=True, timeout=120)


def run(workload: str, kind: str = "recorded", setting: str | None = None) -> dict[str, Any]:
    w = TRUTH["workloads"][workload]
    return w[kind] if setting is None else w[kind][setting]


def limit_of(r: dict[str, Any]) -> int | None:
    f = r["memory_fraction"]
    return None if f is None else int(f * TRUTH["device_total_bytes"])


def test_recorded_settings_reproduce_the_recording() -> None:
    rec = run("resnet50_adamw_foreach_fp32")
    r = torchmem.simulate(TRUTH_DIR / rec["snapshot"])
    assert r.matches_recording is True
    assert r.peak_allocated_bytes == rec["stats"]["allocated_bytes.all.peak"]
    assert r.peak_reserved_bytes == rec["stats"]["reserved_bytes.all.peak"]
    assert r.num_alloc_retries == 0 and r.oom is None
    assert r.settings == "default"
    assert "replay matches the recording" in str(r)


def test_what_ifs_match_the_real_allocator() -> None:
    rec = run("resnet50_adamw_foreach_fp32")
    path = TRUTH_DIR / rec["snapshot"]
    for setting in ["expandable", "max_split_64", "roundup_4", "cap_retry"]:
        truth = run("resnet50_adamw_foreach_fp32", "real", setting)
        r = torchmem.simulate(path, alloc_conf=truth["alloc_conf"] or None, memory_limit=limit_of(truth))
        assert r.matches_recording is None, setting
        assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.num_alloc_retries) == (
            truth["stats"]["allocated_bytes.all.peak"],
            truth["stats"]["reserved_bytes.all.peak"],
            truth["stats"]["num_alloc_retries"],
        ), setting


def test_memory_cap_oom_names_the_failing_allocation() -> None:
    truth = run("resnet50_adamw_foreach_fp32", "replay", "cap_oom")
    rec = run("resnet50_adamw_foreach_fp32")
    r = torchmem.simulate(TRUTH_DIR / rec["snapshot"], memory_limit=limit_of(truth))
    assert r.oom is not None
    assert (r.oom["entry"], r.oom["requested_bytes"]) == (truth["oom"]["entry"], truth["oom"]["requested_bytes"])
    assert r.oom["frames"], "the failing allocation's Python frames"
    assert r.oom["live_blocks"] > 0
    assert r.num_alloc_retries == truth["stats"]["num_alloc_retries"]


def test_bytes_dict_and_path_agree_and_min_memory_fits() -> None:
    rec = run("mlp_sgd_fp32")
    path = TRUTH_DIR / rec["snapshot"]
    raw = gzip.decompress(path.read_bytes())
    by_path = torchmem.simulate(path)
    by_bytes = torchmem.simulate(raw)
    by_dict = torchmem.simulate(pickle.loads(raw))  # our own fixture
    assert by_path.peak_reserved_bytes == by_bytes.peak_reserved_bytes == by_dict.peak_reserved_bytes
    m = torchmem.simulate(path, min_memory=True)
    rows = m.min_memory[0]["settings"]
    need = rows[0]["min_memory_bytes"]
    assert 0 < need <= m.peak_reserved_bytes
    assert torchmem.simulate(path, memory_limit=need).oom is None
    assert torchmem.simulate(path, memory_limit=need - (2 << 20)).oom is not None
    assert rows[1]["settings"] == "expandable_segments:True"


def test_cli_json_contract_and_text() -> None:
    rec = run("gpt2_adamw_amp")
    path = str(TRUTH_DIR / rec["snapshot"])
    r = cli("simulate", path, "--json")
    assert r.returncode == 0, r.stderr
    v = json.loads(r.stdout)
    for key in ["peak_allocated_bytes", "peak_reserved_bytes", "num_alloc_retries", "oom", "matches_recording"]:
        assert key in v
    assert "settings" in v
    assert v["matches_recording"] is True and v["oom"] is None
    assert v["peak_reserved_bytes"] == rec["stats"]["reserved_bytes.all.peak"]
    t = cli("simulate", path, "--alloc-conf", "expandable_segments:True", "--memory-limit", "4GiB")
    assert t.returncode == 0, t.stderr
    assert "OUT OF MEMORY at entry" in t.stdout and "over the memory limit" in t.stdout
    c = cli("simulate", str(SNAPS / "snapshot_mlp_adam_pystacks.pickle"), "--compare")
    assert c.returncode == 0 and "expandable_segments:True" in c.stdout and "min memory" in c.stdout
    assert "does not start from an empty allocator" in c.stdout


def test_bad_input_is_refused_clearly(tmp_path: Path) -> None:
    data = (SNAPS / "snapshot_mlp_adam_pystacks.pickle").read_bytes()
    cut = tmp_path / "cut.pickle"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(torchmem.SnapshotError, match="truncated"):
        torchmem.simulate(cut)
    r = cli("simulate", str(cut))
    assert r.returncode == 1 and "truncated" in r.stderr
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(b"\x80\x04cos\nsystem\n(S'touch x'\ntR.")
    with pytest.raises(torchmem.SnapshotError, match="refusing opcode GLOBAL"):
        torchmem.simulate(evil)
    with pytest.raises(ValueError, match="unknown key"):
        torchmem.simulate(SNAPS / "snapshot_mlp_adam_pystacks.pickle", alloc_conf="expandable:True")
    with pytest.raises(ValueError, match="max_split_size_mb must be at least 20"):
        torchmem.simulate(SNAPS / "snapshot_mlp_adam_pystacks.pickle", alloc_conf="max_split_size_mb:8")
    with pytest.raises(ValueError, match="not a size"):
        torchmem.simulate(SNAPS / "snapshot_mlp_adam_pystacks.pickle", memory_limit="lots")
    with pytest.raises(FileNotFoundError):
        torchmem.simulate(tmp_path / "missing.pickle")
    r = cli("simulate", str(SNAPS / "snapshot_mlp_adam_pystacks.pickle"), "--alloc-conf", "roundup_power2_divisions:3")
    assert r.returncode == 1 and "power of two" in r.stderr
    assert not os.path.exists("x")


def _synthetic(alloc_bytes: int, pool_id: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    """A synthetic two-device snapshot (not a recording): device 0 allocates and frees one 3 MiB tensor in a
    20 MiB segment the trace creates; device 1 has a segment of a private pool; the settings predate 2.9."""
    seg0 = 0x7F00_0000_0000
    seg1 = 0x7E00_0000_0000
    mb = 1 << 20
    trace0 = [
        {"action": "segment_alloc", "addr": seg0, "size": 20 * mb, "stream": 0, "time_us": 1, "frames": []},
        {"action": "alloc", "addr": seg0, "size": alloc_bytes, "stream": 0, "time_us": 2, "frames": []},
        {"action": "free_requested", "addr": seg0, "size": alloc_bytes, "stream": 0, "time_us": 3, "frames": []},
        {"action": "free_completed", "addr": seg0, "size": alloc_bytes, "stream": 0, "time_us": 3, "frames": []},
    ]

    def segment(device: int, addr: int, pool: tuple[int, int], small: bool) -> dict[str, Any]:
        size = 2 * mb if small else 20 * mb
        return {
            "device": device,
            "address": addr,
            "total_size": size,
            "allocated_size": 0,
            "active_size": 0,
            "requested_size": 0,
            "stream": 0,
            "segment_type": "small" if small else "large",
            "segment_pool_id": pool,
            "is_expandable": False,
            "frames": [],
            "blocks": [{"address": addr, "size": size, "requested_size": 0, "state": "inactive", "frames": []}],
        }

    return {
        "segments": [segment(0, seg0, (0, 0), False), segment(1, seg1, pool_id, True)],
        "device_traces": [trace0, []],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False},
    }


def test_multi_device_private_pool_and_old_version_are_reported() -> None:
    r = torchmem.simulate(_synthetic(3 << 20))
    assert [d["device"] for d in r.devices] == [0]
    assert r.matches_recording is True
    assert len(r.refused) == 1 and r.refused[0]["device"] == 1
    assert "private pool (1, 1)" in r.refused[0]["reason"] and "CUDA graph" in r.refused[0]["reason"]
    assert r.version_note and "older than 2.9" in r.version_note and "2.11 rules" in r.version_note
    assert "device 1: not simulated" in str(r)


def test_divergence_names_the_entry_and_both_events() -> None:
    # The trace says a 20 MiB segment served a 30 MiB request: the model needs a 30 MiB segment.
    r = torchmem.simulate(_synthetic(30 << 20, pool_id=(0, 0)))
    assert r.matches_recording is False
    d = r.devices[0]["comparison"]["divergence"]
    assert d["entry"] == 1 and d["expected"]["size_bytes"] == 20 << 20 and d["got"]["size_bytes"] == 30 << 20
    assert "replay diverges from the recording at entry 1" in str(r)


def test_device_memory_recorded_uses_the_capacity_at_the_recorded_oom() -> None:
    # Synthetic: a 3 MiB tensor lives in a 20 MiB segment; then a 30 MiB request fails with 10 MiB free on the
    # device, so the allocator could have had 30 MiB: a 30 MiB segment does not fit next to the 20 MiB one.
    snap = _synthetic(3 << 20, pool_id=(0, 0))
    trace = snap["device_traces"][0][:2]
    oom = {"action": "oom", "addr": 0, "size": 30 << 20, "stream": 0, "time_us": 4, "frames": []}
    trace.append({**oom, "device_free": 10 << 20})
    snap["device_traces"][0] = trace
    seg = snap["segments"][0]
    seg["blocks"] = [
        {
            "address": seg["address"],
            "size": 3 << 20,
            "requested_size": 3 << 20,
            "state": "active_allocated",
            "frames": [],
        },
        {
            "address": seg["address"] + (3 << 20),
            "size": 17 << 20,
            "requested_size": 0,
            "state": "inactive",
            "frames": [],
        },
    ]
    r = torchmem.simulate(snap)
    assert r.oom is None and "--device-memory recorded" in str(r)
    assert r.matches_recording is False, "unlimited, the 30 MiB segment is one segment event more"
    at = torchmem.simulate(snap, device_memory="recorded")
    assert at.devices[0]["device_memory_bytes"] == 30 << 20
    assert at.oom is not None and at.oom["recorded"] is True and at.oom["entry"] == 2
    assert at.matches_recording is True
