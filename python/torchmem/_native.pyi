"""Type stubs for `torchmem._native`, the Rust extension. This file is the contract: every function the Rust
side exports is listed here with its meaning and units. Sections belong to one concern each."""

from typing import Any

__version__: str

# --- errors (crates/torchmem-py/src/errors.rs) ---
class TorchmemError(Exception): ...
class ProfileError(TorchmemError): ...
class SnapshotError(TorchmemError): ...

# --- command line (crates/torchmem-py/src/cli.rs) ---
def cli_main() -> int:
    """Run the `torchmem` command line with `sys.argv`; returns the exit code."""

# --- memory readers and reports (crates/torchmem-py/src/api.rs) ---

# --- line profiler (crates/torchmem-py/src/line.rs) ---

# --- allocator snapshots (crates/torchmem-py/src/snapshot.rs) ---
