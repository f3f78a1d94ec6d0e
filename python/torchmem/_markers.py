"""The marker bus: every step, phase, epoch, track and journey mark this process records goes through
`record`, to the recorder under `torchmem run` (`_events`) and to the open Monitors (`sinks`). `Span` is one
open span with its entry memory and peak window (`_ledger`); `mark_now` a point mark with the memory now."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from . import _devices, _events, _ledger, _native

#: The "Device checked" mark of the last `device_info()` call (a Monitor made later starts its journey there).
last_device_check: dict[str, Any] | None = None

#: Callables that receive every marker this process records (the open Monitors).
sinks: list[Callable[[dict[str, Any]], None]] = []


def memory_now(dev: int | None) -> dict[str, Any]:
    """MarkerMemory fields read now: RSS (statm) and, with CUDA in use, allocated and reserved."""
    mem: dict[str, Any] = {"rss_bytes": _native.self_rss_bytes()}
    torch = _devices.imported_torch() if dev is not None else None
    if torch is not None:
        c = _devices.counters(torch, dev) or _ledger.NO_COUNTERS  # type: ignore[arg-type]
        mem["allocated_bytes"], mem["reserved_bytes"] = c.allocated_bytes, c.reserved_bytes
    return mem


def record(
    kind: str,
    edge: str,
    name: str,
    index: int | None,
    memory: dict[str, Any],
    dev: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One marker in `model::Marker` form: sent to the recorder under `torchmem run` (with `dev`, the CUDA device
    `memory` read) and to open Monitors. `extra`: more marker keys (the Monitor's `"breakdown"`)."""
    marker = {
        "t_ns": time.monotonic_ns(),
        "kind": kind,
        "edge": edge,
        "name": name,
        "index": index,
        "memory": memory,
    }
    if extra:
        marker.update(extra)
    if _events._on:
        if extra:
            _events.emit_marker_with(marker, dev)
        else:
            _events.emit_marker(marker["t_ns"], kind, edge, name, index, memory, dev)
    for sink in list(sinks):
        sink(marker)
    return marker


def mark_now(name: str, dev: int | None | str = "current") -> dict[str, Any]:
    """A point mark (journey stage) with the memory at this moment."""
    if dev == "current":
        torch = _devices.imported_torch()
        dev = _devices.cuda_index(None, torch) if torch is not None and _devices.cuda_initialized(torch) else None
    return record("mark", "point", name, None, memory_now(dev), dev)  # type: ignore[arg-type]


class Span:
    """One open span (phase, step, epoch, track): entry memory and its peak window."""

    __slots__ = ("kind", "name", "index", "dev", "window", "entry", "t0_ns", "start")

    def __init__(
        self, kind: str, name: str, index: int | None, dev: int | None, extra: dict[str, Any] | None = None
    ) -> None:
        self.kind, self.name, self.index, self.dev = kind, name, index, dev
        self.window, rss, counters = _ledger.open_window(_devices.imported_torch(), dev)
        self.entry: dict[str, Any] = {"rss_bytes": rss}
        if dev is not None:
            c = counters or _ledger.NO_COUNTERS
            self.entry["allocated_bytes"], self.entry["reserved_bytes"] = c.allocated_bytes, c.reserved_bytes
        self.start = record(kind, "start", name, index, self.entry, dev, extra)
        self.t0_ns: int = self.start["t_ns"]

    def close(self, extra: dict[str, Any] | None = None, held_rss: Any = None) -> dict[str, Any]:
        """Ends the span. `held_rss`: a `_native.HeldRss` (the Monitor's epochs) adds RSS less malloc's free
        bytes to the end's memory, the series the epoch growth warning judges."""
        torch = _devices.imported_torch()
        peak_rss, peak_alloc, peak_reserved, rss, counters = _ledger.close_window(torch, self.window)
        exit_mem: dict[str, Any] = {"rss_bytes": rss, "peak_rss_bytes": peak_rss}
        if held_rss is not None:
            exit_mem["held_rss_bytes"] = held_rss.push(rss, _native.malloc_free_bytes())
        if self.dev is not None:
            c = counters or _ledger.NO_COUNTERS
            exit_mem["allocated_bytes"], exit_mem["reserved_bytes"] = c.allocated_bytes, c.reserved_bytes
            exit_mem["peak_allocated_bytes"], exit_mem["peak_reserved_bytes"] = peak_alloc, peak_reserved
        return record(self.kind, "end", self.name, self.index, exit_mem, self.dev, extra)


def span_device(device: Any) -> int | None:
    torch = _devices.imported_torch()
    if torch is None:
        return None
    return _devices.cuda_index(device, torch)
