"""`torchmem estimate`: predicts a training run's GPU memory on a machine without that GPU, from the unchanged
program. The step runs on an emulated CUDA device (fake tensors: no device memory, no compute), backward and
optimizer included; the storage trace it records, with CUDA's choices and library workspaces (`_rules`), is an
allocator snapshot that the allocator simulator (`torchmem simulate`) replays for peak allocated and reserved.

    est = torchmem.estimate(step, gpu="A100-40GB", steps=3)   # step() runs one training step on "cuda"
    est.peak_reserved_bytes, est.nvml_bytes, est.fits
    est.peak_reserved_upper_bytes, est.nvml_upper_bytes, est.uncertainty   # the interval and its reasons

The report (fits, margins, phases, largest tensors) comes from the same Rust code as `torchmem estimate
--trace` (the torchmem-estimator crate), called in-process through `_native.estimate_report`: no CLI process
is started, and the CLI and this function agree.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ._device import EstimateUnsupported, GpuSpec

if TYPE_CHECKING:
    from .._types import EstimateReport, GpuCatalogueEntry, RankClass, Uncertainty

__all__ = ["Estimate", "EstimateUnsupported", "GpuSpec", "estimate", "gpu_catalogue", "gpu_spec"]


def gpu_catalogue() -> list[GpuCatalogueEntry]:
    """The GPU catalogue (one table, in Rust: the one `torchmem estimate --list-gpus --json` prints)."""
    from .. import _native

    return _native.gpu_catalogue()


def _find_gpu(name: str) -> GpuCatalogueEntry:
    """The catalogue entry for `name`, by the CLI's alias rule (`--gpu`)."""
    from .. import _native

    try:
        return _native.find_gpu(name)
    except ValueError as e:
        raise EstimateUnsupported(str(e)) from None


def gpu_spec(name: str) -> GpuSpec:
    """The emulated device for a catalogue GPU (case-insensitive key, e.g. "H200", "A100-40GB", "L4")."""
    g = _find_gpu(name)
    return GpuSpec(g["name"], g["cuda_total_bytes"], g["major"], g["minor"], g["multi_processor_count"])


@dataclass
class Estimate:
    """A prediction. Bytes throughout; `nvml_bytes` is what nvidia-smi would show for the process.

    The `*_bytes` peaks are point estimates; `*_upper_bytes` the interval's upper ends (the trace simulated again
    with what is not exactly known at its largest: an unrecorded convolution's cuDNN workspace, another GPU's
    cuDNN choices, NCCL's range), `uncertainty` the reasons ({kind, what, op, shapes, site, calls, bytes}), largest
    first; empty when upper == point. `fits` means the upper bound fits; `fits_point` is the point's answer."""

    gpu: str
    device_memory_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    nvml_bytes: int
    fits: bool
    margin_bytes: int
    steps: int
    # "training" (optimizer steps seen), "inference" (no backward, no optimizer step) or "backward without
    # optimizer step"; see docs/estimator.md §1.1.
    kind: str = "training"
    forward_calls: int = 0
    phases: dict[str, int] = field(default_factory=dict)
    largest_at_peak: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trace_seconds: float = 0.0
    # The emulated world (issue 24): its size, the traced rank, the modelled NCCL part of nvml_bytes and the rank
    # classes ({ranks, traced_rank, peak_allocated_bytes, peak_reserved_bytes, nvml_bytes, fits}), worst first.
    world_size: int = 1
    rank: int = 0
    nccl_bytes: int = 0
    ranks: list[RankClass] = field(default_factory=list)
    peak_allocated_upper_bytes: int = 0
    peak_reserved_upper_bytes: int = 0
    nvml_upper_bytes: int = 0
    margin_upper_bytes: int = 0
    fits_point: bool = True
    uncertainty: list[Uncertainty] = field(default_factory=list)
    report: EstimateReport = field(default_factory=dict, repr=False)  # type: ignore[assignment]

    def __str__(self) -> str:
        return self.report.get("text", repr(self))


def estimate(
    step: Callable[[], Any],
    *,
    gpu: str = "H200",
    steps: int = 3,
    alloc_conf: str = "",
    device_memory: int | str | None = None,
    trace_path: str | os.PathLike | None = None,
    world_size: int | None = None,
    rank: int | None = None,
    nproc_per_node: int | None = None,
) -> Estimate:
    """Runs `step()` `steps` times on an emulated `gpu` (CUDA tensors are fake: create the model, data and
    optimizer inside `step` or before the first call inside it, on "cuda") and predicts its peak memory there.
    `step` may train or only run inference (`generate`, an evaluation batch): `kind` says which was seen.

    `alloc_conf` is a PYTORCH_CUDA_ALLOC_CONF to simulate, `device_memory` a capacity instead of the GPU's
    ("24GB" or bytes), `trace_path` keeps the trace (an allocator snapshot) for `torchmem simulate`.

    `world_size` / `rank` / `nproc_per_node`: `step` runs as `rank` of an emulated distributed world (torch's fake
    process group; `init_process_group` inside `step` joins it); default WORLD_SIZE / RANK from the environment,
    else 1 rank. `ranks` lists the rank classes, `nccl_bytes` the modelled NCCL part of `nvml_bytes`."""
    from .. import _native
    from ..simulation import _size
    from . import _runner, _snapshot
    from ._session import Session, StopTrace, translate_error

    if steps < 1:
        raise ValueError("steps must be at least 1")
    spec = gpu_spec(gpu)
    # The CLI's one size parser ("24GB", "14g", bytes), checked before the trace runs.
    memory_bytes = _size(device_memory, "device_memory")
    t0 = time.perf_counter()
    from ._distributed import world_from_env

    world = world_from_env(world_size, rank, nproc_per_node)

    def trace_rank(w, path: Path | None) -> tuple[dict, dict]:
        session = Session(spec, steps_limit=None, world=w)
        t = time.perf_counter()
        try:
            with session:
                for _ in range(steps):
                    step()
        except StopTrace:
            pass
        except Exception as e:  # noqa: BLE001 - fake-tensor errors get the estimate's message
            translated = translate_error(e)
            if translated is not None:
                raise translated from e
            raise
        summary = _runner.summary(session, reason="steps", seconds=time.perf_counter() - t)
        with tempfile.TemporaryDirectory(prefix="torchmem-estimate-") as d:
            trace = path if path is not None else Path(d) / "trace.pickle"
            _snapshot.write(_snapshot.build(session.tracer, alloc_conf=alloc_conf), trace)
            try:
                report = _native.estimate_report(
                    str(trace), summary, gpu=gpu, device_memory_bytes=memory_bytes, alloc_conf=alloc_conf or None
                )
            except ValueError as e:
                raise EstimateUnsupported(f"the estimate's report failed: {e}") from e
        return summary, report

    summary, report = trace_rank(world, Path(trace_path) if trace_path is not None else None)
    # Ranks that differ (pipeline stages, uneven shards): `step` keeps its own state between calls (its model, made
    # on the first call), so it cannot run again as another rank here; the other classes are listed untraced
    # (`traced: False`, the traced rank's numbers) and a note names the rank to pass for each. The CLI traces them.
    untraced = [c for c in report.get("ranks", []) if not c.get("traced", True)]
    if untraced:
        report = dict(report)  # type: ignore[assignment]
        report["notes"] = [
            f"{len(report['ranks'])} classes of ranks: only rank {report.get('rank', 0)}'s was traced here; "
            + "; ".join(
                f"estimate(..., rank={c['traced_rank']}) for ranks {c['ranks'][0]}.. ({c['what']})" for c in untraced
            )  # fmt: skip
            + " (`torchmem estimate` traces every class)",
            *report.get("notes", []),
        ]
    seconds = time.perf_counter() - t0
    return Estimate(
        gpu=report["gpu"],
        device_memory_bytes=report["device_memory_bytes"],
        peak_allocated_bytes=report["peak_allocated_bytes"],
        peak_reserved_bytes=report["peak_reserved_bytes"],
        nvml_bytes=report["nvml_bytes"],
        fits=report["fits"],
        margin_bytes=report["margin_bytes"],
        steps=summary["steps_traced"],
        kind=summary["kind"],
        forward_calls=summary["forward_calls"],
        phases=summary["phase_peak_bytes"],
        largest_at_peak=summary["largest_at_peak"],
        notes=report.get("notes", []),
        trace_seconds=seconds,
        world_size=report.get("world_size", 1),
        rank=report.get("rank", 0),
        nccl_bytes=report.get("nccl_bytes", 0),
        ranks=report.get("ranks", []),
        peak_allocated_upper_bytes=report["peak_allocated_upper_bytes"],
        peak_reserved_upper_bytes=report["peak_reserved_upper_bytes"],
        nvml_upper_bytes=report["nvml_upper_bytes"],
        margin_upper_bytes=report["margin_upper_bytes"],
        fits_point=report["fits_point"],
        uncertainty=report["uncertainty"],
        report=report,
    )
