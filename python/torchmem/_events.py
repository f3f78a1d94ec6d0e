"""The pipe to the recorder: when this process runs under `torchmem run`, `TORCHMEM_EVENT_FD` names a pipe and
every event (markers, allocator samples, line profiles) goes there as one JSON line, in the format of
`torchmem-core/src/wire.rs`. Outside `torchmem run` nothing is sent and `emit` costs one attribute check."""

from __future__ import annotations

import json
import os
import threading
import time

_fd: int | None = None
_lock = threading.Lock()


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
    """Send one message to the recorder; a closed pipe (recorder gone) turns sending off, never raises."""
    global _fd
    if _fd is None:
        return
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
    with _lock:
        try:
            os.write(_fd, data)
        except OSError:
            _fd = None
