"""Writes a synthetic allocator snapshot of >= 1 GB and >= 10 M trace entries, streaming the pickle opcodes
directly (protocol 4, the same opcode mix and memo sharing as `torch.cuda.memory._dump_snapshot`: frame dicts
and strings memoized once and fetched with LONG_BINGET, one frame list per entry). Building the same object in
Python and calling pickle.dump would need tens of GB of RAM.

    python bench/snapshot/gen_synthetic.py /tmp/synthetic.pickle --entries 11000000
"""

from __future__ import annotations

import argparse
import struct
import time


class Writer:
    def __init__(self, f) -> None:  # noqa: ANN001
        self.f = f
        self.memo = 0
        self.buf: list[bytes] = []
        self.size = 0

    def put(self, b: bytes) -> None:
        self.buf.append(b)
        if len(self.buf) > 20000:
            self.flush()

    def flush(self) -> None:
        data = b"".join(self.buf)
        self.size += len(data)
        self.f.write(data)
        self.buf = []

    def memoize(self) -> int:
        self.put(b"\x94")
        self.memo += 1
        return self.memo - 1


def get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)  # LONG_BINGET


def long1(v: int) -> bytes:
    n = (v.bit_length() + 8) // 8  # room for the sign bit
    return b"\x8a" + bytes([n]) + v.to_bytes(n, "little", signed=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--entries", type=int, default=11_000_000)
    ap.add_argument("--segments", type=int, default=2000)
    args = ap.parse_args()
    t0 = time.perf_counter()
    with open(args.out, "wb") as f:
        w = Writer(f)
        strings: dict[str, int] = {}

        def s(text: str) -> bytes:
            """A memoized string: written once (then popped), fetched with LONG_BINGET everywhere."""
            if text not in strings:
                raw = text.encode()
                w.put(b"\x8c" + bytes([len(raw)]) + raw)
                strings[text] = w.memoize()
                w.put(b"0")  # POP
            return get(strings[text])

        sref = s
        w.put(b"\x80\x04")
        # Memoize every string up front so that later references never push new objects mid-expression.
        for text in (
            ["filename", "line", "name", "segments", "device", "address", "total_size", "allocated_size"]
            + ["active_size", "requested_size", "stream", "segment_type", "large", "is_expandable", "blocks"]
            + ["size", "state", "active_allocated", "inactive", "frames", "device_traces", "allocator_settings"]
            + ["expandable_segments", "max_split_size", "external_annotations", "action", "addr", "time_us"]
            + ["compile_context", "user_metadata", "alloc", "free_requested", "free_completed", "N/A", ""]
            + [f"/home/user/train/module_{k}.py" for k in range(8)]
            + [f"layer_{k}" for k in range(64)]
        ):
            s(text)
        # frames: 64 distinct frame dicts in 8 files (memoized, then popped: referenced by LONG_BINGET)
        frame_ids = []
        for k in range(64):
            w.put(b"}")
            fid = w.memoize()
            w.put(b"(")
            w.put(sref("filename"))
            w.put(sref(f"/home/user/train/module_{k % 8}.py"))
            w.put(sref("line"))
            w.put(b"M" + struct.pack("<H", 10 + k))
            w.put(sref("name"))
            w.put(sref(f"layer_{k}"))
            w.put(b"u0")
            frame_ids.append(fid)
        w.put(b"}")
        w.memoize()
        w.put(b"(")
        # segments
        w.put(sref("segments"))
        w.put(b"]")
        w.memoize()
        w.put(b"(")
        base = 0x7F0000000000
        seg_bytes = 20 << 20
        for sgi in range(args.segments):
            addr = base + sgi * seg_bytes
            w.put(b"}")
            w.memoize()
            w.put(b"(")
            for key, val in (
                ("device", b"K\x00"),
                ("address", long1(addr)),
                ("total_size", b"J" + struct.pack("<i", seg_bytes)),
                ("allocated_size", b"J" + struct.pack("<i", seg_bytes // 2)),
                ("active_size", b"J" + struct.pack("<i", seg_bytes // 2)),
                ("requested_size", b"J" + struct.pack("<i", seg_bytes // 2)),
                ("stream", b"K\x00"),
            ):
                w.put(sref(key))
                w.put(val)
            w.put(sref("segment_type"))
            w.put(sref("large"))
            w.put(sref("is_expandable") + b"\x89")
            w.put(sref("blocks"))
            w.put(b"]")
            w.memoize()
            w.put(b"(")
            for bi, state in enumerate(("active_allocated", "inactive")):
                w.put(b"}")
                w.memoize()
                w.put(b"(")
                w.put(sref("address"))
                w.put(long1(addr + bi * seg_bytes // 2))
                w.put(sref("size") + b"J" + struct.pack("<i", seg_bytes // 2))
                w.put(sref("requested_size") + b"J" + struct.pack("<i", seg_bytes // 2 if bi == 0 else 0))
                w.put(sref("state"))
                w.put(sref(state))
                w.put(sref("frames"))
                w.put(b"]")
                w.memoize()
                if bi == 0:
                    w.put(b"(" + get(frame_ids[sgi % 64]) + get(frame_ids[(sgi + 1) % 64]) + b"e")
                w.put(b"u")
            w.put(b"e")  # blocks
            w.put(b"u")  # segment dict
        w.put(b"e")  # segments list
        # device traces
        w.put(sref("device_traces"))
        w.put(b"]")
        w.memoize()
        w.put(b"(")
        w.put(b"]")
        w.memoize()
        keys = ["action", "addr", "size", "stream", "time_us", "compile_context", "user_metadata", "frames"]
        kref = {k: get(strings[k]) for k in keys}
        aref = {a: get(strings[a]) for a in ("alloc", "free_requested", "free_completed")}
        tail = kref["compile_context"] + get(strings["N/A"]) + kref["user_metadata"] + get(strings[""])
        window = 1000
        t_us = 1_796_056_079_995_649
        w.put(b"(")
        for i in range(args.entries):
            phase = i % 3
            j = i // 3
            if phase == 0:
                action, slot = "alloc", j
            else:
                action, slot = ("free_requested" if phase == 1 else "free_completed"), j - window
            addr = base + (slot % 200_000) * 4096 if slot >= 0 else base + (200_000 + (-slot)) * 4096
            size = 512 * (1 + slot % 8) if slot >= 0 else 2048
            w.put(b"}")
            w.memoize()
            body = (
                b"("
                + kref["action"]
                + aref[action]
                + kref["addr"]
                + long1(addr)
                + kref["size"]
                + b"J"
                + struct.pack("<i", size)
                + kref["stream"]
                + b"K\x00"
                + kref["time_us"]
                + long1(t_us + i * 3)
                + tail
                + kref["frames"]
                + b"]"
            )
            w.put(body)
            w.memoize()
            f0 = slot % 61 if slot >= 0 else 0
            w.put(b"(" + get(frame_ids[f0]) + get(frame_ids[f0 + 1]) + get(frame_ids[f0 + 2]) + b"eu")
            if i % 1000 == 999:
                w.put(b"e(")
        w.put(b"e")  # device 0 trace list
        w.put(b"e")  # device_traces list
        w.put(sref("allocator_settings"))
        w.put(b"}")
        w.memoize()
        w.put(b"(" + sref("expandable_segments") + b"\x89" + sref("max_split_size") + b"J\xff\xff\xff\xff" + b"u")
        w.put(sref("external_annotations") + b"]")
        w.memoize()
        w.put(b"u.")
        w.flush()
    dt = time.perf_counter() - t0
    print(f"wrote {args.out}: {w.size / 1e9:.2f} GB, {args.entries:,} trace entries, {args.segments} segments", end="")
    print(f" in {dt:.0f} s")


if __name__ == "__main__":
    main()
