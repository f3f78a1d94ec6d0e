"""The in-process API seen from child processes (moved from tests/unit/test_api.py, issue 27 item 5): markers on
the recorder's real pipe in wire form, `empty_cache` on a fresh heap, torchmem without torch, and the allocator
sampler's start and stop, each in a real child Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from children import run_python, run_with_recorder_pipe

MIB = 1 << 20
CUDA = torch.cuda.is_available()


def test_empty_cache_gives_back_fragmented_heap_on_cpu():
    # 1 KiB objects live in glibc's heap; a survivor at the top stops free() from shrinking it, so only
    # malloc_trim (what empty_cache does on the CPU) returns the freed middle to the kernel. In a child, so
    # that the heap left behind does not change what later tests measure.
    proc = run_python(
        """
        import json, torchmem
        blocks = [bytearray(1024) for _ in range(150_000)]
        for b in blocks:
            b[0] = 1
        survivor = bytearray(1024)
        del blocks
        released = torchmem.empty_cache()
        print(json.dumps(released.to_dict()))
        print(released)
        """
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.splitlines()[0])
    assert data["device"] is None and data["reserved_before_bytes"] is None
    assert data["released_rss_bytes"] >= 32 * MIB, proc.stdout
    assert data["released_rss_bytes"] == data["rss_before_bytes"] - data["rss_after_bytes"]
    assert "empty_cache: CPU RSS" in proc.stdout


def test_markers_reach_the_recorder_pipe_in_wire_form():
    proc, lines = run_with_recorder_pipe(
        """
        import numpy as np, torchmem
        torchmem.device_info()
        with torchmem.track("load"):
            a = np.ones(32 << 20, dtype=np.uint8)
        torchmem.empty_cache()
        """
    )
    assert proc.returncode == 0, proc.stderr
    markers = [m for m in lines if m["type"] == "marker"]
    names = [(m["kind"], m["edge"], m["name"]) for m in markers]
    assert names == [
        ("mark", "point", "Device checked"),
        ("phase", "start", "load"),
        ("phase", "end", "load"),
        ("mark", "point", "Cache emptied"),
    ], names
    times = [m["t_ns"] for m in markers]
    assert times == sorted(times)
    end = markers[2]["memory"]
    assert set(end) <= {
        "rss_bytes",
        "allocated_bytes",
        "reserved_bytes",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "peak_rss_bytes",
    }
    assert end["rss_bytes"] - markers[1]["memory"]["rss_bytes"] >= 30 * MIB
    assert end["peak_rss_bytes"] >= end["rss_bytes"]


def test_without_torch_everything_still_works():
    proc = run_python(
        """
        import sys, builtins
        real_import = builtins.__import__
        def blocked(name, *a, **k):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return real_import(name, *a, **k)
        builtins.__import__ = blocked
        sys.modules["torch"] = None
        import torchmem
        assert "torch" not in sys.modules or sys.modules["torch"] is None
        s = torchmem.stats()
        assert s.device is None and s.allocated_bytes is None and s.rss_bytes > 0, s
        info = torchmem.device_info()
        assert info["host_total_bytes"] > 0 and info["torch_cuda_available"] is None
        with torchmem.peak() as p:
            x = bytearray(32 << 20)
        assert p.rss_bytes > 32 << 20 and p.allocated_bytes is None
        with torchmem.track("t") as t:
            pass
        r = torchmem.empty_cache()
        assert r.device is None
        mon = torchmem.Monitor()
        with mon.epoch():
            with mon.step():
                y = bytearray(1 << 20)
        assert "epoch" in mon.summary()
        print("OK", str(s).splitlines()[0])
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "OK GPU: no CUDA device in use" in proc.stdout


def test_sampler_needs_the_recorder_pipe():
    env = {k: v for k, v in os.environ.items() if k != "TORCHMEM_EVENT_FD"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torchmem._native as n; print(n.start_allocator_sampler(5.0), n.allocator_sampler_running())",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.stdout.split() == ["False", "False"], proc.stderr


def test_sampler_stays_silent_without_cuda_and_stops_at_exit():
    proc, lines = run_with_recorder_pipe(
        """
        import time, torch, torchmem._native as n
        assert n.start_allocator_sampler(2.0) and n.allocator_sampler_running()
        assert n.start_allocator_sampler(2.0)  # idempotent
        x = torch.ones(1 << 20)
        time.sleep(0.2)
        assert not torch.cuda.is_initialized(), "the sampler must never initialise CUDA"
        print("alive")
        """,
        timeout=60,
    )
    assert proc.returncode == 0 and "alive" in proc.stdout, proc.stderr
    assert [m for m in lines if m["type"] == "torch"] == []
