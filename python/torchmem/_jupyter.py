"""torchmem in Jupyter/IPython: `%load_ext torchmem` registers the magics, and the rich displays
(`_repr_html_`) of `Stats`, `Monitor`, `%tmemit` results and line profiles are rendered here.

Magics (names distinct from memory_profiler's `%memit`/`%mprun`, so both extensions can be loaded):

* `%tmemit [-d DEVICE] [-o] [-q] statement` and `%%tmemit [-d DEVICE] [-o] [-q]` (the cell): the peak and the
  increment (peak minus the start) of CPU RSS and, on a CUDA device, PyTorch's allocated and reserved memory,
  measured with torchmem's exact peak windows, plus what the code still holds after it. `-o` returns a
  `MemitResult`.
* `%tmprun -f FUNC [-f FUNC …] statement` / `%%tmprun -f FUNC …`: the line-by-line table of each function while
  the statement runs (torchmem's line profiler: CPU and GPU columns). Functions defined in the notebook work:
  their source comes from IPython's cell cache (`linecache`), where memory_profiler's `%mprun` refuses them.
  Each run shows that run only (earlier line data of the process is cleared). `-o` returns a `LineProfile`.

Everything displayed is self-contained HTML (inline styles, no scripts, no iframe, no file), so it renders in
JupyterLab, VS Code, Colab and nbconvert output alike. Importing this module imports neither IPython nor torch:
`register(ip)` imports IPython's magic machinery when the extension loads.
"""

from __future__ import annotations

import dataclasses
import gc
import html
import io
import sys
import time
from typing import Any

_STYLE_TABLE = "border-collapse:collapse;font-family:sans-serif;font-size:12px"
_STYLE_CELL = "padding:2px 10px;text-align:right;white-space:nowrap;border-bottom:1px solid #ddd"
_STYLE_HEAD = _STYLE_CELL + ";background:#eee;font-weight:bold"
_STYLE_LEFT = "padding:2px 10px;text-align:left;white-space:nowrap;border-bottom:1px solid #ddd"


def _fmt(value: int | None) -> str:
    from . import _native

    return "—" if value is None else _native.format_bytes(value)


def _fmt_delta(value: int | None) -> str:
    if value is None:
        return "—"
    return ("+" if value >= 0 else "-") + _fmt(abs(value))


def _table(title: str, header: list[str], rows: list[list[str]], note: str = "") -> str:
    """One inline-styled HTML table; cells are escaped here."""
    out = [f'<div class="torchmem" style="margin:4px 0"><b style="font-family:sans-serif">{html.escape(title)}</b>']
    out.append(f'<table style="{_STYLE_TABLE}"><tr>')
    out += [f'<th style="{_STYLE_HEAD}">{html.escape(h)}</th>' for h in header]
    out.append("</tr>")
    for row in rows:
        out.append("<tr>")
        for i, cell in enumerate(row):
            out.append(f'<td style="{_STYLE_LEFT if i == 0 else _STYLE_CELL}">{html.escape(cell)}</td>')
        out.append("</tr>")
    out.append("</table>")
    if note:
        out.append(f'<div style="font-family:sans-serif;font-size:11px;color:#666">{html.escape(note)}</div>')
    out.append("</div>")
    return "".join(out)


# --- rich displays ---------------------------------------------------------------------------------------


def stats_html(stats: Any) -> str:
    """`torchmem.Stats` as an HTML table (GPU rows only with a CUDA device; "—" where nothing was measured)."""
    rows: list[list[str]] = []
    if stats.device is not None:
        gpu = f"GPU {stats.device}"
        rows += [
            [f"{gpu} allocated (PyTorch)", _fmt(stats.allocated_bytes), f"peak {_fmt(stats.peak_allocated_bytes)}"],
            [f"{gpu} reserved (PyTorch)", _fmt(stats.reserved_bytes), f"peak {_fmt(stats.peak_reserved_bytes)}"],
            [f"{gpu} inactive split (fragmentation)", _fmt(stats.inactive_split_bytes), ""],
            [
                f"{gpu} NVML, this process",
                _fmt(stats.nvml_process_bytes),
                f"not PyTorch's {_fmt(stats.non_torch_bytes)}",
            ],
            [
                f"{gpu} device free",
                _fmt(stats.device_free_bytes),
                f"of {_fmt(stats.device_total_bytes)}; OOMs {stats.num_ooms}, retries {stats.num_alloc_retries}",
            ],
        ]
    rows += [
        ["CPU RSS", _fmt(stats.rss_bytes), ""],
        ["CPU USS", _fmt(stats.uss_bytes), "" if stats.uss_bytes is not None else "stats(uss=True) reads it"],
        ["CPU PSS", _fmt(stats.pss_bytes), ""],
    ]
    note = "" if stats.device is not None else "GPU: no CUDA device in use (no GPU rows, not zeros)."
    who = stats.rank_line() if hasattr(stats, "rank_line") else None  # inside a torchrun/Slurm job
    title = "torchmem.stats()" if who is None else f"torchmem.stats(): {who}"
    return _table(title, ["memory", "now", ""], rows, note)


def monitor_html(monitor: Any) -> str:
    """A `torchmem.Monitor`'s epochs, phases, breakdown, journey and growth warnings as HTML: the tables of its
    text `summary()`, drawn in Rust (`report::monitor::summary_html`) as every torchmem report's HTML is."""
    return monitor._log.summary_html(monitor._capacity_bytes())


@dataclasses.dataclass
class MemitResult:
    """What `%tmemit` measured, in bytes: CPU RSS at the start, its peak and at the end; on a CUDA device the
    same for PyTorch's allocated and reserved memory (None otherwise)."""

    device: str
    duration_s: float
    rss_start_bytes: int | None
    peak_rss_bytes: int | None
    rss_end_bytes: int | None
    allocated_start_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    allocated_end_bytes: int | None = None
    reserved_start_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    reserved_end_bytes: int | None = None
    # Set when a CUDA device was asked for (`-d cuda:0`) and there is none: only the CPU was measured.
    note: str | None = None

    @staticmethod
    def _diff(a: int | None, b: int | None) -> int | None:
        return None if a is None or b is None else a - b

    @property
    def rss_increment_bytes(self) -> int | None:
        return self._diff(self.peak_rss_bytes, self.rss_start_bytes)

    @property
    def allocated_increment_bytes(self) -> int | None:
        return self._diff(self.peak_allocated_bytes, self.allocated_start_bytes)

    @property
    def reserved_increment_bytes(self) -> int | None:
        return self._diff(self.peak_reserved_bytes, self.reserved_start_bytes)

    def _rows(self) -> list[list[str]]:
        rows = []
        if self.peak_allocated_bytes is not None:
            rows.append(
                ["GPU allocated", self.allocated_start_bytes, self.peak_allocated_bytes, self.allocated_end_bytes]
            )
            rows.append(["GPU reserved", self.reserved_start_bytes, self.peak_reserved_bytes, self.reserved_end_bytes])
        rows.append(["CPU RSS", self.rss_start_bytes, self.peak_rss_bytes, self.rss_end_bytes])
        return [
            [name, _fmt(peak), _fmt_delta(self._diff(peak, start)), _fmt_delta(self._diff(end, start))]
            for name, start, peak, end in rows
        ]

    def __str__(self) -> str:
        parts = [f"{name}: peak {peak}, increment {inc} (held after: {held})" for name, peak, inc, held in self._rows()]
        where = f" on {self.device}" if self.device != "cpu" else ""
        note = f" ({self.note})" if self.note else ""
        return f"tmemit{where} ({self.duration_s:.3f} s): " + "; ".join(parts) + note

    def _repr_html_(self) -> str:
        return _table(
            f"%tmemit on {self.device} ({self.duration_s:.3f} s)",
            ["memory", "peak", "increment", "held after"],
            self._rows(),
            "increment = peak minus the value at the start; held after = end minus start."
            + (f" Note: {self.note}." if self.note else ""),
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(
            rss_increment_bytes=self.rss_increment_bytes,
            allocated_increment_bytes=self.allocated_increment_bytes,
            reserved_increment_bytes=self.reserved_increment_bytes,
        )
        return d


class LineProfile:
    """The line-by-line tables of `%tmprun`: `text` (memory_profiler's layout), `data` (the payload,
    bytes), and an HTML display."""

    def __init__(self, data: dict[str, Any]) -> None:
        from . import _native

        self.data = data
        self.text = _native.line_render_text([data]) if data["functions"] else ""
        self._html = _native.line_render_html([data]) if data["functions"] else ""

    def __str__(self) -> str:
        return self.text or "(the profiled functions did not run)"

    def _repr_html_(self) -> str:
        return self._html or "<div>(the profiled functions did not run)</div>"


# --- measuring -------------------------------------------------------------------------------------------


def _default_device() -> str:
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return "cuda"
    except Exception:
        pass
    return "cpu"


def memit(run: Any, device: str | None = None) -> MemitResult:
    """Runs `run()` inside a torchmem peak window on `device` (default: CUDA when torch has it, else the CPU)
    and returns what it measured."""
    import torchmem

    device = device or _default_device()
    gc.collect()
    before = torchmem.stats(device)
    t0 = time.perf_counter()
    with torchmem.peak(device) as p:
        run()
    duration = time.perf_counter() - t0
    gc.collect()
    after = torchmem.stats(device)
    on_gpu = before.device is not None
    note = None
    if str(device).startswith("cuda") and not on_gpu:
        note = f"{device} was asked for, but there is no CUDA device (torch.cuda.is_available() is False): CPU only"
    return MemitResult(
        device=f"cuda:{before.device}" if on_gpu else "cpu",
        duration_s=duration,
        rss_start_bytes=before.rss_bytes,
        peak_rss_bytes=p.rss_bytes,
        rss_end_bytes=after.rss_bytes,
        allocated_start_bytes=before.allocated_bytes if on_gpu else None,
        peak_allocated_bytes=p.allocated_bytes if on_gpu else None,
        allocated_end_bytes=after.allocated_bytes if on_gpu else None,
        reserved_start_bytes=before.reserved_bytes if on_gpu else None,
        peak_reserved_bytes=p.reserved_bytes if on_gpu else None,
        reserved_end_bytes=after.reserved_bytes if on_gpu else None,
        note=note,
    )


def line_profile(functions: list[Any], run: Any) -> LineProfile:
    """Profiles `functions` line by line while `run()` runs; returns this run's tables for them only."""
    import torchmem

    from . import _native
    from . import line_profiler as lp

    codes = []
    for f in functions:
        code = lp._code_of(f)
        if code is None:
            raise TypeError(f"%tmprun -f: {f!r} is not a Python function (no code object to profile)")
        codes.append(code)
        torchmem.profile(f)
    _native.line_clear()
    run()
    lp.print_profile(stream=io.StringIO())  # the at-exit printer then has nothing new to print
    data = lp.profile_data()
    wanted = {(getattr(c, "co_qualname", c.co_name), c.co_filename, c.co_firstlineno) for c in codes}
    data["functions"] = [fn for fn in data["functions"] if (fn["name"], fn["filename"], fn["first_line"]) in wanted]
    return LineProfile(data)


# --- the magics ------------------------------------------------------------------------------------------


def _split(line: str, flags_with_value: tuple[str, ...]) -> tuple[dict[str, list[str]], set[str], str]:
    """Leading options of a magic line, then the statement (which may itself contain '-')."""
    opts: dict[str, list[str]] = {}
    switches: set[str] = set()
    words = line.strip().split(" ") if line.strip() else []
    i = 0
    while i < len(words):
        w = words[i]
        if w == "":
            i += 1
            continue
        if w in flags_with_value:
            if i + 1 >= len(words):
                raise ValueError(f"option {w} needs a value")
            opts.setdefault(w, []).append(words[i + 1])
            i += 2
        elif w in ("-o", "-q"):
            switches.add(w)
            i += 1
        elif w.startswith("-") and len(w) == 2 and w[1].isalpha():
            raise ValueError(f"unknown option {w}")
        else:
            break
    return opts, switches, " ".join(words[i:])


def register(ip: Any) -> None:
    """Registers the magics on the IPython shell `ip` (called by `%load_ext torchmem`)."""
    from IPython.core.error import UsageError
    from IPython.core.magic import Magics, line_cell_magic, magics_class

    def run_code(shell: Any, source: str, local_ns: Any) -> Any:
        # IPython's own compiler: it caches the source in linecache, so functions defined here have source.
        source = shell.transform_cell(source)
        code = shell.compile(source, shell.compile.cache(source), "exec")
        ns = local_ns if local_ns is not None else shell.user_ns
        return lambda: exec(code, shell.user_ns, ns)

    @magics_class
    class TorchmemMagics(Magics):
        @line_cell_magic
        def tmemit(self, line: str = "", cell: str | None = None, local_ns: Any = None) -> Any:
            """Peak and increment of CPU RSS and (CUDA) PyTorch allocated/reserved while code runs.

            %tmemit [-d DEVICE] [-o] [-q] statement
            %%tmemit [-d DEVICE] [-o] [-q]   (measures the cell)

            -d cpu|cuda|cuda:N  device to read (default: CUDA when torch has it, else the CPU)
            -o                  return the MemitResult
            -q                  print nothing
            """
            try:
                opts, switches, stmt = _split(line, ("-d",))
            except ValueError as e:
                raise UsageError(f"%tmemit: {e}; usage: %tmemit [-d DEVICE] [-o] [-q] statement") from None
            source = cell if cell is not None else stmt
            if not source.strip():
                raise UsageError("%tmemit: nothing to measure; usage: %tmemit [-d DEVICE] [-o] [-q] statement")
            device = opts.get("-d", [None])[-1]
            result = memit(run_code(self.shell, source, local_ns), device)
            if "-q" not in switches:
                print(result)
            return result if "-o" in switches else None

        @line_cell_magic
        def tmprun(self, line: str = "", cell: str | None = None, local_ns: Any = None) -> Any:
            """Line-by-line CPU and GPU memory of functions while a statement runs.

            %tmprun -f FUNC [-f FUNC ...] [-o] [-q] statement
            %%tmprun -f FUNC [-f FUNC ...] [-o] [-q]   (runs the cell)

            Functions defined in this notebook work (their source comes from IPython's cell cache).
            """
            try:
                opts, switches, stmt = _split(line, ("-f",))
            except ValueError as e:
                raise UsageError(f"%tmprun: {e}; usage: %tmprun -f FUNC [-f FUNC ...] statement") from None
            if not opts.get("-f"):
                raise UsageError("%tmprun: say which function to profile: %tmprun -f FUNC statement")
            ns = {**self.shell.user_ns, **(local_ns or {})}
            functions = []
            for name in opts["-f"]:
                try:
                    functions.append(eval(name, ns))
                except Exception as e:
                    raise UsageError(f"%tmprun -f {name}: {type(e).__name__}: {e}") from None
            source = cell if cell is not None else stmt
            if not source.strip():
                raise UsageError("%tmprun: nothing to run; usage: %tmprun -f FUNC statement")
            try:
                profile = line_profile(functions, run_code(self.shell, source, local_ns))
            except TypeError as e:
                raise UsageError(str(e)) from None
            if "-q" not in switches:
                print(profile)
            return profile if "-o" in switches else None

    ip.register_magics(TorchmemMagics)
