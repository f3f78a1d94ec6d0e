"""torchmem's pytest plugin: memory limits for tests, in CI, on GPUs and CPUs.

Loaded by pytest in every run of an environment where torchmem is installed (the `pytest11` entry point), so
this module imports neither torch nor torchmem's extension: they load when a test carries one of the markers.
Disable it with `-p no:torchmem`.

    @pytest.mark.limit_memory("2 GiB", device="cuda", kind="allocated")   # or "reserved"; device="cpu": "rss"
    def test_step(): ...

    @pytest.mark.limit_leaks("16 MiB", device="cpu")                       # or device="cuda" ("allocated")
    def test_no_leak(): ...

What is measured (the test function's call only; fixtures are not, as with pytest-memray):

* `limit_memory`: the peak of `kind` during the call, above its level when the call started: the memory the
  test itself added at its highest point. `allocated`/`reserved` come from PyTorch's allocator counters of the
  CUDA device, `rss` is this process's resident set (its high-water mark, exact). Peaks come from torchmem's
  own peak windows, which stay exact even when the test resets torch's peak counters before the peak.
* `limit_leaks`: what the test still holds after it returned: `kind` after the call minus before it, both
  read after `gc.collect()` (and, for `rss`, after glibc's free heap is given back with `malloc_trim`), so
  memory kept alive by module globals, caches or reference cycles the collector cannot break counts, while
  the allocator's cached-but-free blocks do not. Allow slack for first-call caches, or warm up in a fixture.

A test over its limit fails with the status letter `M` ("MEMORY LIMIT"); its report gets a `torchmem`
section with the peak, the limit and the top allocation sites: on CUDA, the allocator's live blocks at the
peak by Python stack (from an allocator history recorded during the test); on the CPU, where the resident
set grew, sampled every millisecond and charged to the test thread's Python line at that moment. A
`device="cuda"` marker on a machine without CUDA skips the test with the reason. Works under pytest-xdist
(each worker measures its own process; results travel with the reports).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import linecache
import os
import re
import sys
import tempfile
import threading
from typing import Any

import pytest

MARKERS = ("limit_memory", "limit_leaks")
_KINDS_BY_DEVICE = {"cuda": ("allocated", "reserved"), "cpu": ("rss",)}
_LEAK_KINDS = {"cuda": ("allocated",), "cpu": ("rss",)}
_PROPERTY = "torchmem"

_limits_key = pytest.StashKey[list]()
_result_key = pytest.StashKey[dict]()


# --- parsing the markers ---------------------------------------------------------------------------------


def parse_size(text: Any) -> int:
    """Bytes from `"2 GiB"`, `"512MiB"`, `"2g"` (1024-based), `"24 MB"` (1000-based), `"100 B"`, or an int of
    bytes: torchmem's one size parser (`_native.parse_size`), so a marker's size means what `--memory-limit`
    means. Raises ValueError naming the accepted forms."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"memory limit {text!r}: expected a size such as '2 GiB' or an int of bytes")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"memory limit {text!r}: must not be negative")
        return text
    from . import _native

    try:
        return _native.parse_size(text)
    except ValueError as e:
        raise ValueError(f"memory limit {text!r}: {e}") from None


def _fmt(n: int | None) -> str:
    """Bytes as PyTorch writes them ("32.00 MiB"), by torchmem's one formatter."""
    if n is None:
        return "-"
    from . import _native

    return ("-" if n < 0 else "") + _native.format_bytes_torch(abs(n))


@dataclasses.dataclass(frozen=True)
class Limit:
    """One parsed marker: `marker` ("limit_memory" / "limit_leaks"), the limit in bytes, the device ("cpu" or
    "cuda" / "cuda:N") and the kind of memory."""

    marker: str
    limit_bytes: int
    device: str
    kind: str

    @property
    def on_cuda(self) -> bool:
        return self.device != "cpu"

    def describe(self) -> str:
        return f"{self.marker}({_fmt(self.limit_bytes)}, device={self.device!r}, kind={self.kind!r})"


def parse_marker(mark: Any) -> Limit:
    """A `Limit` from a `limit_memory` / `limit_leaks` marker; ValueError with the fix for bad arguments."""
    name = mark.name
    args, kwargs = list(mark.args), dict(mark.kwargs)
    if "limit" in kwargs:
        args.insert(0, kwargs.pop("limit"))
    if len(args) != 1:
        raise ValueError(f"{name} takes one limit, e.g. @pytest.mark.{name}('2 GiB'); got {len(args)} positional")
    device = kwargs.pop("device", "cuda")
    kind = kwargs.pop("kind", None)
    if kwargs:
        raise ValueError(f"{name}: unknown argument(s) {sorted(kwargs)}; it takes limit, device= and kind=")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:[0-9]+)?", device):
        raise ValueError(f"{name}: device={device!r}; expected 'cuda', 'cuda:N' or 'cpu'")
    family = "cpu" if device == "cpu" else "cuda"
    kinds = (_LEAK_KINDS if name == "limit_leaks" else _KINDS_BY_DEVICE)[family]
    if kind is None:
        kind = kinds[0]
    if kind not in kinds:
        hint = {
            ("cpu", "allocated"): "PyTorch keeps no allocated counter for the CPU: use kind='rss'",
            ("cpu", "reserved"): "PyTorch keeps no reserved counter for the CPU: use kind='rss'",
            ("cuda", "rss"): "RSS is CPU memory: use device='cpu'",
            ("cuda", "reserved"): "reserved memory is the allocator's cache, not a leak: use kind='allocated'",
        }.get((family, kind), f"expected one of {kinds}")
        raise ValueError(f"{name}: kind={kind!r} with device={device!r}: {hint}")
    return Limit(name, parse_size(args[0]), device, kind)


# --- pytest hooks ----------------------------------------------------------------------------------------


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("torchmem", "torchmem memory limits")
    group.addoption(
        "--torchmem-sites",
        type=int,
        default=5,
        metavar="N",
        help="allocation sites listed for a test over its memory limit (default 5; 0: none, and nothing is "
        "recorded to find them)",
    )


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        "limit_memory(limit, *, device='cuda', kind=None): fail when the test's peak memory above its start "
        "exceeds limit ('2 GiB'); device 'cuda[:N]' (kind 'allocated' or 'reserved') or 'cpu' (kind 'rss'); "
        "skipped without CUDA",
    )
    config.addinivalue_line(
        "markers",
        "limit_leaks(limit, *, device='cuda', kind=None): fail when the test still holds more than limit "
        "after it returned (after gc); device 'cuda[:N]' (kind 'allocated') or 'cpu' (kind 'rss')",
    )
    config.pluginmanager.register(_Summary(), "torchmem-summary")


def _cuda_skip_reason(device: str) -> str | None:
    """Why a CUDA-limited test cannot run here, or None. Imports torch (the test is a torch test) but never
    creates a CUDA context: `is_available()` and `device_count()` only ask the driver."""
    try:
        import torch
    except ImportError:
        return f"{device} memory limit: torch is not installed"
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken driver: nothing to measure either
        return f"{device} memory limit: CUDA is not usable ({exc})"
    if count == 0:
        return f"{device} memory limit: no CUDA device (torch.cuda.is_available() is False)"
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        return f"{device} memory limit: this machine has {count} CUDA device(s)"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    marks = [m for name in MARKERS if (m := item.get_closest_marker(name)) is not None]
    if not marks:
        return
    try:
        limits = [parse_marker(m) for m in marks]
    except ValueError as exc:
        error = f"torchmem: {exc}"
    else:
        error = None
    if error is not None:
        pytest.fail(error, pytrace=False)
    for limit in limits:
        if limit.on_cuda:
            reason = _cuda_skip_reason(limit.device)
            if reason is not None:
                # Reported at the test's own location, as a skip marker would be.
                raise pytest.skip.Exception(reason, _use_item_location=True)
    item.stash[_limits_key] = limits


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem: Any) -> Any:
    limits = pyfuncitem.stash.get(_limits_key, None)
    if not limits:
        yield
        return
    test_code = getattr(pyfuncitem.obj, "__code__", None)
    measurement = _Measurement(limits, pyfuncitem.config.getoption("torchmem_sites"), test_code)
    measurement.start()
    try:
        outcome = yield
    finally:
        measurement.stop_peak()
    passed = outcome.excinfo is None
    # After the call the test's frame is gone; a failed test's traceback still holds its locals, so its leak
    # would be meaningless (and it already failed).
    pyfuncitem.stash[_result_key] = measurement.finish(measure_leaks=passed, nodeid=pyfuncitem.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    outcome = yield
    if call.when != "call":
        return
    result = item.stash.get(_result_key, None)
    if result is None:
        return
    report = outcome.get_result()
    report.user_properties.append((_PROPERTY, json.dumps(result)))
    over = [c for c in result["checks"] if c["over"]]
    if over and report.passed:
        report.outcome = "failed"
        report.longrepr = "\n".join(c["message"] for c in over)
        report.sections.append(("torchmem", result["section"]))


def _torchmem_result(report: Any) -> dict | None:
    for key, value in getattr(report, "user_properties", ()):
        if key == _PROPERTY:
            return json.loads(value)
    return None


def pytest_report_teststatus(report: Any, config: Any) -> Any:
    if report.when == "call" and report.failed:
        result = _torchmem_result(report)
        if result is not None and any(c["over"] for c in result["checks"]):
            return "failed", "M", "MEMORY LIMIT"
    return None


class _Summary:
    """Gathers the results where the reports arrive (the xdist controller, or the only process): they ride in
    `user_properties`, which xdist serialises. One per pytest config, so nested runs (pytester) stay apart."""

    def __init__(self) -> None:
        self.results: list[dict] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "call":
            result = _torchmem_result(report)
            if result is not None:
                self.results.append(result)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        rows = [(r["nodeid"], c) for r in self.results for c in r["checks"]]
        if not rows:
            return
        rows.sort(key=lambda row: -row[1]["measured_bytes"])
        tr = terminalreporter
        tr.write_sep("=", "torchmem memory limits")
        for nodeid, c in rows:
            status = "OVER" if c["over"] else "ok"
            tr.write_line(
                f"{status:<4}  {c['what']:<34}  {_fmt(c['measured_bytes']):>10}  "
                f"limit {_fmt(c['limit_bytes']):>10}  {nodeid}"
            )


# --- measuring ---------------------------------------------------------------------------------------------


class _RssSiteSampler:
    """Where the resident set grows: every `interval_s` it reads RSS (statm, ~1 µs) and charges each increase
    to the test thread's Python stack at that moment. Statistical (a page fault burst between two samples is
    charged to the line running at the second), but cheap and blind to nothing that faults memory in: torch
    CPU tensors, numpy, Python objects, C extensions."""

    def __init__(self, thread_id: int, test_code: Any, interval_s: float = 0.001) -> None:
        from . import _native

        self._rss = _native.self_rss_bytes
        self._thread_id = thread_id
        self._test_code = test_code
        self._interval_s = interval_s
        self._stop = threading.Event()
        self.growth: dict[tuple, int] = {}
        self._thread = threading.Thread(target=self._run, name="torchmem-pytest-sampler", daemon=True)

    def start(self) -> None:
        self._last = self._rss() or 0
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def _sample(self) -> None:
        now = self._rss()
        if now is None:
            return
        if now > self._last:
            stack = _stack_of(self._thread_id, self._test_code)
            self.growth[stack] = self.growth.get(stack, 0) + (now - self._last)
        self._last = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # the growth since the last tick, charged to where the test thread is now


_HERE = os.path.dirname(os.path.abspath(__file__))


_OUTSIDE = (("(outside the test function: pytest, fixtures, teardown)", 0, ""),)


def _stack_of(thread_id: int, test_code: Any, depth: int = 4) -> tuple:
    """The innermost `depth` frames of a thread inside the test function (the test's own frame the outermost)
    as (filename, line, function), innermost first; `_OUTSIDE` when the thread is not in the test now."""
    frame = sys._current_frames().get(thread_id)
    out = []
    inside = test_code is None
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if len(out) < depth and not filename.startswith(_HERE):
            out.append((filename, frame.f_lineno, code.co_name))
        if code is test_code:
            inside = True
            break
        frame = frame.f_back
    if not inside:
        return _OUTSIDE
    return tuple(f for f in out if "/_pytest/" not in f[0] and "/pluggy/" not in f[0])


def _site_lines(stack: tuple) -> list[str]:
    lines = []
    for i, (filename, lineno, func) in enumerate(stack):
        if not lineno:
            lines.append(filename)
            continue
        source = linecache.getline(filename, lineno).strip()
        lead = "" if i == 0 else "called from "
        lines.append(f"{lead}{filename}:{lineno} in {func}" + (f"  `{source}`" if source else ""))
    return lines


class _Measurement:
    """The memory of one test call for its limits: a torchmem peak window per device, the kind's level before
    and after, and (when sites are wanted) an allocator history (CUDA) or an RSS sampler (CPU)."""

    def __init__(self, limits: list[Limit], sites: int, test_code: Any = None) -> None:
        self.limits = limits
        self.test_code = test_code
        self.sites = max(0, int(sites))
        self.devices = sorted({limit.device for limit in limits})
        self._windows: dict[str, Any] = {}
        self._start: dict[str, Any] = {}
        self._leak_before: dict[tuple[str, str], int | None] = {}
        self._sampler: _RssSiteSampler | None = None
        self._captures: dict[str, Any] = {}
        self._tmpdir: str | None = None

    def _level(self, device: str, kind: str) -> int | None:
        import torchmem

        s = torchmem.stats(device)
        return {"allocated": s.allocated_bytes, "reserved": s.reserved_bytes, "rss": s.rss_bytes}[kind]

    def _settle(self, device: str) -> None:
        gc.collect()
        gc.collect()
        if device == "cpu":
            from . import _native

            _native.malloc_trim()

    def start(self) -> None:
        import torchmem

        for limit in self.limits:
            if limit.marker == "limit_leaks":
                self._settle(limit.device)
                self._leak_before[(limit.device, limit.kind)] = self._level(limit.device, limit.kind)
        if self.sites:
            if any(d == "cpu" for d in self.devices):
                self._sampler = _RssSiteSampler(threading.get_ident(), self.test_code)
                self._sampler.start()
            for device in self.devices:
                if device != "cpu":
                    self._tmpdir = self._tmpdir or tempfile.mkdtemp(prefix="torchmem-pytest-")
                    path = os.path.join(self._tmpdir, device.replace(":", "") + ".pickle")
                    cap = torchmem.capture(path, stacks="python")
                    cap.__enter__()
                    self._captures[device] = cap
        for device in self.devices:
            self._start[device] = torchmem.stats(device)
            window = torchmem.peak(device)
            window.__enter__()
            self._windows[device] = window

    def stop_peak(self) -> None:
        for window in self._windows.values():
            window.__exit__(None, None, None)
        if self._sampler is not None:
            self._sampler.stop()
        for cap in self._captures.values():
            cap.__exit__(None, None, None)

    def finish(self, *, measure_leaks: bool, nodeid: str) -> dict:
        checks = []
        for limit in self.limits:
            if limit.marker == "limit_memory":
                start = self._start[limit.device]
                window = self._windows[limit.device]
                start_b = {
                    "allocated": start.allocated_bytes,
                    "reserved": start.reserved_bytes,
                    "rss": start.rss_bytes,
                }[limit.kind] or 0
                peak_b = {
                    "allocated": window.allocated_bytes,
                    "reserved": window.reserved_bytes,
                    "rss": window.rss_bytes,
                }[limit.kind]
                if peak_b is None:
                    continue
                measured = max(0, peak_b - start_b)
                what = f"peak {limit.kind} on {limit.device}"
                detail = (
                    f"peak {limit.kind} {_fmt(peak_b)} on {limit.device} during the test, "
                    f"{_fmt(measured)} above the {_fmt(start_b)} at its start"
                )
            else:
                if not measure_leaks:
                    continue
                self._settle(limit.device)
                before = self._leak_before[(limit.device, limit.kind)]
                after = self._level(limit.device, limit.kind)
                if before is None or after is None:
                    continue
                measured = after - before
                what = f"{limit.kind} held after the test on {limit.device}"
                detail = (
                    f"{limit.kind} on {limit.device}: {_fmt(before)} before the test, {_fmt(after)} after it "
                    f"(after gc): {_fmt(measured)} still held"
                )
            over = measured > limit.limit_bytes
            verdict = "exceeds" if over else "within"
            message = f"torchmem {limit.marker}: {detail}; {verdict} the limit of {_fmt(limit.limit_bytes)}"
            checks.append(
                {
                    "marker": limit.marker,
                    "device": limit.device,
                    "kind": limit.kind,
                    "limit_bytes": limit.limit_bytes,
                    "measured_bytes": measured,
                    "over": over,
                    "what": what,
                    "message": message,
                }
            )
        section = self._sites_text() or [
            "no allocation sites recorded" + (" (--torchmem-sites=0)" if not self.sites else "")
        ]
        self._cleanup()
        return {"nodeid": nodeid, "checks": checks, "section": "\n".join(section)}

    def _sites_text(self) -> list[str]:
        out: list[str] = []
        if self._sampler is not None and self._sampler.growth:
            top = sorted(self._sampler.growth.items(), key=lambda kv: -kv[1])[: self.sites]
            out.append("Top allocation sites, CPU (where RSS grew during the test, sampled every 1 ms):")
            for stack, grown in top:
                lines = _site_lines(stack) or ["(no Python frame: a thread of its own, or C code)"]
                out.append(f"  {'+' + _fmt(grown):>12}  {lines[0]}")
                out += [f"{'':16}{line}" for line in lines[1:3]]
        for device, cap in self._captures.items():
            if not cap.written:
                continue
            try:
                summary = cap.summary(top=self.sites)
            except Exception as exc:
                out.append(f"Allocation sites on {device}: snapshot unreadable ({exc})")
                continue
            rows = [row for t in summary.get("top", []) for row in t.get("rows", [])][: self.sites]
            if rows:
                out.append(f"Top allocation sites, {device} (live blocks at the peak, by Python stack):")
                for row in rows:
                    out.append(f"  {_fmt(row['bytes']):>12}  {row['count']:>5} blocks  {row['site']}")
        return out

    def _cleanup(self) -> None:
        if self._tmpdir is not None:
            for name in os.listdir(self._tmpdir):
                try:
                    os.unlink(os.path.join(self._tmpdir, name))
                except OSError:
                    pass
            try:
                os.rmdir(self._tmpdir)
            except OSError:
                pass
