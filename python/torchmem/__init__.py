"""torchmem: a memory profiler for PyTorch with a Rust core.

Where does my memory go, and will it fit? Read device and allocator memory (`stats`, `device_info`), time
peaks (`peak`, `reset_peak`, `track`), watch a training loop (`Monitor`), profile line by line (`profile`),
and capture allocator snapshots (`capture`, `on_oom`). The `torchmem` command records whole runs.
"""

from ._native import ProfileError, SnapshotError, TorchmemError, __version__
from .api import Stats, device_info, empty_cache, peak, reset_peak, stats, track
from .line_profiler import print_profile, profile
from .monitor import Monitor
from .snapshot import capture, on_oom

__all__ = [
    "Monitor",
    "ProfileError",
    "SnapshotError",
    "Stats",
    "TorchmemError",
    "__version__",
    "capture",
    "device_info",
    "empty_cache",
    "on_oom",
    "peak",
    "print_profile",
    "profile",
    "reset_peak",
    "stats",
    "track",
]
