"""torchmem: a memory profiler for PyTorch with a Rust core.

Where does my memory go, and will it fit? Read device and allocator memory (`stats`, `device_info`), time
peaks (`peak`, `reset_peak`, `track`), watch a training loop (`Monitor`), profile line by line (`profile`),
capture allocator snapshots (`capture`, `on_oom`) and read recorded profiles (`load_profile`). The
`torchmem` command records whole runs.

Names load on first use, so `torchmem run` can load its in-process part (`torchmem._bootstrap`) into every
profiled program without paying for the whole API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> submodule that defines it
_EXPORTS = {
    "TorchmemError": "_native",
    "InputError": "_native",
    "OomParseError": "_native",
    "ProfileError": "_native",
    "SnapshotError": "_native",
    "Stats": "api",
    "device_info": "api",
    "empty_cache": "api",
    "peak": "api",
    "reset_peak": "api",
    "stats": "api",
    "track": "api",
    "Monitor": "monitor",
    "MemoryGrowthWarning": "monitor",
    "watch": "monitor",
    "print_profile": "line_profiler",
    "profile": "line_profiler",
    "capture": "snapshot",
    "on_oom": "snapshot",
    "Simulation": "simulation",
    "simulate": "simulation",
    "Estimate": "estimator",
    "estimate": "estimator",
    "Profile": "recorded_profile",
    "load_profile": "recorded_profile",
}

__all__ = [
    "Estimate",
    "InputError",
    "MemoryGrowthWarning",
    "Monitor",
    "OomParseError",
    "Profile",
    "ProfileError",
    "Simulation",
    "SnapshotError",
    "Stats",
    "TorchmemError",
    "__version__",
    "capture",
    "device_info",
    "empty_cache",
    "estimate",
    "load_profile",
    "on_oom",
    "peak",
    "print_profile",
    "profile",
    "reset_peak",
    "simulate",
    "stats",
    "track",
    "watch",
]

if TYPE_CHECKING:
    from ._native import InputError, OomParseError, ProfileError, SnapshotError, TorchmemError
    from .api import Stats, device_info, empty_cache, peak, reset_peak, stats, track
    from .estimator import Estimate, estimate
    from .line_profiler import print_profile, profile
    from .monitor import MemoryGrowthWarning, Monitor, watch
    from .recorded_profile import Profile, load_profile
    from .simulation import Simulation, simulate
    from .snapshot import capture, on_oom


def load_ipython_extension(ip: Any) -> None:
    """`%load_ext torchmem`: the `%tmemit` / `%tmprun` magics (torchmem._jupyter; IPython loads only then)."""
    from ._jupyter import register

    register(ip)


def unload_ipython_extension(ip: Any) -> None:
    """`%unload_ext torchmem`: nothing to undo beyond IPython's own bookkeeping (the magics stay defined)."""


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torchmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
