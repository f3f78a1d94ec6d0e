"""cuDNN convolution workspaces for the estimate's trace, from a catalogue recorded on a real GPU.

cuDNN's heuristics pick an algorithm per convolution shape, and its workspace (odd sizes: 98 MiB, 250 MiB, ...
for ResNet-18's convolutions at batch 64) goes through the caching allocator inside the call, then is freed. No
fake kernel shows it, and it is not a formula of the shape, so the estimate looks it up:
`scripts/gpu_op_workspaces.py` recorded, on an H200 (torch 2.11, cuDNN 9.19, default cuDNN flags), every
convolution call of real training steps of 17 torchvision architectures at several batch sizes and dtypes: the
allocator requests in the call, in order (the outputs, the workspaces, the bias gradient's reduction buffers).
`build_catalogue` turns that recording (`tests/fixtures/op-workspaces-h200/`: the main run and a ResNet-50 run at
batch 256-2048) into `data/cudnn-conv-h200.json.gz`.

Lookup by `_opsig.signature` (operator, shapes without the batch, dtypes, layouts, arguments):
* the same key at the same batch: the recorded requests, exactly ("exact");
* the key at other batch sizes: the structure of the nearest, each workspace interpolated linearly in the batch
  between the two recorded neighbours (most workspaces are a*batch + c), or extrapolated along the line through
  the two nearest outside the recorded range (scaled in proportion when only one batch, or two of different
  structure, were recorded) ("interpolated");
* an unknown key: no workspace, and the estimate says how many convolution calls that was.

The upper bound (`docs/estimator.md`, intervals): what cuDNN could take where the catalogue does not say exactly.
`workspace_bound` is the catalogue's worst case per operator: every recorded call's largest workspace is at most
`ratio * io + const` (io: the bytes of the call's tensor arguments and outputs; ratio: the largest workspace / io
of the calls with io >= 1 MiB, const: the largest workspace of the smaller calls), so an unrecorded shape, or a
recorded one on another GPU, is bounded by it. `interpolation_upper` bounds an interpolated workspace by the
larger neighbour's workspace per sample times the batch.

`TORCHMEM_ESTIMATE_CONV_EXCLUDE=arch,arch` leaves out what those architectures' runs recorded (the accuracy
bench's leave-one-model-out: a model is then estimated from other models' recordings only); `*` leaves out all.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from bisect import bisect_left
from pathlib import Path

CATALOGUE_PATH = Path(__file__).with_name("data") / "cudnn-conv-h200.json.gz"
EXCLUDE_ENV = "TORCHMEM_ESTIMATE_CONV_EXCLUDE"

# A template is a list of requests in call order: ["o", k, bytes] the call's k-th (flattened) output,
# ["t", bytes, 0] a temporary, ["f", i, 0] the free of the temporary requested at position i.


def normalize(raw: list) -> list:
    """One recorded call (`gpu_op_workspaces.py`: ["out", k, size] / ["tmp", id, size] / ["free", id, 0]) as a
    template. A request the recorder called a temporary but never freed in the call is an output whose block
    reused a freed temporary's address; it takes the lowest output index not yet named."""
    pending: dict[int, list[int]] = {}
    for pos, (kind, i, _size) in enumerate(raw):
        if kind == "tmp":
            pending.setdefault(i, []).append(pos)
        elif kind == "free":
            pending[i].pop()
    unfreed = sorted(p for ps in pending.values() for p in ps)
    named = {k for kind, k, _ in raw if kind == "out"}
    spare = iter(sorted(set(range(len(named) + len(unfreed))) - named))
    as_output = {p: next(spare) for p in unfreed}
    events: list = []
    stack: dict[int, list[int]] = {}
    for pos, (kind, i, size) in enumerate(raw):
        if kind == "out":
            events.append(["o", i, size])
        elif kind == "tmp" and pos in as_output:
            events.append(["o", as_output[pos], size])
        elif kind == "tmp":
            stack.setdefault(i, []).append(len(events))
            events.append(["t", size, 0])
        elif kind == "free":
            events.append(["f", stack[i].pop(), 0])
        else:
            raise ValueError(f"unexpected request kind {kind!r} in a convolution recording")
    return events


def build_catalogue(*recordings: dict) -> dict:
    """The catalogue file's content from `gpu_op_workspaces.py`'s JSON (one or more runs of it on one GPU, torch
    and cuDNN: their calls merge; a (key, batch) recorded twice must agree)."""
    head_keys = ("device_name", "capability", "torch_version", "cuda_version", "cudnn_version", "cudnn_flags")
    first_rec = recordings[0]
    convs: dict = {}
    for recording in recordings:
        if any(recording[k] != first_rec[k] for k in head_keys):
            raise ValueError("the recordings come from different GPUs, torch, cuDNN or cuDNN flags")
        for key, per_batch in recording["conv"].items():
            for batch, slot in per_batch.items():
                templates = [normalize(t) for t in slot["templates"]]
                first = templates[0]
                have = convs.get(key, {}).get(batch)
                if any(t != first for t in templates[1:]) or (have is not None and have["events"] != first):
                    raise ValueError(f"{key} at batch {batch}: the recorded calls disagree")
                archs = sorted({s.split("/")[0] for s in slot["sources"]} | set(have["archs"] if have else ()))
                convs.setdefault(key, {})[batch] = {"events": first, "archs": archs}
    header = {k: first_rec[k] for k in head_keys}
    return {"header": header, "convolutions": convs}


_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}
_TENSOR_RE = re.compile(r"T\[([^\]]*)\](\w+)/")
_BOUND_SPLIT_BYTES = 1 << 20


def key_io_bytes(key: str, batch: int) -> int:
    """The bytes of a key's tensor arguments at `batch` (dim "N" is the batch)."""
    total = 0
    for m in _TENSOR_RE.finditer(key):
        dims = [batch if x == "N" else int(x) for x in m.group(1).split(",") if x]
        total += math.prod(dims) * _DTYPE_BYTES.get(m.group(2), 4)
    return total


def peak_temp_bytes(events: list) -> int:
    """The most workspace bytes live at once in a template."""
    live = peak = 0
    sizes: dict[int, int] = {}
    for i, e in enumerate(events):
        if e[0] == "t":
            sizes[i] = e[1]
            live += e[1]
            peak = max(peak, live)
        elif e[0] == "f":
            live -= sizes.pop(e[1], 0)
    return peak


def _shape(events: list) -> list:
    return [(e[0], e[1] if e[0] != "t" else None) for e in events]


class ConvCatalogue:
    """Workspace templates by convolution key and batch size."""

    def __init__(self, data: dict, exclude_archs: tuple[str, ...] = ()) -> None:
        self.header = data["header"]
        self.entries: dict[str, dict[int, list]] = {}
        for key, per_batch in data["convolutions"].items():
            kept = {
                int(b): slot["events"]
                for b, slot in per_batch.items()
                if "*" not in exclude_archs and any(a not in exclude_archs for a in slot["archs"])
            }
            if kept:
                self.entries[key] = kept
        self.exclude_archs = exclude_archs

    def workspace_bound(self, op: str) -> tuple[float, int]:
        """(ratio, const) such that every recorded call of `op` took at most `ratio * io + const` workspace bytes
        (io: its tensor arguments' and outputs' bytes); see the module's docstring."""
        bounds = self.__dict__.setdefault("_bounds", {})
        if op not in bounds:
            ratio, const = 0.0, 0
            for key, per_batch in self.entries.items():
                if not key.startswith(op + "|"):
                    continue
                for batch, events in per_batch.items():
                    ws = peak_temp_bytes(events)
                    io = key_io_bytes(key, batch) + sum(e[2] for e in events if e[0] == "o")
                    if io >= _BOUND_SPLIT_BYTES:
                        ratio = max(ratio, ws / io)
                    else:
                        const = max(const, ws)
            bounds[op] = (ratio, const)
        return bounds[op]

    def interpolation_upper(self, key: str, batch: int) -> int:
        """The largest workspace an interpolated call can take: the larger of its recorded neighbours' workspace
        per sample times the batch (at least each neighbour's own)."""
        per_batch = self.entries.get(key) or {}
        batches = sorted(per_batch)
        i = bisect_left(batches, batch)
        near = batches[max(0, i - 1) : i + 1] or batches[-1:]
        return max((math.ceil(peak_temp_bytes(per_batch[b]) * max(1.0, batch / b)) for b in near), default=0)

    @classmethod
    def load(cls, path: Path = CATALOGUE_PATH) -> ConvCatalogue:
        exclude = tuple(a for a in os.environ.get(EXCLUDE_ENV, "").split(",") if a)
        with gzip.open(path, "rt") as f:
            return cls(json.load(f), exclude)

    def lookup(self, key: str, batch: int) -> tuple[list, str] | None:
        """(template, "exact" | "interpolated") or None for a key never recorded."""
        per_batch = self.entries.get(key)
        if not per_batch:
            return None
        if batch in per_batch:
            return per_batch[batch], "exact"
        batches = sorted(per_batch)
        i = bisect_left(batches, batch)
        if 0 < i < len(batches):
            lo, hi = batches[i - 1], batches[i]
        elif len(batches) >= 2:
            # Outside the recorded range: extend the line through the two nearest recorded batches (a
            # workspace is mostly a*batch + c; scaling in proportion would scale c too).
            lo, hi = (batches[-2], batches[-1]) if i else (batches[0], batches[1])
        else:
            lo = hi = batches[0]
        a, b = per_batch[lo], per_batch[hi]
        if lo != hi and _shape(a) == _shape(b):
            w = (batch - lo) / (hi - lo)
            return [
                ["t", max(0, round(ea[1] + (eb[1] - ea[1]) * w)), 0] if ea[0] == "t" else list(ea)
                for ea, eb in zip(a, b, strict=True)
            ], "interpolated"
        nb = min((lo, hi), key=lambda x: abs(x - batch))
        near = per_batch[nb]
        return [["t", max(0, round(e[1] * batch / nb)), 0] if e[0] == "t" else list(e) for e in near], "interpolated"
