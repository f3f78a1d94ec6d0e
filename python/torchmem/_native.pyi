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
def snapshot_summary_json(path: str, top: int = 10, at_time_us: int | None = None) -> str:
    """Summary (per-device reserved/allocated/active/requested bytes now and at the traced peak,
    fragmentation per segment, trace action counts, ring-buffer history) and the `top` allocation sites
    at the peak (or at `at_time_us`) of a snapshot file (pickle or JSON), as JSON. Raises SnapshotError."""

def snapshot_summary_bytes_json(data: bytes, top: int = 10, at_time_us: int | None = None) -> str:
    """The same for snapshot bytes. Raises SnapshotError."""

def snapshot_text(path: str, top: int = 10) -> str:
    """The text of `torchmem snapshot FILE` followed by `--top top`. Raises SnapshotError."""

def snapshot_html(path: str, out_path: str) -> None:
    """Writes the self-contained offline HTML report of a snapshot file. Raises SnapshotError."""

def oom_diagnosis_json(
    requested_bytes: int,
    allocated_bytes: int,
    reserved_bytes: int,
    total_bytes: int | None = None,
    free_bytes: int | None = None,
    process_bytes: int | None = None,
    device: int | None = None,
) -> str:
    """Diagnosis of an out-of-memory failure from the allocator's numbers (bytes), as JSON: verdict
    ("fragmentation" | "capacity" | "other_processes" | "request_too_large"), explanation, next_steps,
    batch_factor, shortfall_bytes, and `text`."""

def explain_oom_json(message: str) -> str:
    """Parses a PyTorch CUDA OOM message (torch <= 2.0, 2.1, >= 2.2 wordings) and diagnoses it, as JSON
    (like `oom_diagnosis_json`, with the parsed numbers). Raises ValueError for text that is not one."""
