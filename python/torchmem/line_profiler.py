"""Line-by-line memory profiling, CPU and GPU together (memory_profiler's successor).

`@torchmem.profile` (or `torchmem.profile(fn)`) registers a function's code object with the native hooks in
`torchmem._native` (crates/torchmem-py/src/line*): `sys.monitoring` local events on Python >= 3.12,
`PyEval_SetTrace` with a C callback on older versions. The function is returned unchanged, so calling it costs
nothing extra outside its own lines. At exit, or on `print_profile()`, the tables are rendered by Rust
(`torchmem_core::lines`) and printed; under `torchmem run` the data also goes to the recorder.

`torchmem run --line script.py` calls `_bootstrap_line([""], script)`: a builtin `profile` is injected so
unmodified memory_profiler scripts run; `--line=FILE_OR_MODULE:FUNCTION` picks functions by name as they are
first called. Column meanings: docs/line-profiler.md.
"""

from __future__ import annotations

import atexit
import builtins
import inspect
import linecache
import os
import sys
import threading
import types
import warnings
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, TextIO

from . import _events, _native

if TYPE_CHECKING:
    from ._types import LinePayload

_MONITORING = sys.version_info >= (3, 12)
_TOOL_NAME = "torchmem"

_lock = threading.RLock()
_started = False
_failed = False
_tool_id: Optional[int] = None
_codes: dict[int, types.CodeType] = {}
_specs: list[_Spec] = []
_events_at_print = -1
_atexit_done = False
_run_info: dict[str, Any] = {}


_realpaths: dict[str, str] = {}


def _realpath(filename: str) -> str:
    """os.path.realpath, once per file (the matcher sees every code object of the program once)."""
    real = _realpaths.get(filename)
    if real is None:
        real = _realpaths[filename] = os.path.realpath(filename)
    return real


class _Spec:
    """One `--line=FILE_OR_MODULE:FUNCTION` target, matched against code objects as they first run."""

    def __init__(self, text: str, script_path: str) -> None:
        target, sep, func = text.rpartition(":")
        if not sep or not target or not func:
            raise ValueError(
                f"--line={text!r}: expected FILE_OR_MODULE:FUNCTION, e.g. --line=train.py:step "
                "or --line=mypkg.data:collate"
            )
        self.text = text
        self.func = func
        self.path: Optional[str] = None
        self.module_suffixes: tuple[str, ...] = ()
        if target == "__main__":
            self.path = os.path.realpath(script_path)
        elif target.endswith(".py") or os.sep in target or os.path.exists(target):
            self.path = os.path.realpath(target)
        else:
            rel = target.replace(".", os.sep)
            self.module_suffixes = (os.sep + rel + ".py", os.sep + rel + os.sep + "__init__.py")

        self.matched = False
        #: Functions seen running in the target file, in first-call order (for "no function matched").
        self.seen: dict[str, None] = {}

    def in_target(self, code: types.CodeType) -> bool:
        filename = _realpath(code.co_filename)
        if self.path is not None:
            return filename == self.path
        return filename.endswith(self.module_suffixes)

    def matches(self, code: types.CodeType) -> bool:
        if not self.in_target(code):
            return False
        qualname = getattr(code, "co_qualname", code.co_name)
        if code.co_name != "<module>" and len(self.seen) < 50:
            self.seen.setdefault(qualname, None)
        if self.func != qualname and self.func != code.co_name:
            return False
        self.matched = True
        return True

    def unmatched_message(self) -> str:
        where = os.path.basename(self.path) if self.path else self.text.rpartition(":")[0]
        if self.seen:
            return f"no function matched --line={self.text}; functions seen in {where}: {', '.join(self.seen)}"
        return f"no function matched --line={self.text}; no code from {self.path or where} ran"


def _gpu_probe() -> Optional[tuple[int, Callable[..., Any], Callable[..., Any]]]:
    """None until the program has initialised CUDA; then the device and the two cheap allocator calls."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    # Reads use the allocator's own binding; resets go through the peak ledger, so open `torchmem.peak()` /
    # `track()` windows stay exact and the program's own `max_memory_allocated()` does not change.
    from . import _ledger

    return (torch.cuda.current_device(), _ledger.raw_stats(torch), _ledger.line_profiler_reset)


def _monitoring_masks() -> tuple[int, int]:
    e = sys.monitoring.events
    local = e.LINE | e.PY_START | e.PY_RESUME | e.PY_RETURN | e.PY_YIELD
    global_ = e.PY_UNWIND | e.PY_THROW | (e.PY_START if _specs else 0)
    return local, global_


def _start_monitoring() -> None:
    global _tool_id
    mon = sys.monitoring
    for tool in (2, 3, 4):
        try:
            mon.use_tool_id(tool, _TOOL_NAME)
        except ValueError:
            continue
        _tool_id = tool
        break
    else:
        raise RuntimeError("sys.monitoring tool ids 2-4 are all taken by other tools")
    cbs = _native.line_monitoring_callbacks()
    e = mon.events
    name: Literal["line", "start", "resume", "exit"]
    for event, name in (
        (e.LINE, "line"),
        (e.PY_START, "start"),
        (e.PY_RESUME, "resume"),
        (e.PY_THROW, "resume"),
        (e.PY_RETURN, "exit"),
        (e.PY_YIELD, "exit"),
        (e.PY_UNWIND, "exit"),
    ):
        mon.register_callback(_tool_id, event, cbs[name])
    _native.line_set_disable(mon.DISABLE)
    mon.set_events(_tool_id, _monitoring_masks()[1])


def _start_settrace() -> None:
    if sys.gettrace() is not None:
        warnings.warn(
            "torchmem: a trace function (debugger or coverage) is active; the line profiler replaces it "
            "on this thread",
            RuntimeWarning,
            stacklevel=4,
        )
    if not _native.line_trace_install(True):
        raise RuntimeError("PyEval_SetTrace is not exported by this interpreter")
    # Threads already running (a worker pool started before profiling): they get the trace function too, so
    # a profiled function they call later is measured. New threads get it from threading.settrace.
    if _native.line_trace_install_all() is None:
        warnings.warn(
            "torchmem: threads started before profiling began are not traced (this interpreter does not export "
            "_PyEval_SetTrace); start profiling before starting threads",
            RuntimeWarning,
            stacklevel=4,
        )
    threading.settrace(_native.line_thread_installer)


def _start() -> bool:
    """Start the hooks once; on any failure warn and leave the program unprofiled (never raise)."""
    global _started, _failed
    with _lock:
        if _started or _failed:
            return _started
        try:
            gate = os.environ.get("TORCHMEM_LINE_GATE_NS")
            info = _native.line_start(
                "monitoring" if _MONITORING else "settrace", float(gate) if gate else None, _gpu_probe
            )
            _run_info.update(info)
            if _specs:
                _native.line_set_matcher(_matcher)
            if _MONITORING:
                _start_monitoring()
            else:
                _start_settrace()
        except Exception as exc:  # the user's program must run even if profiling cannot start
            _failed = True
            _native.line_stop()
            warnings.warn(f"torchmem: line profiler disabled: {exc}", RuntimeWarning, stacklevel=3)
            return False
        atexit.register(_at_exit)
        _started = True
        return True


def _add_code(code: types.CodeType) -> None:
    if id(code) in _codes:
        return
    _codes[id(code)] = code
    _native.line_add_code(code, code.co_firstlineno, list(code.co_lines()))
    if _MONITORING and _tool_id is not None:
        sys.monitoring.set_local_events(_tool_id, code, _monitoring_masks()[0])
        if _specs:
            sys.monitoring.restart_events()


def _code_of(obj: Any) -> Optional[types.CodeType]:
    for attr in ("__func__", "__wrapped__"):
        while hasattr(obj, attr) and not hasattr(obj, "__code__"):
            obj = getattr(obj, attr)
    code = getattr(obj, "__code__", None)
    return code if isinstance(code, types.CodeType) else None


def profile(func: Any = None, stream: Optional[TextIO] = None, precision: int = 1, backend: str = "") -> Any:
    """Profile `func` line by line (decorator; also `profile(fn)`). Returns `func` itself, unchanged.

    The keyword arguments of memory_profiler's `profile` (`stream`, `precision`, `backend`) are accepted and
    ignored, so existing scripts run."""
    if func is None:
        return lambda f: profile(f)
    code = _code_of(func)
    if code is None:
        warnings.warn(f"torchmem.profile: {func!r} has no Python code to profile", RuntimeWarning, stacklevel=2)
        return func
    if _start():
        with _lock:
            try:
                _add_code(code)
            except Exception as exc:
                warnings.warn(f"torchmem.profile: cannot profile {func!r}: {exc}", RuntimeWarning, stacklevel=2)
    return func


def _matcher(code: types.CodeType) -> bool:
    hit = False
    for spec in _specs:  # every spec sees the code (each records what ran in its file)
        hit = spec.matches(code) or hit
    if hit:
        with _lock:
            _add_code(code)
    return hit


def _noop_profile(func: Any = None, **_kwargs: Any) -> Any:
    return (lambda f: f) if func is None else func


_bootstrapped = False
_decorated_mode = False


def _bootstrap_line(specs: list[str], script_path: str) -> None:
    """Called by `torchmem run --line[=SPEC]` before the user's script runs."""
    global _bootstrapped, _decorated_mode
    _bootstrapped = True
    decorated = _decorated_mode = "" in specs or not specs
    builtins.profile = profile if decorated else _noop_profile  # type: ignore[attr-defined]
    _install_memory_profiler_shim(builtins.profile)  # type: ignore[attr-defined]
    for text in specs:
        if not text:
            continue
        try:
            _specs.append(_Spec(text, script_path))
        except ValueError as exc:
            print(f"torchmem: {exc}", file=sys.stderr)
    if _start() and _specs:  # idempotent: also right when the hooks were already started
        _native.line_set_matcher(_matcher)
        if _MONITORING and _tool_id is not None:
            sys.monitoring.set_events(_tool_id, _monitoring_masks()[1])


# --- `from memory_profiler import profile` under `torchmem run --line` ---------------------------------------

_MP = "memory_profiler"
_mp_told = False


def _tell_memory_profiler() -> None:
    global _mp_told
    if not _mp_told:
        _mp_told = True
        print(
            "torchmem: `memory_profiler.profile` is torchmem's line profiler under `torchmem run --line` "
            "(torchmem's tables replace memory_profiler's)",
            file=sys.stderr,
        )


class _MemoryProfilerShim:
    """A meta-path finder for `memory_profiler` under `torchmem run --line`: the installed module with its
    `profile` replaced by torchmem's, or, without memory_profiler, a module that has only `profile`."""

    def __init__(self, profile_fn: Callable[..., Any]) -> None:
        self.profile_fn = profile_fn

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _MP:
            return None
        import importlib.machinery
        import importlib.util

        real = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            try:
                real = finder.find_spec(fullname, path, target)
            except ImportError:
                real = None  # a finder that says it is not installed
                break
            if real is not None:
                break
        shim = self
        if real is None or real.loader is None:

            class _ShimLoader:
                def create_module(self, spec: Any) -> None:
                    return None

                def exec_module(self, module: types.ModuleType) -> None:
                    shim._fill(module, installed=False)

            return importlib.machinery.ModuleSpec(fullname, _ShimLoader(), origin="torchmem (memory_profiler shim)")
        real_loader = real.loader

        class _PatchingLoader:
            def create_module(self, spec: Any) -> Any:
                return real_loader.create_module(spec) if hasattr(real_loader, "create_module") else None

            def exec_module(self, module: types.ModuleType) -> None:
                try:
                    real_loader.exec_module(module)
                except ModuleNotFoundError as exc:  # installed but broken, or deliberately absent
                    if exc.name not in (None, _MP):
                        raise
                    shim._fill(module, installed=False)
                    return
                shim._fill(module, installed=True)

        real.loader = _PatchingLoader()
        return real

    def _fill(self, module: types.ModuleType, installed: bool) -> None:
        module.profile = self.profile_fn  # type: ignore[attr-defined]
        if not installed:
            module.__doc__ = "torchmem's stand-in for memory_profiler under `torchmem run --line`: only `profile`."
        _tell_memory_profiler()


def _install_memory_profiler_shim(profile_fn: Callable[..., Any]) -> None:
    existing = sys.modules.get(_MP)
    if existing is not None:  # imported before the bootstrap (a sitecustomize of the environment)
        existing.profile = profile_fn  # type: ignore[attr-defined]
        return
    sys.meta_path.insert(0, _MemoryProfilerShim(profile_fn))


def _report_unmatched() -> None:
    """At exit of a `torchmem run --line` program: say when nothing was profiled, and why."""
    for spec in _specs:
        if not spec.matched:
            print(f"torchmem: {spec.unmatched_message()}", file=sys.stderr)
    if _decorated_mode and not _specs and not _codes:
        print(
            "torchmem: --line: no function was decorated with @profile in this run; decorate one, or name it: "
            "--line=FILE_OR_MODULE:FUNCTION",
            file=sys.stderr,
        )


def _source(code: types.CodeType) -> tuple[list[str], int]:
    try:
        lines, start = inspect.getsourcelines(code)
        if start > 0:
            return lines, start
    except (OSError, TypeError):
        pass
    numbers = [ln for _, _, ln in code.co_lines() if ln is not None] or [code.co_firstlineno]
    start, end = min(code.co_firstlineno, min(numbers)), max(numbers)
    return [linecache.getline(code.co_filename, n) for n in range(start, end + 1)], start


def _row(entry: dict[str, Any], r: tuple) -> None:
    _, hits, rss, cpu, cpu_max, g_alloc, g_peak, g_res = r
    entry.update(
        hits=hits,
        cpu_rss_bytes=rss,
        cpu_delta_bytes=cpu,
        cpu_delta_max_bytes=cpu_max,
        gpu_alloc_delta_bytes=g_alloc,
        gpu_peak_bytes=g_peak,
        gpu_reserved_delta_bytes=g_res,
    )


def profile_data() -> LinePayload:
    """The line profile as one JSON-able payload (the `data` of the `line_profile` event; schema in
    docs/line-profiler.md); all numbers in bytes."""
    snap = _native.line_snapshot()
    functions = []
    for f in snap["functions"]:
        code = f["code"]
        rows = {r[0]: r for r in f["lines"]}
        if not rows and not f["calls"]:
            continue
        src, start = _source(code)
        lines = []
        for i, text in enumerate(src):
            entry: dict[str, Any] = {"line": start + i, "source": text.rstrip("\r\n"), "hits": 0}
            r = rows.pop(start + i, None)
            if r is not None:
                _row(entry, r)
            lines.append(entry)
        for ln, r in sorted(rows.items()):
            entry = {"line": ln, "source": linecache.getline(code.co_filename, ln).rstrip("\r\n"), "hits": 0}
            _row(entry, r)
            lines.append(entry)
        functions.append(
            {
                "name": getattr(code, "co_qualname", code.co_name),
                "filename": code.co_filename,
                "first_line": code.co_firstlineno,
                "calls": f["calls"],
                "threads": f["threads"],
                "lines": lines,
            }
        )
    return {
        "schema": "torchmem.lines/1",
        "hook": snap.get("hook", ""),
        "gate_ns": snap.get("gate_ns", 0.0),
        "gpu_device": snap.get("gpu_device"),
        "python": ".".join(str(v) for v in sys.version_info[:3]),
        "reads": snap.get("reads", 0),
        "events": snap.get("events", 0),
        "warnings": snap.get("warnings", []),
        "functions": functions,
    }


def print_profile(stream: Optional[TextIO] = None) -> None:
    """Print the tables of every profiled function that ran (memory_profiler's layout, extended)."""
    global _events_at_print
    data = profile_data()
    _events_at_print = data["events"]
    if not data["functions"]:
        return
    text = _native.line_render_text([data])
    out = stream if stream is not None else sys.stdout
    out.write(text)
    out.flush()


def _at_exit() -> None:
    global _atexit_done
    if _atexit_done:
        return
    _atexit_done = True
    _native.line_stop()
    try:
        if _bootstrapped:
            _report_unmatched()
        data = profile_data()
        if data["functions"] and data["events"] != _events_at_print:
            print_profile()
        if data["functions"] and _events.enabled():
            _events.emit({"type": "line_profile", "t_ns": _events.now_ns(), "data": data})
    except Exception as exc:  # never turn a finished program into a failed one
        print(f"torchmem: line profile could not be written: {exc}", file=sys.stderr)
