"""The allocator simulator from Python: `simulate(snapshot)` replays an allocator snapshot's trace through a
byte-exact model of PyTorch's CUDA caching allocator (torch 2.11 rules) and answers what-ifs: another
`PYTORCH_CUDA_ALLOC_CONF`, a per-process memory limit, a smaller device. The work happens in Rust
(`torchmem simulate`); no pickle is loaded with Python's `pickle` module (a snapshot dict is pickled to bytes
for the Rust reader).

    r = torchmem.simulate("snapshot.pickle", alloc_conf="expandable_segments:True", memory_limit="14GiB")
    r.peak_reserved_bytes, r.oom, r.matches_recording
    print(r)
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _native

if TYPE_CHECKING:
    from ._types import MinMemoryDevice, SimDevice, SimOom, SimRefused, SimulateResult

__all__ = ["Simulation", "simulate"]


def _size(value: int | str | None, what: str) -> int | None:
    """Bytes from a byte count or a size string (`14g`, `14GiB`, `80GB`, as the CLI's flags take it)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a byte count or a size such as '14GiB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be positive, got {value}")
        return value
    if isinstance(value, str):
        # The CLI's one parser: `memory_limit="14g"` means what `--memory-limit 14g` means.
        try:
            return _native.parse_size(value)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    raise TypeError(f"{what} must be a byte count or a size such as '14GiB', not {type(value).__name__}")


@dataclass(frozen=True)
class Simulation:
    """The result of `simulate` (device 0, or the first simulated device; every device is in `devices`)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_unallocated_at_peak_bytes: int
    num_alloc_retries: int
    num_cuda_malloc: int
    num_cuda_free: int
    oom: SimOom | None
    """None, or where the replay ran out of memory: `entry`, `requested_bytes`, `frames`, `live_blocks`, ..."""
    matches_recording: bool | None
    """With the recorded settings: whether the replay reproduced the recording; None for a what-if."""
    settings: str
    devices: list[SimDevice] = field(repr=False)
    refused: list[SimRefused] = field(repr=False)
    """Devices not simulated, each with its `reason` (e.g. a CUDA-graph private pool)."""
    version_note: str | None = field(repr=False)
    """Set when the snapshot comes from a torch older than the rules used (2.11)."""
    min_memory: list[MinMemoryDevice] | None = field(repr=False)
    """With `min_memory=True`: per device, the smallest memory limit without OOM per setting."""
    text: str = field(repr=False)
    raw: SimulateResult = field(repr=False)

    def __str__(self) -> str:
        return self.text


def simulate(
    snapshot_or_path: str | os.PathLike[str] | bytes | dict[str, Any],
    alloc_conf: str | None = None,
    memory_limit: int | str | None = None,
    device_memory: int | str | None = None,
    min_memory: bool = False,
) -> Simulation:
    """Replays a snapshot through the allocator model.

    `snapshot_or_path`: a snapshot file (pickle, JSON, or gzipped), its bytes, or the dict
    `torch.cuda.memory._snapshot()` returns. `alloc_conf`: a `PYTORCH_CUDA_ALLOC_CONF` string to simulate
    instead of the recorded settings. `memory_limit`: a per-process cap in bytes or as "14GiB" (what
    `set_per_process_memory_fraction` does). `device_memory`: what the allocator can get from the device, or
    "recorded": what it could have had at the recording's out-of-memory error (held + free then).
    Raises `torchmem.SnapshotError` for an unreadable snapshot and `ValueError` for bad settings.
    """
    path: str | None = None
    data: bytes | None = None
    if isinstance(snapshot_or_path, dict):
        data = pickle.dumps(snapshot_or_path, protocol=4)
    elif isinstance(snapshot_or_path, (bytes, bytearray, memoryview)):
        data = bytes(snapshot_or_path)
    elif isinstance(snapshot_or_path, (str, os.PathLike)):
        path = os.fspath(snapshot_or_path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such snapshot file")
    else:
        raise TypeError(
            "simulate() takes a snapshot path, its bytes, or the dict torch.cuda.memory._snapshot() returns; "
            f"got {type(snapshot_or_path).__name__}"
        )
    raw = _native.simulate(
        path=path,
        data=data,
        alloc_conf=alloc_conf,
        memory_limit_bytes=_size(memory_limit, "memory_limit"),
        device_memory_bytes=None if device_memory == "recorded" else _size(device_memory, "device_memory"),
        min_memory=min_memory,
        device_memory_recorded=device_memory == "recorded",
    )
    return Simulation(
        peak_allocated_bytes=raw.get("peak_allocated_bytes", 0),
        peak_reserved_bytes=raw.get("peak_reserved_bytes", 0),
        reserved_unallocated_at_peak_bytes=raw.get("reserved_unallocated_at_peak_bytes", 0),
        num_alloc_retries=raw.get("num_alloc_retries", 0),
        num_cuda_malloc=raw.get("num_cuda_malloc", 0),
        num_cuda_free=raw.get("num_cuda_free", 0),
        oom=raw.get("oom"),
        matches_recording=raw.get("matches_recording"),
        settings=raw.get("settings", ""),
        devices=raw.get("devices", []),
        refused=raw.get("refused") or [],
        version_note=raw.get("version_note"),
        min_memory=raw.get("min_memory"),
        text=raw.get("text", ""),
        raw=raw,
    )
