"""Writes a GPT-2-shaped allocator snapshot of about 22.6 MB and 129,000 trace entries from the real GPT-2
fixture (`tests/fixtures/snapshots/snapshot_gpt2_bs8_amp_cppstacks.pickle`, 2.5 MB, ~13k entries) by
repeating its trace, each repetition later in time. The sharing a real dump has is kept: every repetition
gets its own frame lists (one per captured traceback, as `_dump_snapshot` writes them) over the same frame
dicts and strings, which pickle writes once and fetches with BINGET.

    python bench/snapshot/gen_gpt2_like.py /tmp/gpt2_like.pickle            # --repeat 10
"""

from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path

FIXTURE = (
    Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "snapshots" / "snapshot_gpt2_bs8_amp_cppstacks.pickle"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()
    t0 = time.perf_counter()
    with FIXTURE.open("rb") as f:
        snap = pickle.load(f)  # noqa: S301 (our own fixture)
    traces = snap["device_traces"]
    out_traces = []
    for dev in traces:
        if not dev:
            out_traces.append(dev)
            continue
        span_us = dev[-1]["time_us"] - dev[0]["time_us"] + 1000
        entries = []
        for r in range(args.repeat):
            lists: dict[int, list] = {}  # one new frame list per original list, per repetition
            for e in dev:
                e2 = dict(e)
                e2["time_us"] = e["time_us"] + r * span_us
                if "frames" in e:
                    fr = e["frames"]
                    e2["frames"] = lists.setdefault(id(fr), list(fr)) if r else fr
                entries.append(e2)
        out_traces.append(entries)
    snap["device_traces"] = out_traces
    with open(args.out, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    n = sum(len(d) for d in out_traces)
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {size / 1e6:.1f} MB, {n:,} trace entries in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
