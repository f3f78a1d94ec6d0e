"""The line to the recorder: when this process runs under `torchmem run`, every event (markers, allocator
samples, line profiles) goes to the recorder as one JSON line, in the format of `torchmem-core/src/wire.rs`.
`TORCHMEM_EVENT_SOCKET` names the recorder's Unix socket, which every process of the run connects to by
itself (so processes started by multiprocessing's `spawn`, which inherit no descriptor, are heard too); the
extension (`events.rs`) does the connecting, buffering and writing, and says who is sending (pid, rank).
`TORCHMEM_EVENT_FD` (an inherited pipe) is the older way, still read for tests. Outside `torchmem run` nothing
is sent and `emit` costs one attribute check."""

from __future__ import annotations

import atexit
import json
import os
import time
from typing import Any

_on = False  # a recorder is listening
_native_mod = None  # torchmem._native, once loaded
_nvml_of: dict[int, int] = {}  # torch's CUDA index -> NVML index, as the allocator samples are keyed


def _init() -> None:
    global _on
    if os.environ.get("TORCHMEM_EVENT_SOCKET"):
        _on = True
        return
    value = os.environ.get("TORCHMEM_EVENT_FD")
    if value is None:
        return
    try:
        os.fstat(int(value))
        _on = True
    except (ValueError, OSError):
        _on = False


_init()


def enabled() -> bool:
    """True when a recorder is listening (this process runs under `torchmem run`)."""
    return _on


def now_ns() -> int:
    """The run's clock: CLOCK_MONOTONIC nanoseconds, as the recorder reads it."""
    return time.monotonic_ns()


def emit(message: dict) -> None:
    """Queue one message for the recorder; never raises. The Rust side buffers it and the allocator sampler
    thread writes the buffer out every tick (10 ms), so the training loop pays no system call per event;
    without a sampler it is written at once."""
    if not _on:
        return
    try:
        _ext().emit_event(json.dumps(message, separators=(",", ":")))
    except Exception:
        pass


def emit_marker(
    t_ns: int, kind: str, edge: str, name: str, index: int | None, memory: dict, device: int | None = None
) -> None:
    """Queue one marker (the API's hot path: every phase, step and epoch edge); formatted in Rust. `device`:
    the CUDA device (torch's index) whose allocator `memory` read, None for CPU only."""
    if not _on:
        return
    try:
        _ext().emit_marker(t_ns, kind, edge, name, index, memory, None if device is None else _nvml_index(device))
    except Exception:
        pass


def emit_marker_with(marker: dict, device: int | None = None) -> None:
    """Queue one marker that carries more than its memory (the Monitor's `"breakdown"` and
    `"activations_by_module"`, `breakdown::DeviceBreakdown` on the Rust side), as one JSON line. A breakdown
    value that was not measured (`activations_bytes` of a compiled model) is left out of the line."""
    if not _on:
        return
    message = {"type": "marker", **marker}
    if device is not None:
        message["device"] = _nvml_index(device)
    entries = message.get("breakdown")
    if entries:
        message["breakdown"] = [{k: v for k, v in e.items() if v is not None or k not in _COUNTED} for e in entries]
    emit(message)


#: The breakdown's counted categories: integers on the wire (a missing one reads as not measured).
_COUNTED = frozenset(
    ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "inputs_bytes")
)


def _nvml_index(device: int) -> int:
    """The NVML index of torch's CUDA device `device` (the GPU rows' key), torch's own where NVML cannot say."""
    index = _nvml_of.get(device)
    if index is None:
        from . import _devices

        torch: Any = _devices.imported_torch()
        found = _devices.nvml_index(torch, device) if torch is not None else None
        index = _nvml_of[device] = device if found is None else found
    return index


def _ext():  # noqa: ANN202  (the extension module, loaded once)
    global _native_mod
    if _native_mod is None:
        from . import _native as mod

        _native_mod = mod
    return _native_mod


def flush() -> None:
    """Write buffered messages now (at exit; the sampler does it every tick otherwise)."""
    if not _on:
        return
    try:
        _ext().flush_events()
    except Exception:
        pass


atexit.register(flush)
