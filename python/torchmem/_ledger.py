"""The peak ledger: the one place where torchmem resets peak counters, so that no reset is seen by any other
reader. Exact window peaks need resets (PyTorch's allocator peaks): a window opening at time t must read
"the peak since t". Without a ledger each reset changes what the program itself reads afterwards
(`torch.cuda.max_memory_allocated()`).

The CPU's peak RSS is never reset in the kernel (`VmHWM`, `ru_maxrss` stay the program's): its resets are
those of torchmem's own counter (`_native.rss_period_restart`, `sources/self_proc.rs`), exact when the
kernel's high-water mark rose inside the period, else the highest RSS read at the edges and sampled every
5 ms by a watcher thread while a window is open (`_native.watch_rss`).

Readers and what each sees:
- torchmem's open windows (`with peak()`, `track`, Monitor phases/steps/epochs): the peak since they opened;
- `torchmem.peak()` / `Stats.peak_*`: the peak since `torchmem.reset_peak()` (or start);
- the line profiler (Rust, `line_fold_gpu_peak`): the peak since its own last read;
- `torchmem run`'s allocator sampler (Rust, `sampler_fold_peak`): a sample's peak includes what resets took
  since the previous sample;
- the program: the peak since its own last `torch.cuda.reset_peak_memory_stats()` (or start), for every `peak`
  stat of every pool (Rust, `program_peaks_*`); its lifetime peak RSS is the kernel's, untouched.
Each reader sees `max(what was folded into it, the counter now)`. Before any real reset (torchmem's or the
program's) the current peaks are folded into every reader; the program's reset clears only the program's.

Python readers of the allocator all call `torch._C._cuda_memoryStats` / `_cuda_resetPeakMemoryStats` (and
`torch.accelerator`'s `_accelerator_getDeviceStats` / `_accelerator_resetPeakStats`) by attribute at call time,
so those attributes are wrapped once, when torchmem first resets a GPU peak. torchmem itself always calls the
allocator's own functions (`raw_stats`). What cannot be kept (a C++ reader, a function bound before the wrap)
is listed in docs/python-api.md, "What torchmem changes in your process".
"""
from __future__ import annotations

import functools
import operator
import sys
import threading
from typing import Any

from . import _native

#: Serialises folds and resets (the program's wrapped reset takes it too).
lock = threading.RLock()


class Window:
    """The maxima folded into one open peak window (values read before a counter reset)."""

    __slots__ = ("dev", "alloc", "reserved", "rss")

    def __init__(self, dev: int | None) -> None:
        self.dev = dev
        self.alloc = 0
        self.reserved = 0
        self.rss = 0


#: torchmem's open windows.
windows: list[Window] = []
#: `torchmem.peak()`'s reader: device -> (allocated, reserved) folded since `torchmem.reset_peak()`.
gpu_acc: dict[int, tuple[int, int]] = {}
rss_acc = 0

# --- the allocator's own functions ------------------------------------------------------------------------

_RAW_ATTR = "_torchmem_raw"


def _raw(fn: Any) -> Any:
    return getattr(fn, _RAW_ATTR, fn)


def raw_stats(torch: Any) -> Any:
    """The allocator's own `torch._C._cuda_memoryStats` (never the program's view)."""
    return _raw(torch._C._cuda_memoryStats)


def cuda_initialized(torch: Any) -> bool:
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


#: The counters of an allocator that holds nothing (every field 0: a dict without keys reads as 0).
NO_COUNTERS: _native.AllocatorCounters = _native.allocator_counters({})


def counters(torch: Any, dev: int) -> _native.AllocatorCounters | None:
    """Device `dev`'s allocator counters as the allocator holds them now, or None before CUDA is initialised
    (the allocator then holds nothing: `NO_COUNTERS`)."""
    if not cuda_initialized(torch):
        return None
    return _native.allocator_counters(raw_stats(torch)(dev))


# --- folding and resetting --------------------------------------------------------------------------------


def _fold_gpu_into_torchmem(dev: int, c: _native.AllocatorCounters, *, line_profiler: bool = True) -> None:
    peak_alloc, peak_reserved = c.peak_allocated_bytes, c.peak_reserved_bytes
    for w in windows:
        if w.dev == dev:
            w.alloc = max(w.alloc, peak_alloc)
            w.reserved = max(w.reserved, peak_reserved)
    a, r = gpu_acc.get(dev, (0, 0))
    gpu_acc[dev] = (max(a, peak_alloc), max(r, peak_reserved))
    _native.sampler_fold_peak(dev, peak_alloc, peak_reserved)  # `torchmem run`'s allocator timeline keeps the spike
    if line_profiler:
        _native.line_fold_gpu_peak(dev, peak_alloc)


def _fold_and_reset_gpu(torch: Any, dev: int, *, line_profiler: bool = True) -> _native.AllocatorCounters | None:
    """Folds device `dev`'s peaks into every reader, then resets the allocator's peak counters. Returns the
    counters read before the reset (None before CUDA is initialised: nothing to reset)."""
    # Wrapped from the first window on a CUDA device, even before CUDA starts: a program reset inside it
    # must be folded into the window too.
    _install_gpu_wrappers(torch)
    if not cuda_initialized(torch):
        return None
    nested = raw_stats(torch)(dev)
    c = _native.allocator_counters(nested)
    _native.program_peaks_fold(dev, nested)
    _fold_gpu_into_torchmem(dev, c, line_profiler=line_profiler)
    _raw(torch._C._cuda_resetPeakMemoryStats)(dev)
    return c


def fold_and_reset(torch: Any, dev: int | None) -> tuple[int | None, _native.AllocatorCounters | None]:
    """Folds the current peaks (device `dev` and the peak RSS) into every reader, then resets the counters.
    Returns the (rss, counters) read before the reset."""
    global rss_acc
    with lock:
        mem = _native.rss_period_restart()  # torchmem's own counter: the kernel's VmHWM is never reset
        rss, rss_peak = (mem.rss_bytes, mem.peak_rss_bytes) if mem else (None, 0)
        for w in windows:
            w.rss = max(w.rss, rss_peak)
        rss_acc = max(rss_acc, rss_peak)
        c = _fold_and_reset_gpu(torch, dev) if (torch is not None and dev is not None) else None
        return rss, c


def line_profiler_reset(dev: int) -> None:
    """The line profiler's reset: folds into every reader but the line profiler (which has just read the
    peak itself), then resets."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with lock:
            _fold_and_reset_gpu(torch, dev, line_profiler=False)


def open_window(torch: Any, dev: int | None) -> tuple[Window, int | None, _native.AllocatorCounters | None]:
    """Opens a window on device `dev` (None: the CPU only): (the window, rss now, counters now or None)."""
    with lock:
        rss, c = fold_and_reset(torch, dev)
        w = Window(dev)
        if rss is not None:
            w.rss = rss
        if c is not None:
            w.alloc, w.reserved = c.allocated_bytes, c.reserved_bytes
        windows.append(w)
        _native.watch_rss(len(windows))
        return w, rss, c


def close_window(
    torch: Any, w: Window
) -> tuple[int | None, int | None, int | None, int | None, _native.AllocatorCounters | None]:
    """Ends a window: (peak_rss, peak_allocated, peak_reserved, rss now, counters now)."""
    with lock:
        mem = _native.rss_period_peak()
        c = counters(torch, w.dev) if (torch is not None and w.dev is not None) else None
        if w in windows:
            windows.remove(w)
            _native.watch_rss(len(windows))
        rss = mem.rss_bytes if mem else None
        peak_rss = None
        if mem:
            peak_rss = max(w.rss, mem.peak_rss_bytes)
        if c is not None:
            peak_alloc, peak_reserved = max(w.alloc, c.peak_allocated_bytes), max(w.reserved, c.peak_reserved_bytes)
        elif w.dev is None:
            peak_alloc = peak_reserved = None
        else:
            peak_alloc, peak_reserved = w.alloc, w.reserved
        return peak_rss, peak_alloc, peak_reserved, rss, c


def reset_torchmem_peak(torch: Any, dev: int | None) -> None:
    """`torchmem.reset_peak()`: a new period for `torchmem.peak()` only (windows and the program keep theirs)."""
    global rss_acc
    with lock:
        fold_and_reset(torch, dev)
        if dev is not None:
            gpu_acc.pop(dev, None)
        mem = _native.self_rss_bytes()
        rss_acc = mem or 0


# --- the program's view: wrapped allocator bindings -------------------------------------------------------

_gpu_wrapped = False


def _device_key(device: Any) -> int | None:
    try:
        return operator.index(device)
    except TypeError:
        return None


def _stats_wrapper(raw: Any) -> Any:
    @functools.wraps(raw)
    def stats(device: Any) -> Any:
        nested = raw(device)
        dev = _device_key(device)
        return nested if dev is None else _native.program_peaks_apply(dev, nested)

    setattr(stats, _RAW_ATTR, raw)
    return stats


def _reset_wrapper(raw: Any, raw_stats_fn: Any) -> Any:
    @functools.wraps(raw)
    def reset(device: Any) -> Any:
        dev = _device_key(device)
        if dev is None:
            return raw(device)
        with lock:
            try:
                nested = raw_stats_fn(dev)
            except Exception:
                return raw(device)  # the allocator's own error for this device, as without torchmem
            # The program's reset: torchmem's readers keep what the counters held; the program starts over.
            _fold_gpu_into_torchmem(dev, _native.allocator_counters(nested))
            result = raw(device)
            _native.program_peaks_clear(dev)
            return result

    setattr(reset, _RAW_ATTR, raw)
    return reset


def _install_gpu_wrappers(torch: Any) -> None:
    """Wraps torch's allocator bindings once, so every Python reader sees the program's view."""
    global _gpu_wrapped
    if _gpu_wrapped:
        return
    _gpu_wrapped = True
    C = torch._C
    if not (hasattr(C, "_cuda_memoryStats") and hasattr(C, "_cuda_resetPeakMemoryStats")):
        return  # a torch built without CUDA: nothing of ours to hide
    raw_cuda_stats = _raw(C._cuda_memoryStats)
    C._cuda_memoryStats = _stats_wrapper(raw_cuda_stats)
    C._cuda_resetPeakMemoryStats = _reset_wrapper(_raw(C._cuda_resetPeakMemoryStats), raw_cuda_stats)
    # torch.accelerator's readers (torch >= 2.8) reach the same CUDA counters through their own bindings.
    acc_stats = getattr(C, "_accelerator_getDeviceStats", None)
    acc_reset = getattr(C, "_accelerator_resetPeakStats", None)
    if acc_stats is not None and acc_reset is not None and _accelerator_is_cuda(torch):
        C._accelerator_getDeviceStats = _stats_wrapper(_raw(acc_stats))
        C._accelerator_resetPeakStats = _reset_wrapper(_raw(acc_reset), raw_cuda_stats)


def _accelerator_is_cuda(torch: Any) -> bool:
    try:
        acc = torch.accelerator.current_accelerator()
        return acc is not None and acc.type == "cuda"
    except Exception:
        return False
