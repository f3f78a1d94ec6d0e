"""Writes a long allocator trace for the simulator bench: a real H200 recording (tests/fixtures/sim-h200, from
the first allocation) followed by its balanced part (the allocations the trace also frees) repeated until the
trace has --entries entries, each repetition later in time. Frames are shared (pickle memoizes them), so the
file stays small. The trace stays realistic: what repeats is a training step's allocate/free pattern on top of
the live model and optimizer state.

    python bench/simulate/gen_long_trace.py /tmp/long_trace.pickle --entries 1000000
"""

from __future__ import annotations

import argparse
import copy
import gzip
import pickle
import time
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "sim-h200" / "gpt2_adamw_amp__recorded.pickle.gz"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--source", default=str(FIXTURE))
    args = ap.parse_args()
    t0 = time.perf_counter()
    with gzip.open(args.source, "rb") as f:
        snap = pickle.load(f)  # noqa: S301 (our own fixture)
    trace = snap["device_traces"][0]
    # Balanced part: entries of allocations whose alloc and both frees are in the trace.
    allocated: dict[int, int] = {}
    freed: set[int] = set()
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            allocated[e["addr"]] = i
        elif e["action"] == "free_completed" and e["addr"] in allocated:
            freed.add(allocated.pop(e["addr"]))
    keep, live = [], set()
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "alloc" and i in freed:
            keep.append(e)
            live.add(e["addr"])
        elif a in ("free_requested", "free_completed") and e["addr"] in live:
            keep.append(e)
            if a == "free_completed":
                live.discard(e["addr"])
    span = trace[-1]["time_us"] - trace[0]["time_us"] + 1
    out = list(trace)
    rep = 1
    while len(out) < args.entries:
        for e in keep:
            c = copy.copy(e)
            c["time_us"] = e["time_us"] + rep * span
            out.append(c)
            if len(out) >= args.entries:
                break
        rep += 1
    snap["device_traces"][0] = out
    with open(args.out, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    size = Path(args.out).stat().st_size
    print(
        f"wrote {args.out}: {len(out)} entries ({rep - 1} repetitions of {len(keep)}), {size / 1e6:.1f} MB, "
        f"{time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
