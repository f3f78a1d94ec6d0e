"""The in-process part of `torchmem run`, loaded by the sitecustomize that `torchmem run` puts first on
PYTHONPATH: starts the allocator sampler (a Rust thread that reads PyTorch's counters once CUDA is in use)
and, with `--line`, the line profiler. Outside `torchmem run` (no `TORCHMEM_EVENT_SOCKET`, nor the older
`TORCHMEM_EVENT_FD`) it does nothing."""

from __future__ import annotations

import atexit
import json
import os
import sys
import warnings

from . import _events

_started = False


def start() -> None:
    """Called once per Python process of the profiled tree, before the user's code runs."""
    global _started
    if _started or not _events.enabled():
        return
    _started = True
    try:
        interval_ms = float(os.environ.get("TORCHMEM_INTERVAL_MS", "10"))
        # A diagnostic knob (bench/run_overhead.py --diagnose): the allocator read alone at another rate.
        interval_ms = float(os.environ.get("TORCHMEM_ALLOCATOR_INTERVAL_MS", interval_ms))
    except ValueError:
        interval_ms = 10.0  # the program runs whatever the environment says
    try:
        from . import _native

        sampler = getattr(_native, "start_allocator_sampler", None)
        if sampler is not None:
            sampler(interval_ms)
            atexit.register(_stop_sampler)
    except Exception as exc:  # the user's program must run even if our sampler cannot
        warnings.warn(f"torchmem: allocator sampler not started: {exc}", RuntimeWarning, stacklevel=1)
    try:
        # The memory breakdown of a program that never mentions torchmem: its model and optimizer are
        # found when it builds them (torchmem._autowatch; TORCHMEM_WATCH=0 turns it off).
        from ._autowatch import install

        install()
    except Exception:
        pass
    specs = os.environ.get("TORCHMEM_LINE")
    if specs is not None:
        # Only the program torchmem run started profiles lines, not Python subprocesses it spawns.
        os.environ.pop("TORCHMEM_LINE", None)
        try:
            from .line_profiler import _bootstrap_line

            script = sys.argv[0] if sys.argv else ""
            _bootstrap_line(json.loads(specs), script)
        except Exception as exc:
            warnings.warn(f"torchmem: line profiler not started: {exc}", RuntimeWarning, stacklevel=1)


def _stop_sampler() -> None:
    try:
        from . import _native

        stop = getattr(_native, "stop_allocator_sampler", None)
        if stop is not None:
            stop()
    except Exception:
        pass
