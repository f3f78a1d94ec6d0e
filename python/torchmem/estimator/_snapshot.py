"""Writes the estimator's trace as a PyTorch allocator snapshot (`segments` empty, `device_traces[0]` the
requests in program order, `allocator_settings` as torch 2.11 records them, phases as `external_annotations`),
pickled (protocol 4, gzipped for a `.gz` name) or JSON, so `torchmem simulate` and `torchmem snapshot` read it.
"""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

_TIME0_US = 1_000_000_000_000_000  # synthetic clock: one microsecond per request


def allocator_settings(alloc_conf: str) -> dict:
    """The `allocator_settings` of a snapshot under `alloc_conf` (the keys torch 2.11 writes; the simulator
    also parses the string itself)."""
    expandable = "expandable_segments:true" in alloc_conf.replace(" ", "").lower()
    max_split = -1
    gc = 0.0
    for part in alloc_conf.split(","):
        k, _, v = part.partition(":")
        k = k.strip()
        try:
            if k == "max_split_size_mb":
                max_split = int(float(v)) * 2**20
            elif k == "garbage_collection_threshold":
                gc = float(v)
        except ValueError:
            pass
    return {
        "PYTORCH_CUDA_ALLOC_CONF": alloc_conf,
        "max_split_size": max_split,
        "garbage_collection_threshold": gc,
        "expandable_segments": expandable,
        "pinned_num_register_threads": 1,
        "release_lock_on_cudamalloc": False,
        "pinned_use_cuda_host_register": False,
        "graph_capture_record_stream_reuse": False,
        "roundup_power2_divisions": {str(2**i): 0 for i in range(16)},
    }


def _stream_value(stream_id: int) -> int:
    """The `cudaStream_t`-like value of the emulated device's stream `stream_id` (`_device._FakeStream`)."""
    return 0 if stream_id == 0 else 0x7F0000000000 + 0x10 * stream_id


def build(tracer, *, alloc_conf: str = "") -> dict:
    trace = []
    # The stream of each request: the stream current when it was made (`_device._Streams` marks the changes);
    # a free is on its block's stream.
    marks = list(getattr(tracer, "stream_marks", ()))
    next_mark = 0
    stream = 0
    block_stream: dict[int, int] = {}
    for i, e in enumerate(tracer.events):
        while next_mark < len(marks) and marks[next_mark][0] <= i:
            stream = _stream_value(marks[next_mark][1])
            next_mark += 1
        if e.action == "alloc":
            block_stream[e.addr] = stream
            s = stream
        else:
            s = block_stream.pop(e.addr, 0)
        t = _TIME0_US + i
        base = {"addr": e.addr, "size": e.size_bytes, "stream": s, "time_us": t}
        if e.action == "alloc":
            entry = {"action": "alloc", **base, "compile_context": "N/A", "user_metadata": f"{e.phase}|{e.what}"}
            if e.frames:
                entry["frames"] = e.frames
            trace.append(entry)
        else:
            trace.append({"action": "free_requested", **base, "compile_context": "N/A", "user_metadata": ""})
            trace.append({"action": "free_completed", **base, "compile_context": "N/A", "user_metadata": ""})
    annotations = [
        {"name": name, "stage": stage, "device": 0, "time_us": _TIME0_US + index}
        for name, stage, index in tracer.annotations
    ]
    return {
        "segments": [],
        "device_traces": [trace],
        "allocator_settings": allocator_settings(alloc_conf),
        "external_annotations": annotations,
    }


def write(snapshot: dict, path: str | Path) -> Path:
    path = Path(path)
    name = path.name
    if name.endswith(".json"):
        path.write_text(json.dumps(snapshot))
    elif name.endswith(".gz"):
        with gzip.open(path, "wb", compresslevel=6) as f:
            pickle.dump(snapshot, f, protocol=4)
    else:
        with open(path, "wb") as f:
            pickle.dump(snapshot, f, protocol=4)
    return path
