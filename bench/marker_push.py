"""What one marker costs the Monitor's record (`torchmem._native.MarkerLog.push`, the Rust keep-or-fold log every
phase and step boundary goes into): µs per marker for plain boundary markers (the hot path) and for markers that
carry more keys (read through serde), kept and folded, best of 5 rounds of N start/end pairs.

    python bench/marker_push.py [--pairs 50000]
"""

from __future__ import annotations

import argparse
import time

from torchmem import _native


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=50_000)
    args = ap.parse_args()
    mem = {"rss_bytes": 1 << 30, "allocated_bytes": 1 << 28, "reserved_bytes": 1 << 29, "peak_allocated_bytes": 1 << 29}
    for label, extra, keep in (
        ("plain, folded after 100", {}, 100),
        ("plain, all kept", {}, None),
        ("with an origin (serde), folded after 100", {"origin": {"pid": 1}}, 100),
    ):
        pairs = [
            (
                {
                    "t_ns": 2 * i,
                    "kind": "phase",
                    "edge": "start",
                    "name": "forward",
                    "index": None,
                    "memory": mem,
                    **extra,
                },
                {
                    "t_ns": 2 * i + 1,
                    "kind": "phase",
                    "edge": "end",
                    "name": "forward",
                    "index": None,
                    "memory": mem,
                    **extra,
                },
            )
            for i in range(args.pairs)
        ]
        best = float("inf")
        for _ in range(5):
            log = _native.MarkerLog(keep)
            t0 = time.perf_counter()
            for a, b in pairs:
                log.push(a)
                log.push(b)
            best = min(best, (time.perf_counter() - t0) / (2 * args.pairs))
        t0 = time.perf_counter()
        log.summary()
        summary_ms = (time.perf_counter() - t0) * 1e3
        print(f"{label:<45} {best * 1e6:6.2f} µs/marker   summary() {summary_ms:6.2f} ms   kept {len(log)}")


if __name__ == "__main__":
    main()
