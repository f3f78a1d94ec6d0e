"""torchmem must be invisible to the program's own memory readings (issue 8 §1, issue 28 item 6): the
Monitor, `peak()`, `track()`, the line profiler and `torchmem run`'s automatic watch measure window peaks, and
the program still reads its own peaks exactly as without torchmem.

- CPU, real torch, real `getrusage`, real /proc: a program that touched 600 MiB before its loop reads its
  own `ru_maxrss` and `VmHWM` (/proc/self/status) after a loop watched by each torchmem window kind (and
  under `torchmem run`); they must never go down, and must equal a run of the same program without
  torchmem. torchmem never resets the kernel's high-water mark (no `/proc/self/clear_refs` write): its window
  RSS peaks come from its own counter (`sources/self_proc.rs`, "torchmem's own peak RSS").
- GPU logic on the CPU: real torch's Python readers (`torch.cuda.max_memory_allocated`, `memory_stats`,
  `memory_summary`, `reset_peak_memory_stats`, ...) over a FakeCudaAllocator, a named fake of the CUDA
  caching allocator's counters (current/peak per stat and pool) standing in for `torch._C`'s bindings. It
  checks the ledger's arithmetic through the real call paths; tests/gpu/test_gpu_api.py checks it on a GPU.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]
KINDS = ["monitor", "peak", "track", "line"]
#: The CPU readings also under `torchmem run` (its injected sampler and automatic watch).
RSS_KINDS = [*KINDS, "run"]

# --- CPU: ru_maxrss and VmHWM -----------------------------------------------------------------------------

RSS_PROGRAM = r"""
import json, mmap, resource, sys
from resource import getrusage as early_getrusage  # bound before torchmem's first window
import torch
import torchmem

MIB = 1 << 20
kind = sys.argv[1]

def vm_hwm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024

# Touch 600 MiB before the loop, then give it back: the lifetime high-water mark is set here.
m = mmap.mmap(-1, 600 * MIB)
m.write(b"\x01" * (600 * MIB))
m.close()
before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
hwm_before = vm_hwm_bytes()

model = torch.nn.Linear(64, 64)
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def step():
    loss = model(torch.randn(32, 64)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return bytearray(4 * MIB)  # a little RSS inside each window, so the windows have something to reset

window_rss = None
if kind in ("none", "run"):  # "run": the same loop, under `torchmem run` (its automatic watch)
    for _ in range(5):
        step()
elif kind == "monitor":
    mon = torchmem.Monitor(model, opt, verbose=False)
    with mon.epoch():
        for _ in range(5):
            with mon.step():
                step()
elif kind == "peak":
    for _ in range(5):
        with torchmem.peak() as p:
            step()
    window_rss = p.rss_bytes
elif kind == "track":
    t = torchmem.track("step")
    for _ in range(5):
        with t:
            step()
    window_rss = t.result.peak_rss_bytes
elif kind == "line":
    @torchmem.profile
    def loop():
        for _ in range(5):
            step()
    loop()
    # The line profiler reads RSS, not its peak: a window inside the profiled code too.
    @torchmem.profile
    def windowed():
        with torchmem.peak():
            step()
    windowed()

ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({
    "before_kib": before_kib,
    "after_kib": ru.ru_maxrss,
    "after_type": type(ru).__name__,
    "thread_kib": resource.getrusage(resource.RUSAGE_THREAD).ru_maxrss,
    "early_bound_kib": early_getrusage(resource.RUSAGE_SELF).ru_maxrss,
    "hwm_before": hwm_before,
    "hwm_after": vm_hwm_bytes(),
    "window_rss": window_rss,
}))
"""


def last_json(stdout: str) -> dict:
    """The child's JSON line (the line profiler prints its tables after it, at exit)."""
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


@functools.cache
def run_rss_program(kind: str, tmp: str = "") -> dict:
    if kind == "run":  # the plain loop under `torchmem run`: the injected sampler and the automatic watch
        script = Path(tmp) / "rss_program.py"
        script.write_text(RSS_PROGRAM)
        cmd = [sys.executable, "-m", "torchmem", "run", "-q", "-f", "-o", str(Path(tmp) / "rss.sqlite"), "--"]
        cmd += [str(script), kind]
    else:
        cmd = [sys.executable, "-c", RSS_PROGRAM, kind]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json(proc.stdout)


@pytest.fixture(scope="module")
def rss_tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("rss"))


@pytest.fixture(scope="module")
def without_torchmem() -> dict:
    return run_rss_program("none")


@pytest.mark.parametrize("kind", RSS_KINDS)
def test_ru_maxrss_reads_as_without_torchmem(kind: str, without_torchmem: dict, rss_tmp: str) -> None:
    r = run_rss_program(kind, rss_tmp)
    assert r["after_type"] == "struct_rusage"
    # The lifetime high-water mark never goes down: not after any number of torchmem windows.
    assert r["after_kib"] >= r["before_kib"], r
    assert r["thread_kib"] >= r["before_kib"], r
    # And it is what the same program reads without torchmem (the loop adds little to a 600 MiB spike; the
    # two processes differ by what torchmem's own import and windows touch).
    assert abs(r["after_kib"] - without_torchmem["after_kib"]) * 1024 < 32 * MIB, (r, without_torchmem)


@pytest.mark.parametrize("kind", RSS_KINDS)
def test_vm_hwm_reads_as_without_torchmem(kind: str, without_torchmem: dict, rss_tmp: str) -> None:
    """Issue 28 item 6: `VmHWM` in /proc/self/status is the kernel's own counter; torchmem never resets it,
    so the program reads its lifetime peak RSS as bare (it fell from 1125 to 689 MiB under a Monitor)."""
    r = run_rss_program(kind, rss_tmp)
    assert r["hwm_after"] >= r["hwm_before"], r
    # The bare run's value, within what torchmem's own import, windows and sampler thread touch.
    assert abs(r["hwm_after"] - without_torchmem["hwm_after"]) < 16 * MIB, (r, without_torchmem)
    assert abs(r["early_bound_kib"] - r["after_kib"]) * 1024 < 4 * MIB, r


@pytest.mark.parametrize("kind", ["monitor", "peak", "track"])
def test_window_peak_rss_stays_exact(kind: str, rss_tmp: str) -> None:
    """Each window's RSS peak is its own, far below the 600 MiB spike before the loop (which the program's
    ru_maxrss and VmHWM keep)."""
    r = run_rss_program(kind, rss_tmp)
    if r["window_rss"] is not None:
        assert r["window_rss"] < r["hwm_before"] - 300 * MIB, r


def test_window_peak_rss_sees_a_spike_below_the_lifetime_peak() -> None:
    """A window whose spike stays below the process's lifetime high-water mark (so VmHWM does not move):
    torchmem's RSS watcher samples it while the window is open; the program's VmHWM is untouched."""
    code = r"""
import mmap, time, torchmem
MIB = 1 << 20
def hwm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
m = mmap.mmap(-1, 600 * MIB); m.write(b"\x01" * (600 * MIB)); m.close()
h0 = hwm()
with torchmem.peak() as outer:
    with torchmem.peak() as p:
        start = torchmem.stats().rss_bytes
        m = mmap.mmap(-1, 200 * MIB)
        for off in range(0, 200 * MIB, 4096):
            m[off] = 1
        time.sleep(0.05)
        m.close()
    with torchmem.peak() as after:
        time.sleep(0.01)
print(start, p.rss_bytes, outer.rss_bytes, after.rss_bytes, h0, hwm())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    start, inner, outer, after, h0, h1 = map(int, proc.stdout.split())
    assert inner >= start + 190 * MIB, (start, inner)
    assert inner < h0 - 300 * MIB, (inner, h0)  # its own peak, not the lifetime one
    assert outer >= inner and after < inner - 150 * MIB, (outer, inner, after)
    assert h1 == h0, (h0, h1)


def test_torchmem_never_replaces_getrusage() -> None:
    """With no reset of the kernel's peak there is nothing to hide: `resource.getrusage` stays the C
    function after every window kind."""
    code = r"""
import resource, torchmem
orig = resource.getrusage
big = bytearray(b"\x01" * (200 << 20)); del big
with torchmem.peak():
    pass
with torchmem.track("x"):
    pass
torchmem.reset_peak(); torchmem.peak(); torchmem.stats()
assert resource.getrusage is orig, resource.getrusage
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


# --- GPU logic over a FakeCudaAllocator, through torch's real Python readers --------------------------------

FAKE_CUDA = r"""
import torch

GIB = 1 << 30
STATS = ("allocation", "allocated_bytes", "segment", "reserved_bytes", "active", "active_bytes",
         "inactive_split", "inactive_split_bytes", "requested_bytes")
POOLS = ("all", "large_pool", "small_pool")


class FakeCudaAllocator:
    '''A fake of the CUDA caching allocator's counters (not a GPU): current and peak of every stat and pool,
    peaks reset to current by reset_peak(), the dict shaped as torch._C._cuda_memoryStats returns it.'''

    def __init__(self):
        self.cur = {(s, p): 0 for s in STATS for p in POOLS}
        self.peak = dict(self.cur)
        self.total = dict(self.cur)
        self.blocks = {}
        self.resets = 0

    def _add(self, stat, pool, n):
        for p in ("all", pool):
            self.cur[(stat, p)] += n
            self.peak[(stat, p)] = max(self.peak[(stat, p)], self.cur[(stat, p)])
            if n > 0:
                self.total[(stat, p)] += n

    def alloc(self, nbytes):
        pool = "large_pool" if nbytes >= (1 << 20) else "small_pool"
        handle = len(self.blocks) + 1
        self.blocks[handle] = (nbytes, pool)
        for stat, n in (("allocation", 1), ("allocated_bytes", nbytes), ("active", 1), ("active_bytes", nbytes),
                        ("requested_bytes", nbytes)):
            self._add(stat, pool, n)
        if self.cur[("reserved_bytes", pool)] < self.cur[("allocated_bytes", pool)]:
            self._add("segment", pool, 1)
            self._add("reserved_bytes", pool, self.cur[("allocated_bytes", pool)] - self.cur[("reserved_bytes", pool)])
        return handle

    def free(self, handle):
        nbytes, pool = self.blocks.pop(handle)
        for stat, n in (("allocation", 1), ("allocated_bytes", nbytes), ("active", 1), ("active_bytes", nbytes),
                        ("requested_bytes", nbytes)):
            self._add(stat, pool, -n)

    def memory_stats(self, device):
        if device != 0:
            raise RuntimeError(f"Invalid device argument {device}: did you call init?")
        d = {}
        for s in STATS:
            d[s] = {p: {"current": self.cur[(s, p)], "peak": self.peak[(s, p)], "allocated": self.total[(s, p)],
                        "freed": self.total[(s, p)] - self.cur[(s, p)]} for p in POOLS}
        d["oversize_allocations"] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        d["oversize_segments"] = {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
        d["reserved_bytes_by_private_pools"] = {(0, 1): {p: {"current": 0, "peak": 0, "allocated": 0, "freed": 0}
                                                         for p in POOLS}}
        for k in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
                  "max_split_size"):
            d[k] = 0
        return d

    def reset_peak(self, device):
        if device != 0:
            raise RuntimeError(f"Invalid device argument {device}: did you call init?")
        self.resets += 1
        self.peak = dict(self.cur)


FAKE = FakeCudaAllocator()
torch._C._cuda_memoryStats = FAKE.memory_stats
torch._C._cuda_resetPeakMemoryStats = FAKE.reset_peak
torch.cuda.is_available = lambda: True
torch.cuda.is_initialized = torch.cuda.memory.is_initialized = lambda: True
torch.cuda.current_device = lambda: 0
torch.cuda.device_count = lambda: 1
"""

GPU_PROGRAM = FAKE_CUDA + r"""
import json, sys
import torchmem

kind = sys.argv[1]
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
windows = []  # (torchmem's window peak, the allocator's true peak over the window)

def true_peak_during(fn):
    '''Runs fn and returns the allocated peak the fake allocator really reached meanwhile.'''
    highest = [FAKE.cur[("allocated_bytes", "all")]]
    orig = FAKE._add
    def spy(stat, pool, n):
        orig(stat, pool, n)
        highest[0] = max(highest[0], FAKE.cur[("allocated_bytes", "all")])
    FAKE._add = spy
    try:
        fn()
    finally:
        FAKE._add = orig
    return highest[0]

def step(i):
    a = FAKE.alloc(64 << 20)
    if i == 0:  # a 2 GiB temporary in epoch 0, as in the memory guide's pattern
        t = FAKE.alloc(2 * GIB)
        FAKE.free(t)
    b = FAKE.alloc(8 << 20)
    FAKE.free(a)
    return b

keep = [FAKE.alloc(100 << 20)]
torch.cuda.reset_peak_memory_stats()  # the guide: reset before training ...

def train():
    if kind == "none":
        for i in range(4):
            keep.append(step(i))
    elif kind == "monitor":
        mon = torchmem.Monitor(model, opt, verbose=False)
        with mon.epoch():
            for i in range(4):
                with mon.step():
                    keep.append(step(i))
    elif kind == "peak":
        for i in range(4):
            with torchmem.peak() as p:
                truth = true_peak_during(lambda: keep.append(step(i)))
            windows.append((p.allocated_bytes, truth))
    elif kind == "track":
        t = torchmem.track("step")
        for i in range(4):
            with t:
                truth = true_peak_during(lambda: keep.append(step(i)))
            windows.append((t.result.peak_allocated_bytes, truth))
    elif kind == "line":
        @torchmem.profile
        def loop():
            for i in range(4):
                keep.append(step(i))
        loop()

train()
mid = {"max_allocated": torch.cuda.max_memory_allocated(0)}
# The program resets inside an open torchmem window: the window keeps the 2 GiB, the program starts over.
with torchmem.peak() as outer:
    torch.cuda.reset_max_memory_allocated(0)
    after_reset = torch.cuda.max_memory_allocated(0)
    h = FAKE.alloc(256 << 20); FAKE.free(h)
stats = torch.cuda.memory_stats(0)
print(json.dumps({
    "mid": mid,
    "after_reset": after_reset,
    "max_allocated": torch.cuda.max_memory_allocated(0),
    "max_reserved": torch.cuda.max_memory_reserved(0),
    "max_cached": torch.cuda.max_memory_cached(0),
    "peaks": {k: v for k, v in stats.items() if k.endswith(".peak")},
    "nested_peak": torch.cuda.memory_stats_as_nested_dict(0)["allocated_bytes"]["large_pool"]["peak"],
    "summary": torch.cuda.memory_summary(0),
    "outer_window": outer.allocated_bytes,
    "windows": windows,
    "torchmem_resets": FAKE.resets,
}))
"""


@functools.cache
def run_gpu_program(kind: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", GPU_PROGRAM, kind],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_json(proc.stdout)


@pytest.fixture(scope="module")
def gpu_without_torchmem() -> dict:
    return run_gpu_program("none")


@pytest.mark.parametrize("kind", KINDS)
def test_program_reads_torch_peaks_as_without_torchmem(kind: str, gpu_without_torchmem: dict) -> None:
    r, want = run_gpu_program(kind), gpu_without_torchmem
    assert r["torchmem_resets"] > 1, "torchmem never reset the fake allocator's peaks: nothing was tested"
    # the 2 GiB temporary of epoch 0, after the program's own reset before training
    assert want["mid"]["max_allocated"] >= 2 << 30
    assert r["mid"] == want["mid"]
    assert r["after_reset"] == want["after_reset"]
    for key in ("max_allocated", "max_reserved", "max_cached", "nested_peak", "summary"):
        assert r[key] == want[key], key
    assert r["peaks"] == want["peaks"]  # every *.peak key of every stat and pool
    # torchmem's own window across the program's reset keeps what happened before it
    assert r["outer_window"] >= 100 << 20
    assert r["outer_window"] == want["outer_window"]


@pytest.mark.parametrize("kind", ["peak", "track"])
def test_torchmem_window_peaks_stay_exact(kind: str) -> None:
    r = run_gpu_program(kind)
    assert r["windows"] and all(got == truth for got, truth in r["windows"]), r["windows"]


def test_stats_wrapper_is_transparent() -> None:
    """The program-view wrappers keep the allocator's errors, its signature and its dict shape, and the
    allocator's own binding stays reachable for torchmem (and the sampler) as `_torchmem_raw`."""
    code = FAKE_CUDA + r"""
import torchmem
raw_stats, raw_reset = torch._C._cuda_memoryStats, torch._C._cuda_resetPeakMemoryStats
with torchmem.peak():
    pass
assert torch._C._cuda_memoryStats is not raw_stats and torch._C._cuda_memoryStats._torchmem_raw is raw_stats
for fn in (torch._C._cuda_memoryStats, torch._C._cuda_resetPeakMemoryStats):
    try:
        fn(3)
    except RuntimeError as e:
        assert "Invalid device argument 3" in str(e)
    else:
        raise AssertionError("no error for a bad device")
a, b = torch._C._cuda_memoryStats(0), raw_stats(0)
def shape(d):
    return {k: shape(v) for k, v in d.items()} if isinstance(d, dict) else type(d).__name__
assert shape(a) == shape(b)
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_line_profiler_keeps_a_line_peak_across_another_readers_reset(tmp_path: Path) -> None:
    """A line whose call opens a torchmem window (which resets the counters) still shows the temporary
    allocated before the window opened: the ledger folds it into the line profiler's next read."""
    code = FAKE_CUDA + r"""
import json
import torchmem
from torchmem.line_profiler import profile_data

def spike_then_window():
    t = FAKE.alloc(512 << 20)
    FAKE.free(t)
    with torchmem.peak():
        pass

@torchmem.profile
def work():
    spike_then_window()
    return 1

work()
(f,) = [f for f in profile_data()["functions"] if f["name"] == "work"]
(row,) = [r for r in f["lines"] if "spike_then_window()" in r["source"]]
print(json.dumps(row))
"""
    script = tmp_path / "line_fold.py"  # a file: the line profiler shows source lines
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TORCHMEM_LINE_GATE_NS": "0"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = last_json(proc.stdout)
    assert row["gpu_peak_bytes"] == 512 << 20, row
