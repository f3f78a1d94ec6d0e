"""The pipe to the recorder: when this process runs under `torchmem run`, `TORCHMEM_EVENT_FD` names a pipe and
every event (markers, allocator samples, line profiles) goes there as one JSON line, in the format of
`torchmem-core/src/wire.rs`. Outside `torchmem run` nothing is sent and `emit` costs one attribute check."""

from __future__ import annotations

import atexit
import json
import os
import threading
import time

_fd: int | None = None
_lock = threading.Lock()
_native_mod = None  # torchmem._native, once loaded (a failed import leaves it None: plain writes then)


def _init() -> None:
    global _fd
    value = os.environ.get("TORCHMEM_EVENT_FD")
    if value is None:
        return
    try:
        _fd = int(value)
        os.fstat(_fd)
    except (ValueError, OSError):
        _fd = None


_init()


def enabled() -> bool:
    """True when a recorder is listening (this process runs under `torchmem run`)."""
    return _fd is not None


def now_ns() -> int:
    """The run's clock: CLOCK_MONOTONIC nanoseconds, as the recorder reads it."""
    return time.monotonic_ns()


def emit(message: dict) -> None:
    """Queue one message for the recorder; never raises. The Rust side buffers it and the allocator sampler
    thread writes the buffer to the pipe every tick (10 ms), so the training loop pays no system call per
    event; without a sampler it is written at once. A closed pipe (recorder gone) turns sending off."""
    global _fd
    if _fd is None:
        return
    line = json.dumps(message, separators=(",", ":"))
    try:
        _ext().emit_event(line)
    except Exception:
        _write_now(line)


def emit_marker(t_ns: int, kind: str, edge: str, name: str, index: int | None, memory: dict) -> None:
    """Queue one marker (the API's hot path: every phase, step and epoch edge); formatted in Rust."""
    if _fd is None:
        return
    try:
        _ext().emit_marker(t_ns, kind, edge, name, index, memory)
    except Exception:
        msg = {"type": "marker", "t_ns": t_ns, "kind": kind, "edge": edge, "name": name, "index": index}
        _write_now(json.dumps({**msg, "memory": memory}, separators=(",", ":")))


def _ext():  # noqa: ANN202  (the extension module, loaded once)
    global _native_mod
    if _native_mod is None:
        from . import _native as mod

        _native_mod = mod
    return _native_mod


def _write_now(line: str) -> None:
    global _fd
    with _lock:
        if _fd is None:
            return
        try:
            os.write(_fd, (line + "\n").encode())
        except OSError:
            _fd = None


def flush() -> None:
    """Write buffered messages now (at exit; the sampler does it every tick otherwise)."""
    if _fd is None:
        return
    try:
        _ext().flush_events()
    except Exception:
        pass


atexit.register(flush)
