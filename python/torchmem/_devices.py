"""torch and its CUDA devices as torchmem reads them, without importing torch or creating a CUDA context: the
torch module when the program imported it, the one device resolver (`cuda_index`: None, an int, 'cuda[:N]',
'cpu' or a torch.device), the allocator's counters, and the NVML index and reading of a CUDA device. Used by
the public API (`api.py`), the marker bus, the Monitor, the event stream and the integrations."""

from __future__ import annotations

import os
import sys
from typing import Any

from . import _ledger, _native


def imported_torch() -> Any:
    """The torch module when the program imported it (torchmem never imports it itself)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "cuda") or not hasattr(torch, "_C"):
        return None  # absent, or still being imported
    return torch


_cuda_available: bool | None = None


def cuda_available_now(torch: Any) -> bool:
    """torch.cuda.is_available(), asked once (it does not create a context)."""
    global _cuda_available
    if _cuda_available is None:
        try:
            _cuda_available = bool(torch.cuda.is_available())
        except Exception:
            _cuda_available = False
    return _cuda_available


cuda_initialized = _ledger.cuda_initialized


def cuda_index(device: Any, torch: Any) -> int | None:
    """The CUDA device index `device` names, or None for the CPU / a machine without CUDA / no torch."""
    kind, index = "cuda", None
    if device is None:
        pass
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    elif isinstance(device, str):
        kind, _, rest = device.partition(":")
        if rest and not rest.isdigit():
            raise ValueError(f"device {device!r}: expected 'cuda', 'cuda:N' or 'cpu'")
        index = int(rest) if rest else None
    elif hasattr(device, "type"):
        kind, index = device.type, device.index
    else:
        raise TypeError(f"device must be None, an int, 'cuda[:N]', 'cpu' or a torch.device, not {device!r}")
    if kind == "cpu":
        return None
    if kind != "cuda":
        raise ValueError(f"device {device!r}: torchmem reads CUDA devices and the CPU, not {kind!r}")
    if torch is None or not cuda_available_now(torch):
        return None
    if index is None:
        return int(torch.cuda.current_device()) if cuda_initialized(torch) else 0
    return int(index)


#: Device `dev`'s `_native.AllocatorCounters` as the allocator holds them (its own binding, never the program's
#: view), or None before CUDA is initialised.
counters = _ledger.counters


_nvml_index_cache: dict[int, int] = {}


def nvml_index(torch: Any, dev: int) -> int | None:
    """The NVML index of CUDA device `dev` (they differ under CUDA_VISIBLE_DEVICES), by the extension's one rule
    (`_native.nvml_index_of_device`: torch's UUID of the device, else its CUDA_VISIBLE_DEVICES entry, else
    `dev`), the one the allocator sampler keys its rows by."""
    if dev in _nvml_index_cache:
        return _nvml_index_cache[dev]
    if _native.nvml_error() is not None:
        return None
    uuid: str | None = None
    if cuda_initialized(torch):
        try:
            uuid = str(torch.cuda.get_device_properties(dev).uuid)
        except Exception:
            uuid = None
    index = _native.nvml_index_of_device(dev, uuid)
    if index is not None and uuid is not None:
        _nvml_index_cache[dev] = index
    return index


def nvml_reading(torch: Any, dev: int) -> _native.NvmlReading | None:
    """NVML's reading of CUDA device `dev` (`process_bytes`: this process's), or None without NVML."""
    index = nvml_index(torch, dev)
    if index is None:
        return None
    try:
        return _native.nvml_read(index, os.getpid())
    except _native.TorchmemError:
        return None
