"""Tests of torchmem's in-process API (stats, peak, reset_peak, empty_cache, track, device_info and the
allocator sampler) against real torch on the CPU, real /proc and real child processes."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchmem
from children import run_with_recorder_pipe
from torchmem import _ledger, _native, api

MIB = 1 << 20
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _heap_returned_to_the_kernel():
    """These tests run in one process after others (pytest's order, or `-k`): freed heap memory that glibc
    kept resident would serve their allocations without a page fault, and RSS would not move. Each test
    starts with that memory given back, so its allocations fault fresh pages."""
    _native.malloc_trim()
    yield


def allocate_torch(n_bytes: int):
    return torch.ones(n_bytes // 4, dtype=torch.float32)


def allocate_numpy(n_bytes: int):
    return np.ones(n_bytes, dtype=np.uint8)


def allocate_bytearray(n_bytes: int):
    return bytearray(b"\x01" * n_bytes)


def allocate_mmap(n_bytes: int):
    """Fresh anonymous pages, never reused from glibc's heap (which earlier tests may have left resident)."""
    m = mmap.mmap(-1, n_bytes)
    m.write(b"\x01" * n_bytes)
    return m


ALLOCATORS = [allocate_torch, allocate_numpy, allocate_bytearray, allocate_mmap]


# --- stats ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="checks the CPU-only machine's answers")
@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", 0, torch.device("cpu")])
def test_stats_on_a_cpu_only_machine_has_no_gpu_numbers(device):
    s = torchmem.stats(device, uss=True)
    assert {"allocated_bytes", "peak_reserved_bytes", "num_ooms", "nvml_process_bytes"} <= set(api.GPU_FIELDS)
    # Exactly the GPU fields (and the device) are None: every CPU field is measured (uss=True).
    unset = {f.name for f in dataclasses.fields(s) if getattr(s, f.name) is None} - set(s._RANK_FIELDS)
    assert unset == {"device", *api.GPU_FIELDS}
    assert s.device is None
    assert s.allocated is None and s.reserved is None
    assert s.rss_bytes > 10 * MIB
    assert 0 < s.uss_bytes <= s.rss_bytes
    assert s.uss_bytes <= s.pss_bytes <= s.rss_bytes
    text = str(s)
    assert "no CUDA device" in text and "RSS" in text and "MiB" in text
    d = s.to_dict()
    assert d["allocated_bytes"] is None and d["rss_bytes"] == s.rss_bytes
    json.dumps(d)


def test_stats_skips_smaps_unless_asked():
    s = torchmem.stats()
    assert s.uss_bytes is None and s.pss_bytes is None and s.rss_bytes > 0


@pytest.mark.parametrize("bad", ["xla", "cuda:x", 1.5])
def test_stats_rejects_unknown_devices(bad):
    with pytest.raises((ValueError, TypeError)):
        torchmem.stats(bad)


@pytest.mark.parametrize("allocate", ALLOCATORS)
def test_allocating_64_mib_shows_at_least_64_mib_more_rss(allocate):
    before = torchmem.stats(uss=False).rss_bytes
    block = allocate(64 * MIB)
    after = torchmem.stats(uss=True)
    assert after.rss_bytes - before >= 64 * MIB, (before, after.rss_bytes)
    assert after.uss_bytes >= 64 * MIB
    del block


# --- peak -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("allocate", ALLOCATORS)
def test_peak_context_sees_a_freed_spike(allocate):
    with torchmem.peak() as p:
        entry = torchmem.stats(uss=False).rss_bytes
        block = allocate(96 * MIB)
        # A spike that lives a few of the watcher's periods (a freed activation, a temporary copy): seen
        # to 4 MiB although the process's earlier peak (the suite's) may be far higher than this window's.
        time.sleep(0.03)
        del block
        exit_rss = torchmem.stats(uss=False).rss_bytes
    assert exit_rss < entry + 48 * MIB, "the spike was freed"
    assert p.rss_bytes >= entry + 96 * MIB - 4 * MIB, (p.rss_bytes, entry)
    assert p.allocated_bytes is None if not CUDA else p.allocated_bytes is not None
    assert "CPU RSS" in str(p)


def test_nested_peak_windows_and_global_peak_stay_exact():
    torchmem.reset_peak()
    with torchmem.peak() as outer:
        block = allocate_torch(128 * MIB)
        del block
        base = torchmem.stats(uss=False).rss_bytes
        with torchmem.peak() as inner:  # resets the kernel's peak RSS: the outer window must keep its spike
            # fresh pages (mmap): a 16 MiB torch tensor may land on heap pages glibc kept resident (flaky before)
            small = allocate_mmap(16 * MIB)
            small.close()
    assert inner.rss_bytes < base + 64 * MIB, "the inner window starts after the big spike"
    assert inner.rss_bytes >= base + 16 * MIB - 4 * MIB
    assert outer.rss_bytes >= base + 128 * MIB - 8 * MIB, (outer.rss_bytes, base)
    assert torchmem.peak().rss_bytes >= outer.rss_bytes


def test_reset_peak_starts_a_new_period():
    block = allocate_torch(128 * MIB)
    del block
    spiked = torchmem.peak().rss_bytes
    torchmem.reset_peak()
    now = torchmem.stats(uss=False).rss_bytes
    after = torchmem.peak().rss_bytes
    assert after < spiked - 64 * MIB, (after, spiked)
    assert after >= now - MIB


# --- empty_cache ------------------------------------------------------------------------------------------


# --- track ------------------------------------------------------------------------------------------------


def test_track_context_records_entry_exit_peak_and_delta():
    # Fresh pages (allocate_mmap): a heap region an earlier test of this worker freed can serve a numpy
    # array without raising RSS (failed once in 250 tests under -n 2).
    with torchmem.track("load") as t:
        kept = allocate_mmap(64 * MIB)
        spike = allocate_mmap(64 * MIB)
        spike.close()
        del spike
    r = t.result
    assert r.name == "load" and r.duration_ns > 0
    assert r.delta_rss_bytes >= 64 * MIB - 2 * MIB
    assert r.peak_rss_bytes >= r.entry["rss_bytes"] + 128 * MIB - 4 * MIB
    assert r.delta_allocated_bytes is None if not CUDA else r.delta_allocated_bytes is not None
    assert "load" in str(t) and "CPU RSS" in str(r)
    del kept


def test_track_decorator_returns_the_value_and_keeps_each_run():
    @torchmem.track("make")
    def make(n_mib: int):
        return allocate_mmap(n_mib * MIB)

    a = make(48)
    assert len(a) == 48 * MIB
    assert make.last.delta_rss_bytes >= 46 * MIB
    make(40)
    assert len(make.history) == 2
    assert make.__name__ == "make"


# --- device_info ------------------------------------------------------------------------------------------


def test_device_info_reports_host_and_says_why_there_is_no_gpu():
    info = torchmem.device_info()
    assert info["host_total_bytes"] >= info["host_available_bytes"] > 0
    assert info["torch_version"].startswith(torch.__version__.split("+")[0])
    if not CUDA:
        assert info["devices"] == [] or info["nvml_error"] is None
        if info["devices"] == []:
            assert info["nvml_error"] is None or "NVML" in info["nvml_error"]
    for d in info["devices"]:
        assert d["total_bytes"] >= d["free_bytes"] and d["name"]


# --- the allocator sampler --------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_sampler_rejects_bad_intervals(bad):
    with pytest.raises(ValueError, match="interval_ms"):
        _native.start_allocator_sampler(bad)


FAKE_TORCH = """
import sys, types, time
# A FAKE torch module (named as such): it only gives the sampler thread CUDA-shaped counters to send, so that
# the thread, the pipe and the wire format are tested here; tests/gpu/test_gpu_api.py checks real numbers.
fake = types.ModuleType("torch")
fake.cuda = types.SimpleNamespace(is_initialized=lambda: True, device_count=lambda: 2)
calls = []
def fake_memory_stats(dev):
    calls.append(dev)
    if dev == 1:
        zero = {"all": {"current": 0, "peak": 0}}
        return {"allocated_bytes": zero, "reserved_bytes": zero}
    n = len(calls)
    return {
        "allocated_bytes": {"all": {"current": 1000 * n, "peak": 5000 * n}},
        "reserved_bytes": {"all": {"current": 2 << 20, "peak": 4 << 20}},
        "active_bytes": {"all": {"current": 1500}},
        "inactive_split_bytes": {"all": {"current": 512}},
        "num_alloc_retries": 0, "num_ooms": 0,
    }
fake._C = types.SimpleNamespace(_cuda_memoryStats=fake_memory_stats)
sys.modules["torch"] = fake
import torchmem._native as n
assert n.start_allocator_sampler(5.0)
time.sleep(0.3)
"""


@pytest.mark.parametrize("stop", ["atexit", "explicit"])
def test_sampler_streams_counters_of_used_devices(stop):
    code = FAKE_TORCH + (
        "print(n.stop_allocator_sampler(), n.allocator_sampler_running())\n"
        if stop == "explicit"
        else "print('exit')\n"
    )
    proc, lines = run_with_recorder_pipe(code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    torch_lines = [m for m in lines if m["type"] == "torch"]
    assert len(torch_lines) >= 10, len(torch_lines)  # 5 ms period over 0.3 s
    assert {m["device"] for m in torch_lines} == {0}, "a device whose allocator was never used is skipped"
    first = torch_lines[0]
    assert first["reserved"] == 2 << 20 and first["peak_reserved"] == 4 << 20
    assert first["active"] == 1500 and first["inactive_split"] == 512
    assert first["peak_allocated"] == 5 * first["allocated"]
    times = [m["t_ns"] for m in torch_lines]
    assert times == sorted(times)
    if stop == "explicit":
        assert proc.stdout.split() == ["True", "False"]


def test_read_allocator_once_is_empty_without_cuda():
    assert _native.read_allocator_once() == [] or torch.cuda.is_initialized()


# --- the typed records of the extension (issue 9: no positional tuples across PyO3) ----------------------

# A hand-built dict in the shape of `torch._C._cuda_memoryStats(dev)` (not torch's): each counter the sampler
# reads has its own value, and the pools and keys beside them must not be read.
NESTED_STATS = {
    "allocated_bytes": {"all": {"current": 11, "peak": 33, "allocated": 901}, "large_pool": {"current": 1}},
    "reserved_bytes": {"all": {"current": 22, "peak": 44, "freed": 902}, "small_pool": {"peak": 2}},
    "active_bytes": {"all": {"current": 55, "peak": 903}},
    "inactive_split_bytes": {"all": {"current": 66, "peak": 904}},
    "requested_bytes": {"all": {"current": 905}},
    "num_alloc_retries": 7,
    "num_ooms": 8,
    "num_device_alloc": 906,
}


def test_allocator_counters_name_each_counter_of_the_nested_dict():
    c = _native.allocator_counters(NESTED_STATS)
    want = {
        "allocated_bytes": 11,
        "reserved_bytes": 22,
        "peak_allocated_bytes": 33,
        "peak_reserved_bytes": 44,
        "active_bytes": 55,
        "inactive_split_bytes": 66,
        "num_alloc_retries": 7,
        "num_ooms": 8,
    }
    assert {k for k in dir(c) if not k.startswith("_")} == set(want)
    assert {k: getattr(c, k) for k in want} == want
    assert repr(c) == (
        "AllocatorCounters(allocated_bytes=11, reserved_bytes=22, peak_allocated_bytes=33, peak_reserved_bytes=44, "
        "active_bytes=55, inactive_split_bytes=66, num_alloc_retries=7, num_ooms=8)"
    )
    assert type(c) is _native.AllocatorCounters and type(c).__module__ == "torchmem._native"
    assert c == _native.allocator_counters(NESTED_STATS) and c != _ledger.NO_COUNTERS
    # Missing keys, negative or non-integer values read as 0: the record of an allocator that holds nothing.
    broken = {"allocated_bytes": {"all": {"current": -5}}, "reserved_bytes": {"all": "?"}, "num_ooms": None}
    assert _native.allocator_counters({}) == _native.allocator_counters(broken) == _ledger.NO_COUNTERS
    assert {getattr(_ledger.NO_COUNTERS, k) for k in want} == {0}


def test_the_records_are_immutable():
    c = _native.allocator_counters(NESTED_STATS)
    r = _native.NvmlReading(total_bytes=1, used_bytes=2, free_bytes=3, process_bytes=None, other_processes_bytes=4)
    for record, field in [(c, "allocated_bytes"), (c, "num_ooms"), (r, "process_bytes"), (r, "total_bytes")]:
        with pytest.raises(AttributeError):
            setattr(record, field, 0)
        with pytest.raises(AttributeError):
            delattr(record, field)
    with pytest.raises(AttributeError):
        c.extra = 1  # no __dict__: nothing can be added either
    with pytest.raises(TypeError):
        _native.AllocatorCounters()  # made only from the allocator's dict
    with pytest.raises(TypeError):
        _native.NvmlReading(1, 2, 3, None, 4)  # keyword-only: the fields cannot be given out of order


def test_nvml_reading_names_its_fields():
    r = _native.NvmlReading(total_bytes=80, used_bytes=30, free_bytes=50, process_bytes=None, other_processes_bytes=9)
    assert {k for k in dir(r) if not k.startswith("_")} == {
        "total_bytes",
        "used_bytes",
        "free_bytes",
        "process_bytes",
        "other_processes_bytes",
    }
    got = (r.total_bytes, r.used_bytes, r.free_bytes, r.process_bytes, r.other_processes_bytes)
    assert got == (80, 30, 50, None, 9)
    assert repr(r) == (
        "NvmlReading(total_bytes=80, used_bytes=30, free_bytes=50, process_bytes=None, other_processes_bytes=9)"
    )
    mine = _native.NvmlReading(total_bytes=80, used_bytes=30, free_bytes=50, process_bytes=21, other_processes_bytes=9)
    assert "process_bytes=21," in repr(mine) and mine != r
    if _native.nvml_error() is not None:
        with pytest.raises(_native.TorchmemError, match="NVML"):
            _native.nvml_read(0, os.getpid())
    else:
        real = _native.nvml_read(0, os.getpid())
        assert type(real) is _native.NvmlReading and 0 < real.used_bytes <= real.total_bytes


def _status_kib(field: str) -> int:
    """One `VmRSS:`-style line of /proc/self/status, in KiB."""
    line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field + ":"))
    return int(line.split()[1])


def test_this_process_memory_comes_as_named_records_that_follow_proc():
    """`self_memory` and `self_rollup` return frozen records named by field (no positional tuples), and their
    numbers are /proc's for the same moment: 64 MiB touched shows in RSS, peak RSS, USS and PSS."""
    before = _native.self_memory()
    assert type(before) is _native.SelfMemory and type(before).__module__ == "torchmem._native"
    assert {k for k in dir(before) if not k.startswith("_")} == {"rss_bytes", "peak_rss_bytes"}
    assert repr(before) == f"SelfMemory(rss_bytes={before.rss_bytes}, peak_rss_bytes={before.peak_rss_bytes})"
    held = bytearray(64 * MIB)
    held[::4096] = b"x" * (len(held) // 4096)  # touch every page
    mem, rss_kib, hwm_kib = _native.self_memory(), _status_kib("VmRSS"), _status_kib("VmHWM")
    assert abs(mem.rss_bytes - rss_kib * 1024) < 4 * MIB and abs(mem.peak_rss_bytes - hwm_kib * 1024) < 4 * MIB
    assert mem.rss_bytes >= before.rss_bytes + 60 * MIB and mem.peak_rss_bytes >= mem.rss_bytes
    roll = _native.self_rollup()
    assert type(roll) is _native.SmapsRollup
    assert {k for k in dir(roll) if not k.startswith("_")} == {"rss_bytes", "pss_bytes", "uss_bytes", "swap_bytes"}
    assert repr(roll).startswith(f"SmapsRollup(rss_bytes={roll.rss_bytes}, pss_bytes={roll.pss_bytes}, uss_bytes=")
    # The 64 MiB are private: in USS and PSS alike; shared libraries make RSS >= PSS >= USS.
    assert roll.rss_bytes >= roll.pss_bytes >= roll.uss_bytes >= 60 * MIB and roll.swap_bytes >= 0
    assert abs(roll.rss_bytes - mem.rss_bytes) < 8 * MIB
    for record, field in [(mem, "rss_bytes"), (roll, "uss_bytes")]:
        with pytest.raises(AttributeError):
            setattr(record, field, 0)
    with pytest.raises(TypeError):
        _native.SelfMemory()  # made only by self_memory
    assert mem == mem and mem != before
    del held


def test_track_repr_names_the_phase_and_its_runs():
    t = torchmem.track("load")
    assert repr(t) == "<torchmem.track 'load': 0 runs>"
    with t:
        pass
    assert repr(t).startswith("<torchmem.track 'load': 1 run, last load (")
