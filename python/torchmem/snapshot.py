"""Allocator snapshots from Python: `capture(path)` records PyTorch's allocator history around a block and
writes the snapshot; `on_oom(directory)` writes a snapshot and a short diagnosis when CUDA runs out of memory,
with a what-if (the trace replayed by the allocator simulator: would expandable segments or another common
setting have avoided it, and the smallest memory that runs it).
Reading and analysis happen in Rust (`torchmem snapshot FILE`, `summary(path)`); no pickle is ever loaded
with Python's `pickle` module.

Safety: on torch 2.11, recording history *with stacks* breaks backward of Hugging Face models that use
gradient checkpointing (`SystemError: ... returned NULL without setting an exception`). Before recording,
both functions look for modules with gradient checkpointing turned on and, if they find one, record
without stacks (`context=None`) and warn. Nothing here raises into the user's run except a clear error for
bad arguments.

CPU-only machines: `capture` warns (RuntimeWarning) and runs the block unrecorded (no file is written);
`on_oom` warns and returns an inactive handler. So the same script runs anywhere.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _native, _rank

if TYPE_CHECKING:
    from ._types import SiteRow, SnapshotReport

__all__ = ["OomHandler", "capture", "checkpointing_hazard", "on_oom", "summary"]

_VALID_STACKS = ("python", "all", None)
_HAZARD_NOTE = (
    "torchmem: recording allocator history with stacks breaks backward of models using gradient "
    "checkpointing on some torch versions (seen on 2.11 with Hugging Face models). Record with "
    "torchmem.capture(..., stacks=None) or disable gradient checkpointing while capturing."
)


def _import_torch() -> Any:
    import torch  # capture/on_oom are only useful in a torch program; importing it here is expected

    return torch


def _cuda_ready(torch: Any) -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def checkpointing_hazard() -> str | None:
    """Names a live module with gradient checkpointing turned on (the torch 2.11 hazard), or None.

    Looks at the modules alive now: Hugging Face sets `gradient_checkpointing = True` on the checkpointed
    submodules and `is_gradient_checkpointing` on the model."""
    try:
        import torch.nn as nn
    except Exception:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on lazy deprecated module attributes may warn
        objects = gc.get_objects()
        return _scan_for_checkpointing(objects, nn)


def _scan_for_checkpointing(objects: list[Any], nn: Any) -> str | None:
    for obj in objects:
        try:
            if not isinstance(obj, nn.Module):
                continue
            if getattr(obj, "gradient_checkpointing", False) is True or (
                getattr(type(obj), "is_gradient_checkpointing", None) is not None
                and getattr(obj, "is_gradient_checkpointing", False) is True
            ):
                return type(obj).__name__
        except Exception:
            continue
    return None


def _safe_context(stacks: str | None, context: str | None) -> tuple[str | None, str, str | None]:
    """(context, stacks, warning) to record with, avoiding the checkpointing hazard."""
    if stacks is None or context is None:
        return None, "python", None
    hazard = checkpointing_hazard()
    if hazard is not None:
        msg = (
            f"torchmem: {hazard} uses gradient checkpointing; recording allocator history with stacks breaks "
            "its backward on torch 2.11, so torchmem records without stacks (sizes, segments and the timeline "
            "are kept; allocation sites are not). Pass stacks=None to silence this warning."
        )
        return None, "python", msg
    return context, stacks, None


def _start_recording(torch: Any, max_entries: int, stacks: str | None, context: str | None) -> dict[str, Any]:
    ctx, stk, warning = _safe_context(stacks, context)
    if warning:
        warnings.warn(warning, RuntimeWarning, stacklevel=3)
    torch.cuda.memory._record_memory_history(enabled="all", context=ctx, stacks=stk, max_entries=int(max_entries))
    return {"context": ctx, "stacks": stk if ctx is not None else None, "max_entries": int(max_entries)}


def _stop_recording(torch: Any) -> None:
    try:
        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception as e:  # never raise into the user's run
        warnings.warn(f"torchmem: could not stop allocator history recording: {e}", RuntimeWarning, stacklevel=3)


def _resume_or_stop(torch: Any) -> None:
    """After `capture`: hand recording back to an active `on_oom` handler, or stop it."""
    for h in list(_handlers):
        if h.active and h.recording is not None:
            r = h.recording
            try:
                torch.cuda.memory._record_memory_history(
                    enabled="all", context=r["context"], stacks=r["stacks"] or "python", max_entries=r["max_entries"]
                )
                return
            except Exception as e:
                warnings.warn(
                    f"torchmem: could not resume on_oom's history recording: {e}", RuntimeWarning, stacklevel=3
                )
    _stop_recording(torch)


def summary(path: str | os.PathLike[str], top: int = 10, at_time_us: int | None = None) -> SnapshotReport:
    """The summary and top allocation sites of a snapshot file, read safely in Rust (raises SnapshotError)."""
    return _native.snapshot_summary(os.fspath(path), top, at_time_us)


class capture:  # noqa: N801 - used as `with torchmem.capture(path):`, like a function
    """Records the CUDA caching allocator's history around a block and writes the snapshot to `path`.

        with torchmem.capture("step.pickle", max_entries=100_000):
            train_step()
        # then: torchmem snapshot step.pickle --top 10   (or --html step.html)

    `stacks="python"` (default) records Python frames (cheap); `"all"` adds C++ frames (slow to write);
    `None` records sizes and the timeline without stacks. The snapshot is written even when the block
    raises. On a machine without CUDA it warns and records nothing (`written` stays False)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        max_entries: int = 100_000,
        stacks: str | None = "python",
        context: str | None = "all",
    ) -> None:
        if stacks not in _VALID_STACKS:
            raise ValueError(f"stacks must be 'python', 'all' or None, not {stacks!r}")
        if context not in ("state", "alloc", "all", None):
            raise ValueError(f"context must be 'state', 'alloc', 'all' or None, not {context!r}")
        if int(max_entries) <= 0:
            raise ValueError(f"max_entries must be positive, not {max_entries!r}")
        self.path = Path(path)
        self.max_entries = int(max_entries)
        self.stacks = stacks
        self.context = context
        self.written = False
        self.recorded_with: dict[str, Any] | None = None
        self._torch: Any = None

    def __enter__(self) -> capture:
        torch = _import_torch()
        if not _cuda_ready(torch):
            warnings.warn(
                "torchmem.capture: no CUDA device, so there is no allocator history to record; the block runs "
                f"unrecorded and {self.path} is not written",
                RuntimeWarning,
                stacklevel=2,
            )
            return self
        self._torch = torch
        try:
            self.recorded_with = _start_recording(torch, self.max_entries, self.stacks, self.context)
        except Exception as e:
            warnings.warn(f"torchmem.capture: cannot record allocator history: {e}", RuntimeWarning, stacklevel=2)
            self._torch = None
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        torch = self._torch
        if torch is None:
            return False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.path))
            self.written = True
        except Exception as e:
            warnings.warn(f"torchmem.capture: could not write {self.path}: {e}", RuntimeWarning, stacklevel=2)
        finally:
            _resume_or_stop(torch)
        if isinstance(exc, SystemError) and "NULL without setting an exception" in str(exc):
            if hasattr(exc, "add_note"):
                exc.add_note(_HAZARD_NOTE)
        return False

    def summary(self, top: int = 10) -> SnapshotReport:
        """The summary of the written snapshot (raises FileNotFoundError when nothing was written)."""
        if not self.written:
            raise FileNotFoundError(f"{self.path} was not written (no CUDA device, or recording failed)")
        return summary(self.path, top=top)


# --- out-of-memory post-mortem ---------------------------------------------------------------------------

_handlers: list[OomHandler] = []
_observer_attached = False
_lock = threading.Lock()


def _user_frames(limit: int = 8) -> list[str]:
    """The Python stack of the failing allocation, innermost first, without torchmem's own frames."""
    frames = traceback.extract_stack()[:-2]
    here = os.path.dirname(os.path.abspath(__file__))
    out = [f"{f.filename}:{f.lineno}:{f.name}" for f in reversed(frames) if not f.filename.startswith(here)]
    return out[:limit]


_NO_WHATIF_FROM_MESSAGE = (
    "What if: no what-if: the allocator's out-of-memory observer did not run (a pluggable allocator?), so there "
    "is no snapshot and no trace to replay; only the message was read"
)


def _whatif(
    snap_path: Path, device: int, memory_limit_bytes: int | None, physical_total_bytes: int | None
) -> dict[str, Any]:
    """The what-if panel of the OOM snapshot (the trace under the common allocator settings: which avoid the
    OOM, the smallest memory that runs it), for the failing device: `{"device": panel, "text": text}`. A
    simulator failure becomes the panel's one line, never an exception."""
    try:
        w = _native.whatif(str(snap_path), memory_limit_bytes, physical_total_bytes)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # a Rust panic arrives as pyo3's PanicException, a BaseException
        why = f"the allocator simulator could not replay the snapshot ({type(e).__name__}: {e})"
        return {"device": {"device": device, "unavailable": why, "rows": []}, "text": f"What if: no what-if: {why}"}
    panels = [p for p in w["devices"] if p["device"] == device]
    if not panels:
        why = f"the snapshot has no trace or segments for GPU {device}"
        return {"device": {"device": device, "unavailable": why, "rows": []}, "text": f"What if: no what-if: {why}"}
    return {"device": panels[0], "text": w["text"]}


def _observer(device: int, alloc: int, device_total: int, device_free: int) -> None:
    """Called by PyTorch's allocator (GIL held) right before it raises OutOfMemoryError."""
    for h in list(_handlers):
        if h.active:
            try:
                h._on_oom(int(device), int(alloc), int(device_total), int(device_free))
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # never turn an OOM into a different crash (a Rust panic included)
                print(f"torchmem: could not write the out-of-memory report: {e}", file=sys.stderr)


class OomHandler:
    """Returned by `on_oom`. `reports` lists the report files written; `disable()` stops it; usable as a
    context manager (disables on exit)."""

    def __init__(self, directory: Path, active: bool, recording: dict[str, Any] | None, torch: Any) -> None:
        self.directory = directory
        self.active = active
        self.recording = recording
        self.reports: list[Path] = []
        self.snapshots: list[Path] = []
        self._torch = torch
        self._count = 0

    def disable(self) -> None:
        """Stops writing reports and stops the history recording on_oom started."""
        if self.active and self.recording is not None and self._torch is not None:
            _stop_recording(self._torch)
        self.active = False
        with _lock:
            if self in _handlers:
                _handlers.remove(self)

    def __enter__(self) -> OomHandler:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        torch = self._torch
        if (
            torch is not None
            and self.active
            and exc is not None
            and isinstance(exc, torch.OutOfMemoryError)
            and not self.reports
        ):
            # The observer did not run (e.g. a pluggable allocator): diagnose from the message.
            try:
                self._report_from_message(str(exc))
            except Exception as e:
                print(f"torchmem: could not write the out-of-memory report: {e}", file=sys.stderr)
        self.disable()
        return False

    def _paths(self) -> tuple[Path, Path, Path]:
        self._count += 1
        # Under torchrun/Slurm every rank writes its own files, named by rank (and attempt, after a restart),
        # by the same rule as the Monitor and the recorder (`_rank`).
        rank, _local, _world = _rank.identity()
        _node, restart = _rank.launch()
        who = str(os.getpid()) if rank is None else f"rank{rank}-{os.getpid()}"
        if rank is not None and restart:
            who = f"rank{rank}-restart{restart}-{os.getpid()}"
        stem = f"oom-{who}-{time.strftime('%Y%m%d-%H%M%S')}-{self._count}"
        self.directory.mkdir(parents=True, exist_ok=True)
        d = self.directory
        return d / f"{stem}.pickle", d / f"{stem}-report.txt", d / f"{stem}-report.json"

    def _on_oom(self, device: int, alloc: int, device_total: int, device_free: int) -> None:
        torch = self._torch
        stats = torch.cuda.memory_stats(device)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        where = _user_frames()
        snap_path, txt_path, json_path = self._paths()
        snapshot_error = None
        try:
            torch.cuda.memory._dump_snapshot(str(snap_path))
        except Exception as e:
            snapshot_error = str(e)
        # The observer gets the allowed maximum instead of the device total when a memory fraction is set.
        try:
            physical_total = int(torch.cuda.get_device_properties(device).total_memory)
        except Exception:
            physical_total = None
        memory_limit = device_total if physical_total is not None and device_total < physical_total else None
        self._write_report(
            snap_path if snapshot_error is None else None,
            (txt_path, json_path),
            device=device,
            alloc=alloc,
            allocated=allocated,
            reserved=reserved,
            device_total=device_total,
            device_free=device_free,
            where=where,
            snapshot_error=snapshot_error,
            memory_limit_bytes=memory_limit,
            physical_total_bytes=physical_total,
        )

    def _write_report(
        self,
        snap_path: Path | None,
        out: tuple[Path, Path],
        *,
        device: int,
        alloc: int,
        allocated: int,
        reserved: int,
        device_total: int,
        device_free: int,
        where: list[str],
        snapshot_error: str | None = None,
        memory_limit_bytes: int | None = None,
        physical_total_bytes: int | None = None,
    ) -> None:
        """Writes the text and JSON report from the numbers at the failure and the snapshot written then
        (None: not written, `snapshot_error` says why). Needs no GPU: the snapshot is read in Rust."""
        txt_path, json_path = out
        diag = _native.oom_diagnosis(alloc, allocated, reserved, device_total, device_free, None, device)
        holders: list[SiteRow] = []
        whatif: dict[str, Any] | None = None
        if snap_path is not None:
            try:
                s = _native.snapshot_summary(str(snap_path), 10, 2**62)
                for t in s["top"]:
                    if t["device"] == device:
                        holders = t["rows"]
            except Exception as e:
                snapshot_error = f"snapshot written but unreadable: {e}"
                snap_path = None
        if snap_path is not None:
            whatif = _whatif(snap_path, device, memory_limit_bytes, physical_total_bytes)
        report = {
            "pid": os.getpid(),
            "device": device,
            "requested_bytes": alloc,
            "device_total_bytes": device_total,
            "device_free_bytes": device_free,
            "memory_limit_bytes": memory_limit_bytes,
            "allocated_bytes": allocated,
            "reserved_bytes": reserved,
            "reserved_unallocated_bytes": reserved - allocated,
            "allocating_frames": where,
            "top_holders": holders,
            "diagnosis": {k: v for k, v in diag.items() if k != "text"},
            "what_if": None if whatif is None else whatif["device"],
            "snapshot": str(snap_path) if snap_path is not None else None,
            "snapshot_error": snapshot_error,
            "recording": self.recording,
        }
        lines = [f"torchmem out-of-memory report (pid {os.getpid()}, GPU {device})", ""]
        lines.append("Being allocated when it failed:")
        lines += [f"  {f}" for f in where[:6]] or ["  (no Python frames)"]
        lines += ["", diag["text"].rstrip(), "", "Top holders at the failure (live blocks by allocation site):"]
        if holders:
            for h in holders[:10]:
                lines.append(f"  {h['bytes']:>16,d} B  {h['count']:>6} blocks  {h['site']}")
        else:
            lines.append("  (unknown: no snapshot)" if snapshot_error else "  (no live blocks)")
        lines.append("")
        if whatif is not None:
            lines.append(whatif["text"].rstrip())
        else:
            lines.append("What if: no what-if: the allocator simulator needs the snapshot, which was not written")
        if snap_path is None:
            lines.append(f"\nSnapshot: not written ({snapshot_error})")
        else:
            limit = f" --memory-limit {memory_limit_bytes}" if memory_limit_bytes is not None else ""
            lines.append(
                f"\nSnapshot: {snap_path}\n  torchmem snapshot {snap_path} --top 20 --html {snap_path}.html{limit}"
            )
        txt_path.write_text("\n".join(lines) + "\n")
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        # Under `torchmem run` the post-mortem goes into the profile too (the merged report's first OOM).
        from . import _events

        _events.emit(
            {"type": "blob", "t_ns": _events.now_ns(), "name": "oom", "data": {**report, "unix_s": time.time()}}
        )
        _events.flush()
        self.reports.append(txt_path)
        if snap_path is not None:
            self.snapshots.append(snap_path)
        print(f"torchmem: CUDA out of memory; report written to {txt_path}", file=sys.stderr)

    def _report_from_message(self, message: str) -> None:
        _, txt_path, json_path = self._paths()
        diag = _native.explain_oom(message)
        txt_path.write_text(diag["text"].rstrip("\n") + "\n\n" + _NO_WHATIF_FROM_MESSAGE + "\n")
        json_path.write_text(json.dumps({k: v for k, v in diag.items() if k != "text"}, indent=2) + "\n")
        self.reports.append(txt_path)


def on_oom(
    directory: str | os.PathLike[str],
    max_entries: int = 100_000,
    stacks: str | None = "python",
    record_history: bool = True,
) -> OomHandler:
    """On a CUDA out-of-memory error, write a snapshot and a short report to `directory`.

    The report says what was being allocated (size and Python frames); allocated, reserved, and
    reserved-but-unallocated bytes at the failure; the top holders by allocation site; next steps
    computed from the numbers; and what if: the recorded trace replayed under the common allocator
    settings (expandable segments, max_split_size_mb, ...): which would have avoided the error, and the
    smallest memory that runs it (needs the history). With `record_history=True` (default) the allocator's
    history is recorded from now on (ring buffer of `max_entries`), so the snapshot has the timeline leading
    to the failure.
    The OutOfMemoryError still propagates as usual. Without CUDA: warns and returns an inactive handler."""
    global _observer_attached
    if stacks not in _VALID_STACKS:
        raise ValueError(f"stacks must be 'python', 'all' or None, not {stacks!r}")
    directory = Path(directory)
    torch = _import_torch()
    if not _cuda_ready(torch):
        warnings.warn(
            "torchmem.on_oom: no CUDA device, so there is nothing to watch; no report will be written",
            RuntimeWarning,
            stacklevel=2,
        )
        return OomHandler(directory, False, None, None)
    recording = None
    if record_history:
        try:
            recording = _start_recording(torch, max_entries, stacks, "all")
        except Exception as e:
            warnings.warn(f"torchmem.on_oom: cannot record allocator history: {e}", RuntimeWarning, stacklevel=2)
    handler = OomHandler(directory, True, recording, torch)
    with _lock:
        if not _observer_attached:
            try:
                torch._C._cuda_attach_out_of_memory_observer(_observer)
                _observer_attached = True
            except Exception as e:
                warnings.warn(
                    f"torchmem.on_oom: cannot attach the allocator's OOM observer ({e}); use `with "
                    "torchmem.on_oom(dir):` around the code so the report is built from the error message",
                    RuntimeWarning,
                    stacklevel=2,
                )
        _handlers.append(handler)
    return handler
