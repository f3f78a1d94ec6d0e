"""`torchmem.Monitor`: watches a training loop. `with mon.epoch():` and `with mon.step():` mark epochs and
steps; given a model and an optimizer it records the forward, backward and optimizer-step phases by itself
through hooks (module forward pre/post hooks, a gradient hook on the model's output that queues an autograd
end-of-backward callback, optimizer step pre/post hooks). Each phase reads RSS and the allocator's counters
(~13 µs on CUDA, never the 122-key `memory_stats()` dict) and opens an exact peak window.

It prints one line per epoch, warns when memory grows epoch after epoch (the `total_loss += loss` leak),
and gives the per-epoch/per-phase tables (`summary()`), the data (`to_dict()`) and the memory journey
(`journey()`, text or Mermaid), all computed by the Rust core from the markers it recorded. Every marker also
goes to the recorder when the program runs under `torchmem run`.
"""

from __future__ import annotations

import json
import sys
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from . import _native, _rank
from . import api as _api


class MemoryGrowthWarning(UserWarning):
    """Memory grew at the end of every epoch: something keeps tensors alive across epochs."""


class Monitor:
    """Memory of a training loop, per epoch, step and phase.

    ```python
    mon = torchmem.Monitor(model, optimizer)
    for epoch in range(epochs):
        with mon.epoch():
            for x, y in loader:
                with mon.step():
                    loss = loss_fn(model(x), y)   # "forward" recorded by hooks
                    loss.backward()               # "backward"
                    optimizer.step()              # "optimizer step"
                    optimizer.zero_grad()
    print(mon.summary()); print(mon.journey())
    ```

    `device`: the CUDA device to read (default: the model's, else the current one). `verbose`: print a line
    per epoch (to stderr). `warn`: a `MemoryGrowthWarning` when memory grows every epoch. `keep_markers`: how
    many occurrences of each step and phase keep their markers in `mon.markers` (None: all); the tables,
    counts and peaks always cover every occurrence, so a million-step run does not grow the Monitor.
    """

    def __init__(
        self,
        model: Any = None,
        optimizer: Any = None,
        *,
        device: Any = None,
        verbose: bool = True,
        warn: bool = True,
        title: str = "torchmem memory journey",
        keep_markers: int | None = 100,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        # The rank this Monitor runs in (torchrun/Slurm), None outside a distributed job.
        self.rank, self.local_rank, self.world_size = _rank.identity()
        self.verbose = verbose
        self.warn = warn
        self.title = title
        self.markers: list[dict[str, Any]] = []
        self.epoch_lines: list[str] = []
        self.growth_messages: list[str] = []
        self._device_arg = device
        self._first_param: Any = None
        self._epoch_markers: list[dict[str, Any]] = []
        self._epoch_index = 0
        self._step_index = 0
        self._handles: list[Any] = []
        self._phase: dict[str, _api._Span] = {}
        self._forward_depth = 0
        self._warned = False
        # A training run can take millions of steps: markers of steps and phases are kept for the first
        # `keep_markers` occurrences of each name only; the aggregates below cover every occurrence, so the
        # tables stay exact while the Monitor's memory stays flat.
        self.keep_markers = keep_markers
        self._open: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._seen: dict[tuple[str, str], int] = {}
        self._phase_agg: dict[str, list[Any]] = {}
        self._peak_seen: list[int | None] = [None, None, None]  # steps' highest allocated, reserved, RSS
        ref = weakref.ref(self)

        def sink(marker: dict[str, Any]) -> None:
            mon = ref()
            if mon is not None:
                mon._take(marker)

        self._sink = sink
        _api._sinks.append(sink)
        if _api._last_device_check is not None:
            self.markers.append(_api._last_device_check)
        else:
            _api._mark("Device checked", self._dev())
        if model is not None:
            _api._mark("Model initialised", self._dev())
            self._hook_model(model)
        if optimizer is not None:
            self._hook_optimizer(optimizer)

    # --- markers and aggregates ---------------------------------------------------------------------------

    def _take(self, marker: dict[str, Any]) -> None:
        kind = marker["kind"]
        if kind != "step" and kind != "phase":
            self.markers.append(marker)  # epochs and marks: few, always kept
            return
        key = (kind, marker["name"])
        done = self._seen.get(key, 0)
        if marker["edge"] == "start":
            self._open.setdefault(key, []).append(marker)
            if kind == "phase" and marker["name"] not in self._phase_agg:
                self._phase_agg[marker["name"]] = _new_phase_row()  # rows in order of first start
        elif marker["edge"] == "end":
            self._seen[key] = done + 1
            stack = self._open.get(key)
            start = stack.pop() if stack else None
            if start is not None and kind == "step":
                # The highest values any step reached (phases keep theirs in their rows; epochs and marks
                # are kept as markers).
                _fold_span_peaks(self._peak_seen, 0, start["memory"], marker["memory"])
            elif start is not None:
                self._aggregate_phase(marker["name"], start, marker)
        if self.keep_markers is None or done < self.keep_markers:
            self.markers.append(marker)

    def _aggregate_phase(self, name: str, start: dict[str, Any], end: dict[str, Any]) -> None:
        """Folds one finished phase into its row, as `analysis::phase_rows` computes it from all markers."""
        row = self._phase_agg.get(name)
        if row is None:
            row = self._phase_agg[name] = _new_phase_row()
        entry, exit_ = start["memory"], end["memory"]
        row[0] += 1
        row[1] += max(0, end["t_ns"] - start["t_ns"])
        for slot, key in ((2, "allocated_bytes"), (4, "rss_bytes")):
            before, after = entry.get(key), exit_.get(key)
            if before is not None and after is not None:
                row[slot] += after - before
                row[slot + 1] += 1
        _fold_span_peaks(row, 6, entry, exit_)

    def _aggregates_json(self) -> str:
        phases = []
        peaks = list(self._peak_seen)
        for start in self._open.get(("step", "step"), []):  # a step still running: its entry values count
            _fold_span_peaks(peaks, 0, start["memory"])
        for name, done in self._phase_agg.items():
            r = list(done)
            for start in self._open.get(("phase", name), []):  # still open: counted, entry values only
                r[0] += 1
                _fold_span_peaks(r, 6, start["memory"])
            for i in range(3):
                peaks[i] = _max_opt(peaks[i], r[6 + i])
            phases.append(
                {
                    "name": name,
                    "count": r[0],
                    "total_ns": r[1],
                    "mean_delta_allocated_bytes": _mean_toward_zero(r[2], r[3]),
                    "max_peak_allocated_bytes": r[6],
                    "max_peak_reserved_bytes": r[7],
                    "mean_delta_rss_bytes": _mean_toward_zero(r[4], r[5]),
                    "max_peak_rss_bytes": r[8],
                }
            )
        steps = self._seen.get(("step", "step"), 0) + len(self._open.get(("step", "step"), []))
        return json.dumps(
            {
                "steps": steps,
                "phases": phases,
                "peak_allocated_bytes": peaks[0],
                "peak_reserved_bytes": peaks[1],
                "peak_rss_bytes": peaks[2],
            }
        )

    # --- device ---------------------------------------------------------------------------------------

    def _dev(self) -> int | None:
        torch = _api._torch()
        if torch is None:
            return None
        if self._device_arg is not None:
            return _api._cuda_index(self._device_arg, torch)
        if not _api._cuda_initialized(torch):
            return None
        if self.model is not None:
            # The first parameter, found once (walking the modules costs ~5 µs per phase on a GPU loop);
            # `model.to(...)` moves the same Parameter objects, so its device stays current.
            p = self._first_param
            if p is None:
                try:
                    p = self._first_param = next(self.model.parameters())
                except (StopIteration, AttributeError, TypeError):
                    p = None
            if p is not None:
                d = p.device
                return d.index if d.type == "cuda" else _api._cuda_index(None, torch)
        return _api._cuda_index(None, torch)

    def _capacity_bytes(self) -> int | None:
        dev = self._dev()
        if dev is not None:
            nv = _api._nvml(_api._torch(), dev)
            if nv is not None:
                return nv[0]
            torch = _api._torch()
            try:
                return int(torch.cuda.get_device_properties(dev).total_memory)
            except Exception:
                return None
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    # --- phases -----------------------------------------------------------------------------------------

    def _start(self, name: str) -> None:
        if name not in self._phase:
            self._phase[name] = _api._Span("phase", name, None, self._dev())

    def _end(self, name: str) -> None:
        span = self._phase.pop(name, None)
        if span is not None:
            span.close()

    def _hook_model(self, model: Any) -> None:
        self._handles.append(model.register_forward_pre_hook(self._forward_pre))
        self._handles.append(model.register_forward_hook(self._forward_post))

    def _forward_pre(self, module: Any, args: Any) -> None:
        self._forward_depth += 1
        if self._forward_depth == 1 and "backward" not in self._phase:
            self._start("forward")

    def _forward_post(self, module: Any, args: Any, output: Any) -> None:
        self._forward_depth = max(0, self._forward_depth - 1)
        if self._forward_depth or "forward" not in self._phase:
            return
        self._end("forward")
        torch = _api._torch()
        if torch is None or not torch.is_grad_enabled():
            return
        for t in _tensors(output, torch):
            if t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: Any) -> None:
        # The first gradient to reach the model's output: backward has begun. The engine calls the queued
        # callback when this backward pass has finished.
        if "backward" in self._phase:
            return
        self._start("backward")
        torch = _api._torch()
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._end("backward")

    def _hook_optimizer(self, optimizer: Any) -> None:
        self._handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._start("optimizer step")))
        self._handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self._end("optimizer step")))

    # --- epochs and steps ---------------------------------------------------------------------------------

    @contextmanager
    def step(self, index: int | None = None) -> Iterator[None]:
        """Marks one training step (its memory at entry and exit and the peak inside)."""
        if index is None:
            index = self._step_index
        self._step_index = index + 1
        span = _api._Span("step", "step", index, self._dev())
        try:
            yield
        finally:
            span.close()

    @contextmanager
    def epoch(self, index: int | None = None) -> Iterator[None]:
        """Marks one epoch; at its end prints the epoch's line and checks for growth across epochs."""
        if index is None:
            index = self._epoch_index
        self._epoch_index = index + 1
        span = _api._Span("epoch", "epoch", index, self._dev())
        self._epoch_markers.append(span.start)
        try:
            yield
        finally:
            end = span.close()
            self._epoch_markers.append(end)
            self._after_epoch()

    def _after_epoch(self) -> None:
        report = json.loads(_native.epoch_report_json(json.dumps(self._epoch_markers)))
        self.epoch_lines.append(report["line"])
        if self.verbose:
            who = "" if self.rank is None else f" rank {self.rank}"
            print(f"torchmem{who}: {report['line']}", file=sys.stderr)
        self.growth_messages = report["growth"]
        if self.growth_messages and self.warn and not self._warned:
            self._warned = True
            warnings.warn(MemoryGrowthWarning(self.growth_messages[0]), stacklevel=4)

    def mark(self, name: str) -> None:
        """A named point for the journey (e.g. "Data loaded"), with the memory now."""
        _api._mark(name, self._dev())

    # --- results --------------------------------------------------------------------------------------

    def _markers_json(self) -> str:
        return json.dumps(self.markers)

    def _journey_markers(self) -> str:
        # Each named point once: the first occurrence, except cleanup points (the last "Cache emptied").
        points: dict[str, dict[str, Any]] = {}
        for m in self.markers:
            if m["kind"] == "mark" and m["edge"] == "point":
                if m["name"] not in points or "cache" in m["name"].lower():
                    points[m["name"]] = m
        kept = [m for m in self.markers if m["kind"] != "mark"] + list(points.values())
        kept.sort(key=lambda m: m["t_ns"])
        return json.dumps(kept)

    def summary(self) -> str:
        """The per-epoch and per-phase tables and any growth warning, as text."""
        return _native.summary_text(self._markers_json(), self._capacity_bytes(), self._aggregates_json())

    def to_dict(self) -> dict[str, Any]:
        """The summary as data (epochs, phases, growth, journey) plus the raw markers."""
        data = json.loads(
            _native.summary_json(self._journey_markers(), self._capacity_bytes(), self._aggregates_json())
        )
        # The summary is the profile report's: its run and sample fields (command, exit code, sample counts,
        # peaks from samples, processes) are not measured in-process and would read as zeros or blanks.
        for key in _REPORT_ONLY_KEYS:
            data.pop(key, None)
        data["rank"], data["local_rank"], data["world_size"] = self.rank, self.local_rank, self.world_size
        data["epoch_lines"] = list(self.epoch_lines)
        data["markers"] = list(self.markers)
        return data

    def journey(self, format: str = "text") -> str:
        """The run's memory journey (device checked, model initialised, forward, backward, optimizer step,
        peak, cache emptied): `format="text"` or `"mermaid"` (a Mermaid `journey` diagram whose 1–5 scores
        fall as memory pressure rises)."""
        return _native.journey(
            self._journey_markers(), self._capacity_bytes(), format, self.title, self._aggregates_json()
        )

    def close(self) -> None:
        """Removes the hooks; the recorded data stays."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._sink in _api._sinks:
            _api._sinks.remove(self._sink)

    def _repr_html_(self) -> str:  # Jupyter's rich display (torchmem._jupyter)
        from ._jupyter import monitor_html

        return monitor_html(self)

    def __repr__(self) -> str:
        steps = self._seen.get(("step", "step"), 0) + len(self._open.get(("step", "step"), []))
        dev = self._dev()
        where = "CPU" if dev is None else f"cuda:{dev}"
        hooked = [what for what, obj in (("model", self.model), ("optimizer", self.optimizer)) if obj is not None]
        hooks = " and ".join(hooked) or "no hooks"
        return (
            f"<torchmem.Monitor {where}, {hooks}: {self._epoch_index} epoch{'' if self._epoch_index == 1 else 's'}, "
            f"{steps} step{'' if steps == 1 else 's'}, {len(self.markers)} markers kept>"
        )

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._sink in _api._sinks:
                _api._sinks.remove(self._sink)
        except Exception:
            pass


_REPORT_ONLY_KEYS = (
    "command",
    "exit_code",
    "duration_ns",
    "samples",
    "torch_samples",
    "gpu_samples",
    "peak",
    "processes",
)

_PEAK_KEYS = (
    ("peak_allocated_bytes", "allocated_bytes"),
    ("peak_reserved_bytes", "reserved_bytes"),
    ("peak_rss_bytes", "rss_bytes"),
)


def _new_phase_row() -> list[Any]:
    # count, total_ns, Σ Δallocated, n, Σ ΔRSS, n, max peak allocated, max peak reserved, max peak RSS
    return [0, 0, 0, 0, 0, 0, None, None, None]


def _fold_span_peaks(into: list[Any], at: int, entry: dict[str, Any], exit_: dict[str, Any] | None = None) -> None:
    """Raises `into[at:at + 3]` (allocated, reserved, RSS) to a span's highest values, as `analysis::span_peaks`
    takes them from markers: the exit's peak, else its current value, and the entry's; entry only while open."""
    for i, (peak_key, now_key) in enumerate(_PEAK_KEYS):
        v = entry.get(now_key)
        if exit_ is not None:
            v = _max_opt(exit_.get(peak_key), _max_opt(exit_.get(now_key), v))
        into[at + i] = _max_opt(into[at + i], v)


def _max_opt(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return a if a > b else b


def _mean_toward_zero(total: int, n: int) -> int | None:
    """Σ/n rounded toward zero, as Rust's integer division does (Python's // rounds down)."""
    if n == 0:
        return None
    q = abs(total) // n
    return q if total >= 0 else -q


def _tensors(output: Any, torch: Any, depth: int = 0) -> list[Any]:
    """The tensors in a module's output (a tensor, tuple, list, dict or ModelOutput), two levels deep."""
    if isinstance(output, torch.Tensor):
        return [output]
    if depth >= 2:
        return []
    if isinstance(output, dict):
        items = list(output.values())
    elif isinstance(output, (tuple, list)):
        items = list(output)
    else:
        return []
    found: list[Any] = []
    for item in items:
        found.extend(_tensors(item, torch, depth + 1))
    return found
