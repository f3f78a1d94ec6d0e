"""Leaks named by the line that holds them, for `torchmem.Monitor`.

At every step end the Monitor hands this module the step's end reading (allocated bytes on CUDA, RSS) it
already made; the Rust detector (`_native.StepGrowthDetector`, `analysis/leaks.rs`) decides whether memory
grows step after step. Only then does a **probe** run for a few steps (`probe_steps`, then off):

- every tensor a torch function returns is recorded, by weak reference, with the first frame outside torch,
  torchmem and the standard library (a `torch.overrides.TorchFunctionMode`: it sees `loss + total_loss`,
  `+=` on tensors, `.detach()`, `.cpu()`, `.clone()`, the model's outputs, for a fraction of a dispatch
  mode's cost; `bench/leaks.py` measures it);
- at each probe step end, the autograd graphs that live tensors hold are walked once (`grad_fn.next_functions`
  and the `_saved_*` tensors, storage-unique, within a node budget), and `tracemalloc` takes a snapshot
  compared by line (Python objects: a dict or list that grows).

What keeps a line's tensors: after the first probe step end, the containers (list, dict, deque) that refer to
the live tensors are watched, and for the remaining probe steps a line tracer on the user's own frames (not
torch's, not torchmem's) notes the line after which each container grew (`kept.append(out)`); at the end the
container is named by the variable that holds it in the caller's frames (or the object attribute), and an
in-place holder (`total_loss += loss`) by its variable. The probe's graph walk reads saved tensors through
torchmem's own saved-tensor hook (`_breakdown.py`), which never runs torch code under the probe's mode.

After the probe the per-line facts go to Rust (`_native.leak_findings`), which names the lines that keep
memory alive; they are warned about (`MemoryGrowthWarning`, pointing at the line), kept for `Monitor.leaks()`,
and sent to the recorder under `torchmem run` (the `leaks` blob, read by `torchmem report`). A healthy run
pays one call into Rust per step and nothing else. Allocator history with stacks is never recorded (it breaks
the backward pass of checkpointed models on torch 2.11).
"""

from __future__ import annotations

import collections
import gc
import linecache
import os
import sys
import sysconfig
import tracemalloc
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from . import _events, _native

if TYPE_CHECKING:
    from ._types import LeakFinding, LeakReport, StepGrowth

# The node budget of one probe step end's graph walks (all lines together).
_GRAPH_NODE_BUDGET = 200_000
# How many findings one probe may report at most is Rust's business; lines kept for Rust are pre-filtered:
_PYTHON_MIN_NET_BYTES = 4096

_INTERNAL_PREFIXES: tuple[str, ...] | None = None


def _internal_prefixes() -> tuple[str, ...]:
    """Folders whose frames are not "the user's line": torch, torchmem, the standard library."""
    global _INTERNAL_PREFIXES
    if _INTERNAL_PREFIXES is None:
        dirs = [os.path.dirname(os.path.abspath(__file__))]
        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(torch.__file__)))
        for key in ("stdlib", "platstdlib"):
            p = sysconfig.get_paths().get(key)
            if p:
                dirs.append(os.path.abspath(p))
        _INTERNAL_PREFIXES = tuple(d.rstrip(os.sep) + os.sep for d in dirs) + ("<frozen ",)
    return _INTERNAL_PREFIXES


class LeakDetector:
    """Step-level growth detection and, after growth, a probe that names the lines that hold the memory.

    `probe_steps`: how many steps a probe records (then it is off again). `warmup_steps`, `window_steps`: the
    growth rule's warm-up and window (see `analysis/leaks.rs`). `max_probes`: probes per run at most (a probe
    that finds nothing re-arms the detector). `warn`: issue a `MemoryGrowthWarning` naming the line.
    """

    def __init__(
        self,
        *,
        probe_steps: int = 5,
        warmup_steps: int = 5,
        window_steps: int = 8,
        max_probes: int = 3,
        warn: bool = True,
        rank: int | None = None,
    ) -> None:
        if probe_steps < 3:
            raise ValueError(f"probe_steps={probe_steps}: a probe needs at least 3 steps to see what survives")
        self.probe_steps = probe_steps
        self.max_probes = max_probes
        self.warn = warn
        self.rank = rank
        self.reports: list[LeakReport] = []
        self.findings: list[LeakFinding] = []
        self.warned = False
        self._growth = _native.StepGrowthDetector(warmup_steps, window_steps)
        self._probe: _Probe | None = None
        self._probes = 0

    @property
    def probing(self) -> bool:
        return self._probe is not None

    def step_end(self, memory: dict[str, Any], index: int | None) -> None:
        """The Monitor's hook at each step end (`memory`: the step's end reading)."""
        probe = self._probe
        if probe is None:
            if self._probes >= self.max_probes:
                return
            found = self._growth.push(
                memory.get("allocated_bytes"), memory.get("rss_bytes"), _native.malloc_free_bytes()
            )
            if found is not None:
                self._start(found, index)
            return
        probe.step_end()
        if probe.step >= probe.steps:
            self._finish(probe)

    def probe_now(self, steps: int | None = None) -> None:
        """Starts a probe of `steps` steps (default `probe_steps`) at once, without waiting for growth (for
        `bench/leaks.py`, or a leak you suspect)."""
        if self._probe is None:
            self._start(None, None, steps)

    def _start(self, growth: StepGrowth | None, index: int | None, steps: int | None = None) -> None:
        torch = sys.modules.get("torch")
        if torch is None:
            return
        self._probes += 1
        self._probe = _Probe(torch, steps or self.probe_steps, None if index is None else index + 1, growth)

    def _finish(self, probe: _Probe) -> None:
        self._probe = None
        data = probe.close()
        report = _native.leak_findings(data)
        self.reports.append(report)
        self._growth.rearm()
        # A line that holds a growing autograd graph comes first: the tensors other lines made (the batch, the
        # labels) are often alive only because that graph saved them.
        found = sorted(report["findings"], key=lambda f: not f.get("holds_graph"))
        report["findings"] = found
        if not found:
            return
        self._probes = self.max_probes  # named: no more probes
        self.findings.extend(found)
        if _events.enabled():
            _events.emit(
                {
                    "type": "blob",
                    "t_ns": _events.now_ns(),
                    "name": "leaks",
                    "data": {"pid": os.getpid(), "rank": self.rank, **report, "findings": self.findings},
                }
            )
            _events.flush()
        if self.warn and not self.warned:
            self.warned = True
            from .monitor import MemoryGrowthWarning

            top = found[0]
            more = f" ({len(found) - 1} more line(s): mon.leaks())" if len(found) > 1 else ""
            # At the line that keeps the memory (`kept.append(out)`) when the probe saw it, else where it was made.
            kept = top.get("kept_in") or {}
            where = (kept["file"], kept["line"]) if kept.get("line") else (top["file"], top["line"])
            warnings.warn_explicit(
                MemoryGrowthWarning(f"torchmem: memory grows every step: {top['message']}{more}"),
                MemoryGrowthWarning,
                where[0],
                where[1],
                registry={},
            )

    def close(self) -> None:
        """Ends a probe still running (the Monitor closes)."""
        probe, self._probe = self._probe, None
        if probe is not None:
            probe.close()


class _Probe:
    """Records, for a few steps, every tensor torch functions return and the Python allocations by line."""

    def __init__(self, torch: Any, steps: int, first_step: int | None, growth: StepGrowth | None) -> None:
        self.torch = torch
        self.steps = steps
        self.first_step = first_step
        self.growth = growth
        self.step = 0
        self.busy = False
        self.records: list[tuple[Any, int, int]] = []  # (weakref, site, probe step)
        self.seen: dict[int, Any] = {}  # id -> weakref of every tensor recorded: each is new once
        self.holders: dict[int, dict[int, Any]] = {}  # site -> {id: weakref}: in-place outputs with a grad_fn
        self.sites: dict[tuple[str, int], int] = {}
        self.site_list: list[tuple[str, int, str]] = []
        self.internal: dict[Any, bool] = {}
        self.graph_bytes: dict[int, list[int]] = {}
        self.graph_nodes: dict[int, list[int]] = {}
        self.graph_truncated: set[int] = set()
        self.graph_keys: dict[int, set[tuple[str, int]]] = {}
        self.held_by: dict[int, int] = {}  # line -> the line whose larger graph holds its live tensors
        self.saved_names: dict[type, list[str]] = {}
        self.python: list[dict[tuple[str, int], tuple[int, int]]] = []
        self.prefixes = _internal_prefixes()
        self.unpacking = False  # inside a graph walk's unpack of a saved tensor
        self.unpack_ok = True  # False once an unpack ran torch code (saved-tensor hooks that recompute)
        # What keeps the tensors: watched containers (id -> [container, length]) and the lines they grew at.
        self.watched: dict[int, list[Any]] = {}
        self.grew_at: dict[int, collections.Counter[tuple[str, int]]] = {}
        self.last_line: tuple[str, int] | None = None
        self.tracing = False
        self.started_tracemalloc = not tracemalloc.is_tracing()
        if self.started_tracemalloc:
            tracemalloc.start(1)
        self.mode = _RecordingMode(self, torch)
        self.mode.__enter__()

    # --- recording (inside every torch function call) ---------------------------------------------------

    def site(self, frame: Any) -> int | None:
        internal = self.internal
        prefixes = self.prefixes
        while frame is not None:
            code = frame.f_code
            inside = internal.get(code)
            if inside is None:
                inside = internal[code] = code.co_filename.startswith(prefixes)
            if not inside:
                key = (code.co_filename, frame.f_lineno)
                sid = self.sites.get(key)
                if sid is None:
                    sid = self.sites[key] = len(self.site_list)
                    self.site_list.append((code.co_filename, frame.f_lineno, code.co_name))
                return sid
            frame = frame.f_back
        return None

    def record(self, out: Any, args: tuple[Any, ...], frame: Any) -> None:
        Tensor = self.torch.Tensor
        if isinstance(out, Tensor):
            outs: tuple[Any, ...] | list[Any] = (out,)
        elif isinstance(out, (tuple, list)) and out and isinstance(out[0], Tensor):
            outs = out
        else:
            return
        site = self.site(frame)
        if site is None:
            return
        param = self.torch.nn.Parameter
        inputs = [a for a in args if isinstance(a, Tensor)]
        for a in args:
            if isinstance(a, (list, tuple)):  # foreach ops (`_foreach_add_(state_steps, 1)`) take lists
                inputs.extend(x for x in a if isinstance(x, Tensor))
        seen = self.seen
        for t in outs:
            if not isinstance(t, Tensor) or isinstance(t, param):
                continue
            key = id(t)
            known = seen.get(key)
            if known is not None and known() is t:
                continue  # returned again (a view op returning self, an optimizer's state): made once, earlier
            if any(t is a for a in inputs):
                # In place (`total_loss += loss`, `x.add_(y)`): not a new tensor; it may hold a growing graph.
                if t.grad_fn is not None:
                    self.holders.setdefault(site, {})[id(t)] = weakref.ref(t)
                continue
            ref = weakref.ref(t)
            seen[key] = ref
            self.records.append((ref, site, self.step))

    # --- probe step ends ---------------------------------------------------------------------------------

    def step_end(self) -> None:
        self.busy = True
        try:
            self._check_containers()
            self.records = [r for r in self.records if r[0]() is not None]
            self.seen = {k: r for k, r in self.seen.items() if r() is not None}
            self._walk_graphs()
            self._snapshot_python()
            if self.step == 0 and self.steps > 2:
                self._watch_containers()
        finally:
            self.busy = False
        self.step += 1

    # --- what keeps the tensors ------------------------------------------------------------------------------

    def _internal(self, code: Any) -> bool:
        inside = self.internal.get(code)
        if inside is None:
            inside = self.internal[code] = code.co_filename.startswith(self.prefixes)
        return inside

    def _watch_containers(self) -> None:
        """Watches the containers that refer to live recorded tensors, and traces the user's lines."""
        tensors = [t for t in (r[0]() for r in self.records) if t is not None]
        if not tensors:
            return
        kinds = (list, dict, collections.deque)
        mine = {id(self.records), id(self.seen), id(self.holders), id(tensors)}
        for c in gc.get_referrers(*tensors):
            if type(c) in kinds and id(c) not in mine and len(self.watched) < 64:
                self.watched[id(c)] = [c, len(c)]
        del tensors
        if not self.watched or sys.gettrace() is not None:  # a debugger or coverage tracer: leave it alone
            return
        self.tracing = True
        sys.settrace(self._trace_call)
        f = sys._getframe(1)
        while f is not None:
            if not self._internal(f.f_code):
                f.f_trace = self._trace_line
            f = f.f_back

    def _trace_call(self, frame: Any, event: str, arg: Any) -> Any:
        return None if self._internal(frame.f_code) else self._trace_line

    def _trace_line(self, frame: Any, event: str, arg: Any) -> Any:
        if event in ("line", "return"):
            self._check_containers()
            if event == "line":
                self.last_line = (frame.f_code.co_filename, frame.f_lineno)
        return self._trace_line

    def _check_containers(self) -> None:
        for cid, w in self.watched.items():
            n = len(w[0])
            if n > w[1] and self.last_line is not None:
                self.grew_at.setdefault(cid, collections.Counter())[self.last_line] += 1
            w[1] = n

    def _stop_tracing(self) -> None:
        if not self.tracing:
            return
        self.tracing = False
        sys.settrace(None)
        f = sys._getframe(1)
        while f is not None:
            if f.f_trace is not None and getattr(f.f_trace, "__self__", None) is self:
                f.f_trace = None
            f = f.f_back

    def _names(self, obj: Any) -> str | None:
        """The variable (in the user's frames on the stack, or the main module) or attribute bound to `obj`."""
        f = sys._getframe(1)
        while f is not None:
            if not self._internal(f.f_code):
                for scope in (f.f_locals, f.f_globals):
                    for name, value in scope.items():
                        if value is obj:
                            return name
            f = f.f_back
        for ref in gc.get_referrers(obj):
            if type(ref) is dict:
                for owner in gc.get_referrers(ref):
                    if getattr(owner, "__dict__", None) is ref:
                        for name, value in ref.items():
                            if value is obj:
                                return f"{type(owner).__name__}.{name}"
        return None

    def _kept_in(self, site: int, steps: int) -> dict[str, Any] | None:
        """What keeps `site`'s tensors from the earlier probe steps: a watched container (named, with the line
        it grew at), or for an in-place holder (`total_loss += loss`) its variable."""
        tensors = []
        for ref, s, step in self.records:
            t = ref() if s == site and step < steps - 1 else None
            if t is not None:
                tensors.append(t)
        best, hits = None, 0
        for cid, (c, _) in self.watched.items():
            values = c.values() if isinstance(c, dict) else c
            n = sum(1 for v in values for t in tensors if v is t)
            if n > hits:
                best, hits = cid, n
        if best is not None:
            c = self.watched[best][0]
            row: dict[str, Any] = {"container": type(c).__name__, "name": self._names(c)}
            lines = self.grew_at.get(best)
            if lines:
                (f, ln), _ = lines.most_common(1)[0]
                row.update(file=f, line=ln, source=linecache.getline(f, ln).strip())
            return row
        for ref in self.holders.get(site, {}).values():
            t = ref()
            if t is not None:
                name = self._names(t)
                if name is not None:
                    return {"container": "variable", "name": name}
        return None

    def _live_holders(self) -> dict[int, list[Any]]:
        roots: dict[int, list[Any]] = {}
        for ref, site, _ in self.records:
            t = ref()
            if t is not None and t.grad_fn is not None:
                roots.setdefault(site, []).append(t)
        for site, refs in self.holders.items():
            for key, ref in list(refs.items()):
                t = ref()
                if t is None:
                    del refs[key]
                elif t.grad_fn is not None:
                    roots.setdefault(site, []).append(t)
        return roots

    def _walk_graphs(self) -> None:
        budget = _GRAPH_NODE_BUDGET
        roots_of = self._live_holders()
        walked: dict[int, set[Any]] = {}  # this step end only: the graph nodes behind each line's live tensors
        for site, tensors in sorted(roots_of.items(), key=lambda kv: -len(kv[1])):
            saved_bytes, seen, keys, truncated = self._walk(tensors, budget)
            nodes = len(seen)
            walked[site] = seen
            budget = max(0, budget - nodes)
            series = self.graph_bytes.setdefault(site, [0] * self.step)
            series.extend([0] * (self.step - len(series)))
            series.append(saved_bytes)
            counts = self.graph_nodes.setdefault(site, [0] * self.step)
            counts.extend([0] * (self.step - len(counts)))
            counts.append(nodes)
            self.graph_keys[site] = keys
            if truncated:
                self.graph_truncated.add(site)
        # A line whose live tensors' grad_fns all lie inside a larger graph another line holds is held by it
        # (the outputs of `model(x)` inside the graph `total_loss += loss` keeps).
        # Empty tensors hold no memory and may hang off the graph (non-reentrant checkpoint's
        # `_NoopSaveInputs` saver, kept by its frame, not by an autograd edge): left out of the test.
        for site, tensors in roots_of.items():
            mine = {t.grad_fn for t in tensors if t.numel()} or {t.grad_fn for t in tensors}
            for other, seen in walked.items():
                if other != site and len(seen) > len(walked.get(site, ())) and mine <= seen:
                    self.held_by[site] = other
                    break
            else:
                self.held_by.pop(site, None)
        walked.clear()

    def _walk(self, roots: list[Any], budget: int) -> tuple[int, set[Any], set[tuple[str, int]], bool]:
        """Saved-tensor bytes (each storage once) and node count of the graphs behind `roots`."""
        Tensor = self.torch.Tensor
        seen: set[Any] = set()
        stack = [t.grad_fn for t in roots if t.grad_fn is not None]
        keys: dict[tuple[str, int], int] = {}
        truncated = False
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            if len(seen) >= budget:
                truncated = True
                break
            seen.add(fn)
            names = self.saved_names.get(type(fn))
            if names is None:
                names = self.saved_names[type(fn)] = [
                    n for n in dir(fn) if n.startswith("_saved_") or n == "saved_tensors"
                ]
            for name in names if self.unpack_ok else ():
                # Unpacking runs saved-tensor hooks; one that runs torch code (non-reentrant checkpoint would
                # recompute its forward) is stopped by the recording mode, and no more saves are unpacked.
                self.unpacking = True
                try:
                    value = getattr(fn, name)
                except Exception:  # freed by backward, or stopped
                    continue
                finally:
                    self.unpacking = False
                values = value if isinstance(value, (tuple, list)) else (value,)
                for v in values:
                    if isinstance(v, Tensor):
                        try:
                            st = v.untyped_storage()
                            keys[(str(v.device), st.data_ptr())] = st.nbytes()
                        except Exception:
                            continue
            for nxt, _ in fn.next_functions:
                if nxt is not None and nxt not in seen:
                    stack.append(nxt)
        return sum(keys.values()), seen, set(keys), truncated

    def _snapshot_python(self) -> None:
        snap = tracemalloc.take_snapshot().filter_traces(
            (
                tracemalloc.Filter(False, __file__),
                tracemalloc.Filter(False, tracemalloc.__file__),
                tracemalloc.Filter(False, "<frozen importlib._bootstrap*>"),
            )
        )
        self.python.append(
            {(s.traceback[0].filename, s.traceback[0].lineno): (s.size, s.count) for s in snap.statistics("lineno")}
        )

    # --- the end ----------------------------------------------------------------------------------------

    def close(self) -> dict[str, Any]:
        """Stops recording and returns the probe's facts (`analysis::leaks::ProbeData`)."""
        self.busy = True
        self._check_containers()
        self._stop_tracing()
        try:
            self.mode.__exit__(None, None, None)
        except Exception:
            pass
        if self.started_tracemalloc:
            tracemalloc.stop()
        steps = max(1, self.step)
        # Live tensors per line and creation step, each storage counted once (at its earliest record).
        storages: set[tuple[str, int]] = set()
        per_site: dict[int, dict[str, Any]] = {}
        site_keys: dict[int, set[tuple[str, int]]] = {}
        for ref, site, step in self.records:
            t = ref()
            if t is None or step >= steps:
                continue
            try:
                st = t.untyped_storage()
                key, nbytes = (str(t.device), st.data_ptr()), st.nbytes()
            except Exception:
                continue
            row = per_site.setdefault(site, {"device": str(t.device), "live": [0] * steps, "bytes": [0] * steps})
            row["live"][step] += 1
            site_keys.setdefault(site, set()).add(key)
            if key not in storages:
                storages.add(key)
                row["bytes"][step] += nbytes
        # A line whose live storages are all saved tensors of another line's graph is held by that line.
        holder_of: dict[int, str] = {}
        for site, holder in self.held_by.items():
            f, ln, _ = self.site_list[holder]
            holder_of[site] = f"{f}:{ln}"
        for site, keys in site_keys.items():
            if site in holder_of:
                continue
            for holder, saved in self.graph_keys.items():
                if holder != site and keys and keys <= saved and _rises(self.graph_bytes.get(holder, [])):
                    f, ln, _ = self.site_list[holder]
                    holder_of[site] = f"{f}:{ln}"
                    break
        tensors = []
        for site in sorted(set(per_site) | set(self.graph_bytes)):
            f, ln, fn = self.site_list[site]
            row = per_site.get(site, {"device": self._graph_device(site), "live": [0] * steps, "bytes": [0] * steps})
            graph = self.graph_bytes.get(site, [])
            tensors.append(
                {
                    "file": f,
                    "line": ln,
                    "function": fn,
                    "source": linecache.getline(f, ln).strip(),
                    "device": row["device"],
                    "live_by_step": row["live"],
                    "live_bytes_by_step": row["bytes"],
                    "graph_bytes_by_step": graph + [0] * (steps - len(graph)) if graph else [],
                    "graph_nodes_by_step": (
                        self.graph_nodes[site] + [0] * (steps - len(self.graph_nodes[site])) if graph else []
                    ),
                    "graph_truncated": site in self.graph_truncated,
                    "held_by": holder_of.get(site),
                    "inplace_live": sum(1 for r in self.holders.get(site, {}).values() if r() is not None),
                    "graph_saves_unread": not self.unpack_ok,
                    "kept_in": None if site in holder_of else self._kept_in(site, steps),
                }
            )
        python = []
        if self.python:
            first, last = self.python[0], self.python[-1]
            for key, (size, _) in last.items():
                if size - first.get(key, (0, 0))[0] < _PYTHON_MIN_NET_BYTES:
                    continue
                f, ln = key
                python.append(
                    {
                        "file": f,
                        "line": ln,
                        "source": linecache.getline(f, ln).strip(),
                        "size_bytes_by_step": [snap.get(key, (0, 0))[0] for snap in self.python],
                        "count_by_step": [snap.get(key, (0, 0))[1] for snap in self.python],
                    }
                )
        self.records.clear()
        self.holders.clear()
        self.watched.clear()
        return {
            "probe_steps": steps,
            "first_step": self.first_step,
            "growth": self.growth,
            "tensors": tensors,
            "python": python,
        }

    def _graph_device(self, site: int) -> str:
        for ref in self.holders.get(site, {}).values():
            t = ref()
            if t is not None:
                return str(t.device)
        return "cpu"


def _rises(series: list[int]) -> bool:
    return len(series) >= 2 and series[-1] > series[0]


def _make_mode_class(torch: Any) -> type:
    base = torch.overrides.TorchFunctionMode

    class RecordingMode(base):  # type: ignore[misc, valid-type]
        """Records what torch functions return, for the probe (on only during probe steps)."""

        def __init__(self, probe: _Probe) -> None:
            super().__init__()
            self.probe = probe

        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            probe = self.probe
            if probe.unpacking and getattr(func, "__name__", "") not in ("__get__", "__set__"):
                probe.unpack_ok = False
                raise RuntimeError("torchmem: a saved-tensor hook runs torch code; not unpacked")
            out = func(*args, **(kwargs or {}))
            if not probe.busy and getattr(func, "__name__", "") not in ("__get__", "__set__"):
                try:
                    probe.busy = True
                    probe.record(out, args, sys._getframe(1))
                except Exception:
                    pass
                finally:
                    probe.busy = False
            return out

    return RecordingMode


_mode_class: type | None = None


def _RecordingMode(probe: _Probe, torch: Any) -> Any:
    global _mode_class
    if _mode_class is None:
        _mode_class = _make_mode_class(torch)
    return _mode_class(probe)
