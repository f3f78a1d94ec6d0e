"""Cost of one Python API event under `torchmem run`: queued in Rust and written by the sampler thread (the
default) versus written at once (`--no-inject`: no sampler). Run it under the recorder:

    torchmem run -q -o /tmp/eb.sqlite -- python bench/event_cost.py
    torchmem run -q --no-inject -o /tmp/eb2.sqlite -- python bench/event_cost.py
"""

from __future__ import annotations

import time

import torchmem._bootstrap  # noqa: F401  (as the injected sitecustomize does; harmless when already loaded)
from torchmem import _events


def main() -> None:
    if not _events.enabled():
        raise SystemExit("run this under `torchmem run`: without a recorder, events are not sent at all")
    memory = {"rss_bytes": 123456789, "allocated_bytes": 987654321, "reserved_bytes": 2147483648}
    msg = {"type": "marker", "t_ns": 0, "kind": "phase", "edge": "start", "name": "forward", "memory": memory}
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        msg["t_ns"] = time.monotonic_ns()
        _events.emit(msg)
    print(f"{(time.perf_counter() - start) / n * 1e6:.2f} us per event, json.dumps + queue ({n} events)")
    start = time.perf_counter()
    for _ in range(n):
        _events.emit_marker(time.monotonic_ns(), "phase", "start", "forward", None, memory)
    print(f"{(time.perf_counter() - start) / n * 1e6:.2f} us per event, emit_marker (formatted in Rust) ({n} events)")


if __name__ == "__main__":
    main()
