"""The storage-lifetime tracer of `torchmem estimate`: a dispatch mode under `FakeTensorMode` that records, in
program order, every new CUDA storage an operator returns (an allocator request of the storage's byte size) and
the moment the storage dies (a weakref callback: the free), plus the synthetic requests of CUDA libraries that no
operator makes (cuBLAS/cuDNN workspaces, see `_rules`). Its events become an allocator snapshot's
`device_traces` (see `_snapshot`), which the allocator simulator replays.

Names carry units; sizes are the bytes requested (the simulator does the allocator's rounding).
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

_ADDR_BASE = 0x7F0000000000
_ADDR_STEP = 1 << 12
_ROUND_BYTES = 512
_FRAMES_MAX = 24
_SKIP_FILES = (
    "torchmem/estimator/",
    "torch/utils/_python_dispatch.py",
    "torch/_subclasses/",
    "torch/_dynamo/",
    "torch/_compile.py",
    "torch/_ops.py",
)


def round512(n: int) -> int:
    return (n + _ROUND_BYTES - 1) // _ROUND_BYTES * _ROUND_BYTES


@dataclass
class Event:
    """One allocator request (`alloc`) or release (`free`) in program order."""

    action: str  # "alloc" | "free"
    addr: int
    size_bytes: int
    phase: str
    step: int
    frames: list[dict] | None = None
    what: str = ""  # operator (or library workspace) that made the request


@dataclass
class Notes:
    """What the trace could not follow exactly: shown with the estimate, never silent."""

    messages: list[str] = field(default_factory=list)

    def add(self, message: str) -> None:
        if message not in self.messages:
            self.messages.append(message)


def _python_frames() -> list[dict]:
    frames: list[dict] = []
    f = sys._getframe(2)
    while f is not None and len(frames) < _FRAMES_MAX:
        name = f.f_code.co_filename
        if not any(s in name for s in _SKIP_FILES):
            frames.append({"filename": name, "line": f.f_lineno, "name": f.f_code.co_name})
        f = f.f_back
    return frames


class Tracer(TorchDispatchMode):
    """Records allocator requests of CUDA storages under a FakeTensorMode (enter the fake mode first)."""

    def __init__(self, *, frames_min_bytes: int = 1 << 20, rules=None) -> None:
        super().__init__()
        self.events: list[Event] = []
        self.frames_min_bytes = frames_min_bytes
        self.rules = rules
        # Called with (func, args) for every c10d operator (`_distributed.Emulation`: which groups ran collectives).
        self.on_collective = None
        self.phase = "setup"
        self.step = 0
        self.notes = Notes()
        self._tracked: dict[int, tuple[weakref.ref, int, int]] = {}  # storage cdata -> (ref, addr, bytes)
        self._next_addr = _ADDR_BASE
        self._lock = threading.RLock()
        self._live_bytes = 0
        self._peak_bytes = 0
        self.enabled = True
        # > 0 while shapes are computed on the emulated device for bookkeeping only (DTensor's sharding
        # propagation runs the op on global-shape fake tensors): nothing made then is an allocation.
        self.paused = 0
        self.annotations: list[tuple[str, str, int]] = []  # (name, START|END, event index)
        # Requests whose size is not exactly known (`_rules`: a convolution the cuDNN catalogue lacks, another
        # GPU's cuDNN choice, an interpolated workspace), for the estimate's upper bound: [addr, upper_bytes,
        # anchor_addr]. addr > 0 widens that request of the trace to upper_bytes; addr 0 is a request the point
        # trace lacks (point 0 bytes), requested and freed right after the allocation at anchor_addr. The Rust
        # report replays the trace a second time with them (`torchmem_estimator::report`).
        self.uncertain_requests: list[list[int]] = []
        # Why, grouped by (kind, op, shapes, site): {kind, what, op, shapes, site, calls, bytes} where bytes is
        # the most one call can add (a workspace is live only inside its call).
        self.uncertain_reasons: dict[tuple, dict] = {}
        self._last_alloc_addr = 0

    # ------------------------------------------------------------------ counters (torch.cuda.* answers)
    def live_bytes_rounded(self) -> int:
        return self._live_bytes

    def peak_bytes_rounded(self) -> int:
        return self._peak_bytes

    def reset_peak(self) -> None:
        self._peak_bytes = self._live_bytes

    def note(self, message: str) -> None:
        self.notes.add(message)

    def pause(self):
        """A context in which operators' outputs are not recorded (their frees, never known, neither)."""
        tracer = self

        class _Paused:
            def __enter__(self):
                tracer.paused += 1

            def __exit__(self, *exc):
                tracer.paused -= 1

        return _Paused()

    # ------------------------------------------------------------------ events
    def alloc(self, size_bytes: int, what: str, frames: list[dict] | None = None) -> int:
        """Records a request of `size_bytes` (also used for synthetic library requests); returns its address."""
        with self._lock:
            addr = self._next_addr
            self._next_addr += _ADDR_STEP
            if frames is None and size_bytes >= self.frames_min_bytes:
                frames = _python_frames()
            self.events.append(Event("alloc", addr, size_bytes, self.phase, self.step, frames, what))
            self._last_alloc_addr = addr
            self._live_bytes += round512(size_bytes)
            self._peak_bytes = max(self._peak_bytes, self._live_bytes)
            return addr

    def free(self, addr: int, size_bytes: int) -> None:
        with self._lock:
            self.events.append(Event("free", addr, size_bytes, self.phase, self.step))
            self._live_bytes -= round512(size_bytes)

    def uncertain(self, reason: dict, *, upper_bytes: int, addr: int = 0, point_bytes: int = 0) -> None:
        """A request of `point_bytes` in the trace (at `addr`; 0: not in the trace) that can be as large as
        `upper_bytes`: recorded for the upper bound's replay, with its `reason` (kind, what, op, shapes, site)."""
        extra = upper_bytes - point_bytes
        if extra <= 0 or not self.enabled or self.paused:
            return
        with self._lock:
            anchor = 0 if addr else self._last_alloc_addr
            if not addr and not anchor:
                return
            self.uncertain_requests.append([addr, upper_bytes, anchor])
            key = (reason.get("kind", ""), reason.get("op", ""), reason.get("shapes", ""), reason.get("site", ""))
            r = self.uncertain_reasons.get(key)
            if r is None:
                r = self.uncertain_reasons[key] = {**reason, "calls": 0, "bytes": 0}
            r["calls"] += 1
            r["bytes"] = max(r["bytes"], extra)

    def uncertainty(self) -> list[dict]:
        """The reasons, the largest first."""
        return sorted(self.uncertain_reasons.values(), key=lambda r: (-r["bytes"], r["kind"], r["site"]))

    def mark(self, name: str, stage: str) -> None:
        with self._lock:
            self.annotations.append((name, stage, len(self.events)))

    def _storage_died(self, key: int, _ref) -> None:
        entry = self._tracked.pop(key, None)
        if entry is not None and self.enabled and entry[2] > 0:
            self.free(entry[1], entry[2])

    def storage_resized(self, st) -> None:
        """`UntypedStorage.resize_` (FSDP's free_storage / alloc_storage of unsharded parameters and all-gather
        buffers): no operator returns the storage, so the dispatch mode never saw it. A resize is a new block of
        the new size, then the old block's free (resize to 0: a free; from 0: an allocation). A storage at 0
        bytes stays known, so its later growth is its own block again. Only storages the trace knows (a fake
        tensor's storage is a meta storage: its CUDA-ness is the tensor's, seen when an operator made it)."""
        if not self.enabled:
            return
        try:
            nbytes = st.nbytes()
            key = st._cdata
        except (NotImplementedError, RuntimeError):
            return
        entry = self._tracked.get(key)
        if entry is None or entry[2] == nbytes:
            return
        addr = self.alloc(nbytes, "storage.resize_") if nbytes > 0 else 0
        if entry[2] > 0:
            self.free(entry[1], entry[2])
        self._tracked[key] = (entry[0], addr, nbytes)

    def track(self, t: torch.Tensor, what: str) -> None:
        if t.device.type != "cuda" or is_traceable_wrapper_subclass(t):
            # A wrapper subclass (DTensor, FSDP's sharded parameters) owns no device memory: its storage's size is
            # the global tensor's. Its local tensors are the allocations, recorded when the ops that make them run.
            return
        try:
            st = t.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return
        nbytes = st.nbytes()
        key = st._cdata
        entry = self._tracked.get(key)
        if entry is not None:
            if entry[2] == nbytes:
                return
            # Resized in place (out= variants, resize_): the allocator hands a new block, then frees the old one.
            addr = self.alloc(nbytes, what) if nbytes > 0 else 0
            if entry[2] > 0:
                self.free(entry[1], entry[2])
            if nbytes > 0:
                self._tracked[key] = (entry[0], addr, nbytes)
            else:
                self._tracked.pop(key, None)
            return
        if nbytes == 0:
            return
        addr = self.alloc(nbytes, what)
        self._tracked[key] = (weakref.ref(st, lambda r, k=key: self._storage_died(k, r)), addr, nbytes)

    def addr_of(self, t: torch.Tensor) -> int:
        """The trace address of `t`'s storage (0: not tracked)."""
        try:
            entry = self._tracked.get(t.untyped_storage()._cdata)
        except (NotImplementedError, RuntimeError):
            return 0
        return entry[1] if entry is not None else 0

    def track_existing(self, tensors) -> None:
        """Tracks storages made before the trace started (e.g. by a `.to('cuda')` outside the mode)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.track(t, "existing")

    def close(self) -> None:
        """Stops recording: storages still alive stay allocated at the end of the trace."""
        self.enabled = False

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not FakeTensor and issubclass(t, torch.Tensor) and t is not torch.Tensor for t in types):
            flat, _ = tree_flatten((args, kwargs))
            if any(is_traceable_wrapper_subclass(a) for a in flat):
                # A wrapper subclass (DTensor, FSDP2's sharded parameters, a float8 tensor) runs its own dispatch on
                # its local tensors: returning NotImplemented lets it run with this mode still on the stack, so
                # the local allocations are recorded as they happen (a mode that ran the op itself would be off
                # the stack while the subclass's inner ops ran: they were missed).
                return NotImplemented
        if self.on_collective is not None and "c10d" in func.namespace:
            self.on_collective(func, args)
        rules = self.rules
        if rules is not None:
            replaced = rules.before(self, func, args, kwargs)
            if replaced is not None:
                return replaced[0]
        if _is_composite(func):
            # Under `torch.inference_mode()` autograd is skipped, so composite operators (`aten.conv2d`,
            # `aten.linear`, `aten.batch_norm`) reach this mode whole; decomposed here, as CUDA does, the rules see
            # the operators that run (`aten.convolution`: cuDNN workspaces; `aten.addmm`: the cuBLAS workspace).
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if self.enabled and not self.paused:
            flat, _ = tree_flatten(out)
            name = str(func)
            for t in flat:
                if isinstance(t, torch.Tensor):
                    self.track(t, name)
            if rules is not None:
                rules.after(self, func, args, kwargs, out)
        return out


_COMPOSITE: dict[Any, bool] = {}


def _is_composite(func) -> bool:
    """Whether the operator is CompositeImplicitAutograd (decomposed into others before any kernel runs)."""
    known = _COMPOSITE.get(func)
    if known is None:
        try:
            known = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
        except (AttributeError, RuntimeError):
            known = False
        _COMPOSITE[func] = known
    return known


def phase_of(events: list[Event]) -> dict[str, Any]:
    """Peak live bytes (512-rounded) per phase name, over the whole trace."""
    live = 0
    peaks: dict[str, int] = {}
    sizes: dict[int, int] = {}
    for e in events:
        if e.action == "alloc":
            sizes[e.addr] = round512(e.size_bytes)
            live += sizes[e.addr]
        else:
            live -= sizes.pop(e.addr, round512(e.size_bytes))
        peaks[e.phase] = max(peaks.get(e.phase, 0), live)
    return peaks
