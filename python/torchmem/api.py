"""torchmem's in-process memory API: what the device holds (`device_info`), what PyTorch and this process use
now (`stats`), the peak over a stretch of code (`peak`, `reset_peak`, `with peak() as p`), what emptying the
cache really frees (`empty_cache`), and named phases (`track`). Numbers come from PyTorch's allocator counters
(read through `torch._C._cuda_memoryStats`, ~13 µs, instead of the ~100 µs `memory_allocated()`), from
/proc and from NVML through the Rust extension. Nothing here imports torch or creates a CUDA context.

Peaks are exact even when peak windows nest, and torchmem stays invisible to the program's own readings:
opening a window (`with peak()`, `track`, a Monitor phase) resets PyTorch's peak counters (and torchmem's own
peak-RSS counter; the kernel's is never reset) through the peak ledger (`_ledger.py`), which first folds the
peaks reached so far into every reader, the program included. `torch.cuda.max_memory_allocated()`,
`memory_stats()`'s `*.peak` keys, `resource.getrusage(RUSAGE_SELF).ru_maxrss` and `VmHWM` read as without
torchmem; what cannot be kept is listed in docs/python-api.md ("What torchmem changes in your process").
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from . import _devices, _ledger, _markers, _native, _rank

if TYPE_CHECKING:
    from ._types import TorchDeviceInfo

# --- device_info ------------------------------------------------------------------------------------------


def device_info(device: Any = None) -> TorchDeviceInfo:
    """The machine's memory: per NVIDIA device its name, total/used/free bytes from the driver (NVML), what
    this process and the other processes use on it, the driver and CUDA versions, torch's version; and the
    host's total and available RAM. Works without torch and without a GPU (then `devices` is empty and
    `nvml_error` says why). Never creates a CUDA context. `device` (int or 'cuda:N') keeps only that device.
    Also records a "Device checked" mark for the journey."""
    info = cast("TorchDeviceInfo", _native.device_info())
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch_version"] = str(getattr(torch, "__version__", "")) or None
        info["torch_cuda_version"] = getattr(getattr(torch, "version", None), "cuda", None)
    else:
        # torch's own version.py, read without importing torch: the string `torchmem info` prints too.
        from ._torch_version import read

        found = read()
        info["torch_version"] = found["torch_version"]
        info["torch_cuda_version"] = found["torch_cuda_version"]
    info["torch_cuda_available"] = _devices.cuda_available_now(torch) if _devices.imported_torch() is not None else None
    if device is not None:
        torch = _devices.imported_torch()
        dev = _devices.cuda_index(device, torch) if torch is not None else (device if isinstance(device, int) else None)
        index = _devices.nvml_index(torch, dev) if (torch is not None and dev is not None) else dev
        info["devices"] = [d for d in info["devices"] if d["index"] == index]
    _markers.last_device_check = _markers.mark_now("Device checked")
    return info


# --- stats ------------------------------------------------------------------------------------------------


def _fmt(value: int | None) -> str:
    return "-" if value is None else _native.format_bytes(value)


@dataclasses.dataclass(frozen=True)
class Stats:
    """Memory of this process at one moment, in bytes. GPU fields are None without CUDA (or before torch is
    imported); CPU fields are None where /proc is missing. Short aliases (`allocated`, `reserved`, `rss`, …)
    read the `_bytes` fields."""

    device: int | None
    #: PyTorch caching allocator (exact, from its counters).
    allocated_bytes: int | None
    reserved_bytes: int | None
    #: Peak since the last `torchmem.reset_peak()` (or start), exact across torchmem's peak windows.
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    active_bytes: int | None
    #: Free blocks inside split segments: memory `empty_cache()` cannot give back (fragmentation).
    inactive_split_bytes: int | None
    num_alloc_retries: int | None
    num_ooms: int | None
    #: NVML: what the driver charges to this process on the device (CUDA context, libraries, reserved).
    nvml_process_bytes: int | None
    #: nvml_process_bytes - reserved_bytes: the CUDA context, cuBLAS/cuDNN workspaces, other libraries.
    non_torch_bytes: int | None
    device_total_bytes: int | None
    device_free_bytes: int | None
    #: CPU: resident set (statm), unique set (private pages, smaps_rollup), proportional set.
    rss_bytes: int | None
    uss_bytes: int | None
    pss_bytes: int | None
    t_ns: int
    #: This process's place in a torchrun/Slurm job (RANK/LOCAL_RANK/WORLD_SIZE, GROUP_RANK and
    #: TORCHELASTIC_RESTART_COUNT, else SLURM_*); None outside one, and then left out of repr/str/to_dict.
    rank: int | None = dataclasses.field(default=None, repr=False)
    local_rank: int | None = dataclasses.field(default=None, repr=False)
    world_size: int | None = dataclasses.field(default=None, repr=False)
    group_rank: int | None = dataclasses.field(default=None, repr=False)
    restart_count: int | None = dataclasses.field(default=None, repr=False)

    allocated = property(lambda self: self.allocated_bytes)
    reserved = property(lambda self: self.reserved_bytes)
    peak_allocated = property(lambda self: self.peak_allocated_bytes)
    peak_reserved = property(lambda self: self.peak_reserved_bytes)
    active = property(lambda self: self.active_bytes)
    inactive_split = property(lambda self: self.inactive_split_bytes)
    rss = property(lambda self: self.rss_bytes)
    uss = property(lambda self: self.uss_bytes)
    nvml_process = property(lambda self: self.nvml_process_bytes)
    non_torch = property(lambda self: self.non_torch_bytes)

    _RANK_FIELDS = ("rank", "local_rank", "world_size", "group_rank", "restart_count")

    def to_dict(self) -> dict[str, Any]:
        """Every field; the rank fields only when set (inside a torchrun/Slurm job)."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if not (k in self._RANK_FIELDS and v is None)}

    def __repr__(self) -> str:
        shown = [f.name for f in dataclasses.fields(self) if f.repr]
        shown += [k for k in self._RANK_FIELDS if getattr(self, k) is not None]
        return f"Stats({', '.join(f'{k}={getattr(self, k)!r}' for k in shown)})"

    def rank_line(self) -> str | None:
        """'rank 1 of 4 (local rank 1, node 0, restart 1)', or None outside a distributed job."""
        if self.rank is None and self.local_rank is None:
            return None
        head = f"rank {self.rank if self.rank is not None else '?'}"
        if self.world_size is not None:
            head += f" of {self.world_size}"
        parts = [
            f"{label} {v}"
            for label, v in (
                ("local rank", self.local_rank),
                ("node", self.group_rank),
                ("restart", self.restart_count),
            )
            if v is not None
        ]
        return head + (f" ({', '.join(parts)})" if parts else "")

    def _repr_html_(self) -> str:  # Jupyter's rich display (torchmem._jupyter)
        from ._jupyter import stats_html

        return stats_html(self)

    def __str__(self) -> str:
        lines = []
        who = self.rank_line()
        if who is not None:
            lines.append(who)
        if self.device is None:
            lines.append("GPU: no CUDA device in use")
        else:
            total = f" of {_fmt(self.device_total_bytes)}" if self.device_total_bytes else ""
            lines.append(
                f"GPU {self.device}{total}: allocated {_fmt(self.allocated_bytes)}, "
                f"reserved {_fmt(self.reserved_bytes)}, peak allocated {_fmt(self.peak_allocated_bytes)}, "
                f"peak reserved {_fmt(self.peak_reserved_bytes)}"
            )
            lines.append(
                f"  active {_fmt(self.active_bytes)}, "
                f"inactive split (fragmentation) {_fmt(self.inactive_split_bytes)}, "
                f"alloc retries {self.num_alloc_retries}, OOMs {self.num_ooms}"
            )
            lines.append(
                f"  NVML this process {_fmt(self.nvml_process_bytes)} "
                f"(not PyTorch's: {_fmt(self.non_torch_bytes)}), "
                f"device free {_fmt(self.device_free_bytes)}"
            )
        lines.append(f"CPU: RSS {_fmt(self.rss_bytes)}, USS {_fmt(self.uss_bytes)}, PSS {_fmt(self.pss_bytes)}")
        return "\n".join(lines)


#: The `Stats` fields read from the GPU (the allocator's counters and NVML): all None without CUDA.
GPU_FIELDS: tuple[str, ...] = (
    "allocated_bytes",
    "reserved_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "num_alloc_retries",
    "num_ooms",
    "nvml_process_bytes",
    "non_torch_bytes",
    "device_total_bytes",
    "device_free_bytes",
)


def stats(device: Any = None, *, uss: bool = False) -> Stats:
    """This process's memory now: PyTorch's allocator counters for `device` (default: the current CUDA
    device), NVML's view of the process, and the CPU's RSS (and USS/PSS with `uss=True`). Cheap by default
    (microseconds); `uss=True` reads /proc/self/smaps_rollup, which takes milliseconds on a process of several
    GiB (otherwise `uss_bytes`/`pss_bytes` are None: not measured)."""
    torch = _devices.imported_torch()
    dev = _devices.cuda_index(device, torch)
    t_ns = time.monotonic_ns()
    gpu: dict[str, int | None] = dict.fromkeys(GPU_FIELDS)
    if dev is not None:
        c = _devices.counters(torch, dev) or _ledger.NO_COUNTERS
        acc_alloc, acc_reserved = _ledger.gpu_acc.get(dev, (0, 0))
        gpu.update(
            allocated_bytes=c.allocated_bytes,
            reserved_bytes=c.reserved_bytes,
            peak_allocated_bytes=max(c.peak_allocated_bytes, acc_alloc),
            peak_reserved_bytes=max(c.peak_reserved_bytes, acc_reserved),
            active_bytes=c.active_bytes,
            inactive_split_bytes=c.inactive_split_bytes,
            num_alloc_retries=c.num_alloc_retries,
            num_ooms=c.num_ooms,
        )
        nv = _devices.nvml_reading(torch, dev)
        if nv is not None:
            mine = nv.process_bytes
            gpu.update(device_total_bytes=nv.total_bytes, device_free_bytes=nv.free_bytes, nvml_process_bytes=mine)
            if mine is not None:
                gpu["non_torch_bytes"] = mine - c.reserved_bytes
    rss = _native.self_rss_bytes()
    rollup = _native.self_rollup() if uss else None
    rank, local_rank, world_size = _rank.identity()
    group_rank, restart_count = _rank.launch()
    return Stats(
        device=dev,
        rss_bytes=rss,
        uss_bytes=rollup.uss_bytes if rollup else None,
        pss_bytes=rollup.pss_bytes if rollup else None,
        t_ns=t_ns,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        group_rank=group_rank,
        restart_count=restart_count,
        **gpu,
    )


# --- peaks ------------------------------------------------------------------------------------------------


def reset_peak(device: Any = None) -> None:
    """Starts a new peak period for `torchmem.peak()` and `stats().peak_*` (device `device` and CPU RSS). Only
    torchmem's own period: open `with peak()` / `track` windows keep their exact peaks, and what the program
    reads (`torch.cuda.max_memory_allocated()`, `ru_maxrss`) does not change. To reset PyTorch's peak for the
    program, call `torch.cuda.reset_peak_memory_stats()` as usual (torchmem's readers keep theirs)."""
    torch = _devices.imported_torch()
    _ledger.reset_torchmem_peak(torch, _devices.cuda_index(device, torch))


@dataclasses.dataclass
class Peak:
    """Peak memory in bytes: GPU allocated and reserved (None without CUDA) and CPU RSS.

    `torchmem.peak()` gives the peak since the last `reset_peak()`. Used as a context manager,
    `with torchmem.peak() as p:` fills `p` with the peak reached inside the block."""

    device: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    rss_bytes: int | None
    _window: _ledger.Window | None = dataclasses.field(default=None, repr=False, compare=False)

    allocated = property(lambda self: self.allocated_bytes)
    reserved = property(lambda self: self.reserved_bytes)
    rss = property(lambda self: self.rss_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("device", "allocated_bytes", "reserved_bytes", "rss_bytes")}

    def __str__(self) -> str:
        gpu = (
            ""
            if self.device is None
            else f"GPU {self.device} allocated {_fmt(self.allocated_bytes)}, reserved {_fmt(self.reserved_bytes)}, "
        )
        return f"peak: {gpu}CPU RSS {_fmt(self.rss_bytes)}"

    def __enter__(self) -> Peak:
        self._window, _, _ = _ledger.open_window(_devices.imported_torch(), self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._window is not None:
            rss, alloc, reserved, _, _ = _ledger.close_window(_devices.imported_torch(), self._window)
            self.rss_bytes, self.allocated_bytes, self.reserved_bytes = rss, alloc, reserved
            self._window = None


def peak(device: Any = None) -> Peak:
    """Peak since the last `reset_peak()` (or process start): GPU allocated/reserved of `device`, CPU RSS.
    `with torchmem.peak() as p:` gives the peak inside the block instead."""
    torch = _devices.imported_torch()
    dev = _devices.cuda_index(device, torch)
    with _ledger.lock:
        mem = _native.rss_period_peak()
        rss = max(_ledger.rss_acc, mem.peak_rss_bytes) if mem else None
        alloc = reserved = None
        if dev is not None:
            c = _devices.counters(torch, dev) or _ledger.NO_COUNTERS
            a, r = _ledger.gpu_acc.get(dev, (0, 0))
            alloc, reserved = max(a, c.peak_allocated_bytes), max(r, c.peak_reserved_bytes)
    return Peak(dev, alloc, reserved, rss)


# --- empty_cache ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CacheRelease:
    """What `empty_cache()` gave back, in bytes: PyTorch's reserved memory and NVML's per-process memory
    before and after (GPU, None without CUDA), and the CPU RSS after `malloc_trim`."""

    device: int | None
    reserved_before_bytes: int | None
    reserved_after_bytes: int | None
    nvml_process_before_bytes: int | None
    nvml_process_after_bytes: int | None
    rss_before_bytes: int | None
    rss_after_bytes: int | None

    @staticmethod
    def _diff(before: int | None, after: int | None) -> int | None:
        return None if before is None or after is None else before - after

    @property
    def released_reserved_bytes(self) -> int | None:
        return self._diff(self.reserved_before_bytes, self.reserved_after_bytes)

    @property
    def released_nvml_bytes(self) -> int | None:
        return self._diff(self.nvml_process_before_bytes, self.nvml_process_after_bytes)

    @property
    def released_rss_bytes(self) -> int | None:
        return self._diff(self.rss_before_bytes, self.rss_after_bytes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(
            released_reserved_bytes=self.released_reserved_bytes,
            released_nvml_bytes=self.released_nvml_bytes,
            released_rss_bytes=self.released_rss_bytes,
        )
        return d

    def __str__(self) -> str:
        parts = []
        if self.device is not None:
            parts.append(
                f"reserved {_fmt(self.reserved_before_bytes)} -> {_fmt(self.reserved_after_bytes)} "
                f"(released {_fmt(self.released_reserved_bytes)}), NVML process "
                f"{_fmt(self.nvml_process_before_bytes)} -> {_fmt(self.nvml_process_after_bytes)}"
            )
        parts.append(f"CPU RSS {_fmt(self.rss_before_bytes)} -> {_fmt(self.rss_after_bytes)}")
        return "empty_cache: " + ", ".join(parts)


def empty_cache(device: Any = None) -> CacheRelease:
    """Releases PyTorch's cached, unused GPU blocks (`torch.cuda.empty_cache()`, when CUDA is initialised)
    and glibc's free heap pages (`malloc_trim`), and returns what was really released, measured before and
    after. Also records a "Cache emptied" mark for the journey."""
    torch = _devices.imported_torch()
    dev = _devices.cuda_index(device, torch)
    reserved_before = reserved_after = nvml_before = nvml_after = None
    if dev is not None:
        c = _devices.counters(torch, dev)
        reserved_before = c.reserved_bytes if c is not None else 0
        nv = _devices.nvml_reading(torch, dev)
        nvml_before = nv.process_bytes if nv is not None else None
    rss_before = _native.self_rss_bytes()
    if dev is not None and _devices.cuda_initialized(torch):
        with torch.cuda.device(dev):
            torch.cuda.empty_cache()
    _native.malloc_trim()
    if dev is not None:
        c = _devices.counters(torch, dev)
        reserved_after = c.reserved_bytes if c is not None else 0
        nv = _devices.nvml_reading(torch, dev)
        nvml_after = nv.process_bytes if nv is not None else None
    rss_after = _native.self_rss_bytes()
    _markers.mark_now("Cache emptied", dev)
    return CacheRelease(dev, reserved_before, reserved_after, nvml_before, nvml_after, rss_before, rss_after)


def mark(name: str, device: Any = None) -> dict[str, Any]:
    """Records a named point (e.g. "Model initialised") with the memory now, for the journey and profile."""
    torch = _devices.imported_torch()
    dev = _devices.cuda_index(device, torch) if torch is not None and _devices.cuda_initialized(torch) else None
    return _markers.mark_now(name, dev)


# --- track ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TrackResult:
    """One run of a tracked phase, in bytes (GPU fields None without CUDA)."""

    name: str
    duration_ns: int
    entry: dict[str, Any]
    exit: dict[str, Any]

    @property
    def peak_allocated_bytes(self) -> int | None:
        return self.exit.get("peak_allocated_bytes")

    @property
    def peak_reserved_bytes(self) -> int | None:
        return self.exit.get("peak_reserved_bytes")

    @property
    def peak_rss_bytes(self) -> int | None:
        return self.exit.get("peak_rss_bytes")

    @property
    def delta_allocated_bytes(self) -> int | None:
        a, b = self.entry.get("allocated_bytes"), self.exit.get("allocated_bytes")
        return None if a is None or b is None else b - a

    @property
    def delta_rss_bytes(self) -> int | None:
        a, b = self.entry.get("rss_bytes"), self.exit.get("rss_bytes")
        return None if a is None or b is None else b - a

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in (
            "peak_allocated_bytes",
            "peak_reserved_bytes",
            "peak_rss_bytes",
            "delta_allocated_bytes",
            "delta_rss_bytes",
        ):
            d[k] = getattr(self, k)
        return d

    def __str__(self) -> str:
        def delta(v: int | None) -> str:
            return "-" if v is None else ("+" if v >= 0 else "-") + _native.format_bytes(abs(v))

        parts = []
        if self.exit.get("allocated_bytes") is not None:
            parts.append(
                f"GPU allocated {_fmt(self.entry.get('allocated_bytes'))} -> "
                f"{_fmt(self.exit.get('allocated_bytes'))} "
                f"({delta(self.delta_allocated_bytes)}), peak {_fmt(self.peak_allocated_bytes)}, "
                f"peak reserved {_fmt(self.peak_reserved_bytes)}"
            )
        parts.append(
            f"CPU RSS {_fmt(self.entry.get('rss_bytes'))} -> {_fmt(self.exit.get('rss_bytes'))} "
            f"({delta(self.delta_rss_bytes)}), peak {_fmt(self.peak_rss_bytes)}"
        )
        return f"{self.name} ({self.duration_ns / 1e9:.3f} s): " + "; ".join(parts)


class track:
    """Records a named phase: memory at entry and exit, the peak inside, the delta. A context manager
    (`with torchmem.track("load") as t: ...; print(t.result)`) and a decorator (`@torchmem.track("step")`;
    the last call's result is `func.last`). Under `torchmem run` the phase lands in the profile.
    `verbose=True` prints one line per run."""

    def __init__(self, name: str, device: Any = None, *, verbose: bool = False) -> None:
        if not isinstance(name, str) or not name:
            if callable(name):
                raise TypeError(
                    f"track(name): got the function {getattr(name, '__name__', name)!r} instead of a name; "
                    'decorate with @torchmem.track("phase name")'
                )
            raise TypeError(
                f'track(name): name must be a non-empty str naming the phase (e.g. torchmem.track("load")), '
                f"got {type(name).__name__} {name!r}"
            )
        self.name = name
        self.device = device
        self.verbose = verbose
        self.result: TrackResult | None = None
        self.history: collections.deque[TrackResult] = collections.deque(maxlen=1000)
        self._open: list[_markers.Span] = []

    def __enter__(self) -> track:
        self._open.append(_markers.Span("phase", self.name, None, _markers.span_device(self.device)))
        return self

    def __exit__(self, *exc: object) -> None:
        span = self._open.pop()
        end = span.close()
        self.result = TrackResult(self.name, end["t_ns"] - span.t0_ns, span.entry, end["memory"])
        self.history.append(self.result)
        if self.verbose:
            print(f"torchmem: {self.result}", file=sys.stderr)

    def __call__(self, func: Callable) -> Callable:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        wrapper.tracker = self  # type: ignore[attr-defined]
        return _TrackedFunction(wrapper, self)

    def __str__(self) -> str:
        return str(self.result) if self.result else f"{self.name}: not run yet"

    def __repr__(self) -> str:
        runs = len(self.history)
        last = f", last {self.result}" if self.result else ""
        return f"<torchmem.track {self.name!r}: {runs} run{'' if runs == 1 else 's'}{last}>"


class _TrackedFunction:
    """A function decorated with `track`: calls it inside the phase; `.last` is the last run's result."""

    def __init__(self, wrapper: Callable, tracker: track) -> None:
        functools.update_wrapper(self, wrapper)
        self._wrapper = wrapper
        self.tracker = tracker

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._wrapper(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self.__call__, obj)

    @property
    def last(self) -> TrackResult | None:
        return self.tracker.result

    @property
    def history(self) -> collections.deque[TrackResult]:
        return self.tracker.history
