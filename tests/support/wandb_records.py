"""Reads a W&B offline run file (`offline-run-*/run-*.wandb`, written with WANDB_MODE=offline) back into its
records, so tests can check what really reached W&B: history rows, define_metric declarations, artifacts.
The format is W&B's LevelDB-style log: a 7-byte header (":W&B", version), then 32 KiB blocks of chunks with
a 7-byte header (CRC32, length, type: 1 full, 2 first, 3 middle, 4 last), each record a `wandb.proto` Record."""

from __future__ import annotations

import glob
import json
import struct
from typing import Any

BLOCK = 32768


def _chunks(data: bytes):
    if data[:4] != b":W&B":
        raise ValueError(f"not a W&B run file (header {data[:7]!r})")
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            yield buf + chunk
            buf = b""


def read_run(run_dir_glob: str) -> dict[str, Any]:
    """{"history": [row dicts], "metrics": [(name, glob, step_metric)], "artifacts": [(name, type, [paths])]}"""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(f"{run_dir_glob}/offline-run-*/run-*.wandb")
    out: dict[str, Any] = {"history": [], "metrics": [], "artifacts": []}
    with open(path, "rb") as f:
        data = f.read()
    for raw in _chunks(data):
        r = pb.Record()
        r.ParseFromString(raw)
        kind = r.WhichOneof("record_type")
        if kind == "history":
            out["history"].append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
        elif kind == "metric":
            out["metrics"].append((r.metric.name, r.metric.glob_name, r.metric.step_metric))
        elif kind == "artifact":
            out["artifacts"].append(
                (r.artifact.name, r.artifact.type, sorted(m.path for m in r.artifact.manifest.contents))
            )
    return out
