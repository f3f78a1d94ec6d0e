"""Type stubs for `torchmem._native`, the Rust extension. This file is the contract: every function the Rust
side exports is listed here with its meaning and units. Sections belong to one concern each. Every dict that
crosses has its `TypedDict` in `torchmem._types` (tests/unit/test_stub_contract.py calls each function and checks
its dict against it); the only `dict[str, Any]` left is torch's own `_cuda_memoryStats` dict
(`TorchMemoryStats`)."""

from typing import Any, Final, final

from torchmem._types import (
    DeviceInfo,
    EpochReport,
    EstimateReport,
    GpuCatalogueEntry,
    LeakFinding,
    LeakReport,
    LineCallbacks,
    LinePayload,
    LineReport,
    LineSnapshot,
    LineStart,
    Marker,
    MarkerSummary,
    OomDiagnosis,
    ProbeData,
    ProfileReport,
    SimulateResult,
    SnapshotReport,
    StepGrowth,
    TorchMemoryStats,
    TracerSummary,
    WhatIfResult,
)

__version__: str
#: The categories a breakdown entry carries as `<name>_bytes`, in core's order (`breakdown::Category::ALL`).
BREAKDOWN_CATEGORIES: tuple[str, ...]

# --- errors (crates/torchmem-py/src/errors.rs: the one place Rust errors become exceptions) ---
# Bad input is a ValueError (so `except ValueError` keeps working); I/O is the matching OSError subclass
# (FileNotFoundError, PermissionError, IsADirectoryError, ...); the line profiler in the wrong state RuntimeError.
class TorchmemError(Exception):
    """Base class of torchmem's errors (alone: NVML unavailable, a tool failure)."""

class InputError(TorchmemError, ValueError):
    """A bad argument value: malformed JSON, unknown kind or edge, bad allocator settings."""

class OomParseError(InputError):
    """Text that is not a PyTorch out-of-memory message (explain_oom_json)."""

class ProfileError(TorchmemError, ValueError):
    """A file that is not a readable torchmem profile (not a profile, damaged, truncated, newer schema)."""

class SnapshotError(TorchmemError, ValueError):
    """An allocator snapshot that cannot be read (truncated, malicious, not a snapshot, unreadable file)."""

# --- profile files (crates/torchmem-py/src/profile.rs) ---
class MarkerLog:
    """A Monitor's record of its run (analysis::MarkerLog): the markers of the first `keep_markers` occurrences of
    each step and phase name (None: all), every later one folded into exact aggregates by the recorder's rule
    (fold::SpanFolder), epochs and marks always kept. Every view is computed over all markers pushed."""

    def __init__(self, keep_markers: int | None = None) -> None: ...
    def push(self, marker: Marker) -> bool:
        """Takes one marker in model::Marker form ({"t_ns", "kind", "edge", "name", "index", "memory":
        MarkerMemory, optional "origin", "device", "breakdown", "activations_by_module"}); True when it is kept as
        a marker. InputError (a ValueError) for a dict not in that form."""
    @property
    def steps_started(self) -> int:
        """Steps started so far (finished or not, kept or folded)."""
    def __len__(self) -> int:
        """How many markers are kept."""
    def summary(self, capacity_bytes: int | None = None) -> MarkerSummary:
        """analysis::Summary as a dict: epochs (with their step counts), steps, phases, breakdown, growth, journey
        (each named point once). `capacity_bytes`: the journey's yardstick."""
    def summary_text(self, capacity_bytes: int | None = None) -> str:
        """The per-epoch and per-phase tables, the breakdown tables and growth warnings, as text."""
    def summary_html(self, capacity_bytes: int | None = None) -> str:
        """The same tables, the journey and the growth warnings as one self-contained HTML `<div>` (Jupyter)."""
    def journey(
        self, capacity_bytes: int | None = None, format: str = "text", title: str = "torchmem memory journey"
    ) -> str:
        """The memory journey as "text" or "mermaid" (InputError, a ValueError, on any other format)."""
    def epoch_report(self) -> EpochReport:
        """{"line", "row", "growth", "growth_per_epoch_bytes"} for the last finished epoch."""

class ProfileData:
    """A profile file loaded once in Rust (python/torchmem/recorded_profile.py wraps it as torchmem.Profile)."""

    @property
    def path(self) -> str:
        """The profile file's path, as given."""
    def summary(self) -> ProfileReport:
        """The dict of `torchmem report --format json`."""
    def tables(self) -> list[str]:
        """The table names `table` accepts: cpu_samples, torch_samples, gpu_samples, processes,
        process_samples, markers, aggregates (raw); phases, epochs, epoch_totals, process_summary, growth,
        journey (the report's)."""
    def table(self, name: str) -> tuple[list[str], list[tuple[Any, ...]]]:
        """(columns, rows): nested records flattened to `origin_pid`, ...; InputError for an unknown name."""

def open_profile(path: str | Any) -> ProfileData:
    """Loads a profile written by `torchmem run`. FileNotFoundError for a missing file, IsADirectoryError for
    a directory, ProfileError (with the CLI's message) for a file that is not a readable profile."""

# --- memory readers and reports (crates/torchmem-py/src/api.rs) ---
@final
class SelfMemory:
    """This process's RSS and peak RSS in bytes, from one read of /proc/self/status (`self_memory`). Frozen:
    read-only attributes, equal when every field is; the repr names every field."""

    #: VmRSS.
    rss_bytes: Final[int]
    #: VmHWM: the highest RSS since the process started (torchmem never resets it); from `rss_period_peak`
    #: and `rss_period_restart`: the highest since torchmem's peak period started.
    peak_rss_bytes: Final[int]

def self_memory() -> SelfMemory | None:
    """This process's RSS and peak RSS from one read of /proc/self/status (VmRSS, VmHWM); None without /proc."""

def self_rss_bytes() -> int | None:
    """RSS of this process in bytes from /proc/self/statm (~2 µs)."""

def malloc_free_bytes() -> int | None:
    """Bytes glibc's malloc keeps freed for reuse (`mallinfo2().fordblks`, all arenas): resident memory nothing
    holds, which RSS counts; None where the C library has no `mallinfo2` (not glibc >= 2.33)."""

@final
class SmapsRollup:
    """This process's /proc/self/smaps_rollup in bytes (`self_rollup`). Frozen: read-only attributes, equal when
    every field is; the repr names every field."""

    rss_bytes: Final[int]
    #: Proportional set size: each shared page divided among the processes that map it.
    pss_bytes: Final[int]
    #: Private_Clean + Private_Dirty: pages no other process maps.
    uss_bytes: Final[int]
    swap_bytes: Final[int]

def self_rollup() -> SmapsRollup | None:
    """RSS, PSS, USS and swap from /proc/self/smaps_rollup (milliseconds on big processes); None where missing."""

def rss_period_peak() -> SelfMemory | None:
    """RSS now and the highest RSS since torchmem's peak period started (the process's start before the first
    `rss_period_restart`). torchmem's own counter: exact when the kernel's VmHWM rose inside the period, else
    the highest RSS read at the period's edges and sampled by the `watch_rss` thread. None without /proc."""

def rss_period_restart() -> SelfMemory | None:
    """`rss_period_peak()` read just before starting a new period at the current RSS. Nothing the program
    reads changes (VmHWM and `ru_maxrss` are only read, never reset)."""

def watch_rss(open_windows: int) -> bool:
    """Tells the RSS watcher how many peak windows are open: while one is, a thread samples /proc/self/statm
    every 5 ms (every millisecond while RSS rises) into the current period (no GIL); with none it sleeps.
    False where the thread cannot start."""

def malloc_trim() -> bool:
    """glibc malloc_trim(0): returns freed heap pages to the kernel; True when something was released."""

def format_bytes(bytes: int) -> str:
    """Binary units as every report prints them: "512 B", "1.5 KiB", "64.0 MiB", "1.25 GiB"."""

def format_bytes_torch(bytes: int) -> str:
    """Binary units as PyTorch's messages print them: "512 B", "32.00 MiB", "1.50 TiB"."""

def nvml_error() -> str | None:
    """Why NVML cannot be used in this process, or None when it can (NVML is opened once)."""

def nvml_index_of_device(torch_index: int, uuid: str | None = None) -> int | None:
    """NVML index of torch's CUDA device `torch_index` (the one rule of `torchmem.stats()`, the markers and the
    allocator sampler): by torch's `uuid` of the device, else by its CUDA_VISIBLE_DEVICES entry (an index or
    a UUID), else (no CUDA_VISIBLE_DEVICES) `torch_index`. None without NVML or when the entry maps to no
    device."""

@final
class NvmlReading:
    """One NVML read of a device, in bytes (`nvml_read`). Frozen: read-only attributes, equal when every field
    is; the repr names every field."""

    total_bytes: Final[int]
    #: Device-wide used memory (what nvidia-smi shows), all processes.
    used_bytes: Final[int]
    free_bytes: Final[int]
    #: What NVML charges to the pid asked about (CUDA context included); None when NVML lists no such process.
    process_bytes: Final[int | None]
    #: What NVML charges to every other process on the device.
    other_processes_bytes: Final[int]
    def __init__(
        self,
        *,
        total_bytes: int,
        used_bytes: int,
        free_bytes: int,
        process_bytes: int | None,
        other_processes_bytes: int,
    ) -> None:
        """A reading built by hand (tests, fakes of NVML); `nvml_read` makes the real ones."""

def nvml_read(index: int, pid: int) -> NvmlReading:
    """NVML device `index` now, with the bytes NVML charges to process `pid` and to all the others. Raises
    TorchmemError without NVML."""

def device_info() -> DeviceInfo:
    """The host (total/available RAM) and every NVML device (name, uuid, total/used/free, this
    process's and other processes' bytes, driver and CUDA driver versions, or `nvml_error`). No CUDA context."""

@final
class AllocatorCounters:
    """PyTorch's caching-allocator counters of one CUDA device (core's `sources::allocator::AllocatorCounters`),
    made only by `allocator_counters`. Frozen: read-only attributes, equal when every counter is; the repr names
    every field."""

    #: `["allocated_bytes"]["all"]["current"]`: bytes in live tensors.
    allocated_bytes: Final[int]
    #: `["reserved_bytes"]["all"]["current"]`: bytes the allocator holds from CUDA (allocated + its cache).
    reserved_bytes: Final[int]
    #: `[...]["all"]["peak"]` of the two: torch's own peaks (since start or the last reset).
    peak_allocated_bytes: Final[int]
    peak_reserved_bytes: Final[int]
    #: `["active_bytes"]["all"]["current"]`.
    active_bytes: Final[int]
    #: `["inactive_split_bytes"]["all"]["current"]`: free blocks inside split segments (fragmentation).
    inactive_split_bytes: Final[int]
    #: `["num_alloc_retries"]`, `["num_ooms"]`: counts.
    num_alloc_retries: Final[int]
    num_ooms: Final[int]

def allocator_counters(nested: TorchMemoryStats) -> AllocatorCounters:
    """The counters of `torch._C._cuda_memoryStats(dev)`'s nested dict, as the allocator sampler reads them
    (missing keys, and negative values, read as 0)."""

def program_peaks_fold(device: int, nested: TorchMemoryStats) -> None:
    """The peak ledger (python/torchmem/_ledger.py): folds every `peak` stat of `nested` (a
    `_cuda_memoryStats(device)` dict read just before torchmem resets the counters) into the program's view."""

def program_peaks_apply(device: int, nested: TorchMemoryStats) -> TorchMemoryStats:
    """Raises, in place, every `peak` stat of `nested` to the program's view (what it would read had torchmem
    never reset the counters) and returns it."""

def program_peaks_clear(device: int) -> None:
    """Forgets the program's view of device `device` (the program reset its peaks itself)."""

def sampler_fold_peak(device: int, peak_allocated_bytes: int, peak_reserved_bytes: int) -> None:
    """The peak ledger's fold for the allocator sampler: device `device`'s peaks read just before a reset;
    the sampler thread's next line for that device reports peaks at least these (read_allocator_once
    leaves them to it)."""

def read_allocator_once() -> list[str]:
    """One allocator-sampler read: a wire line {"type":"torch",...} per CUDA device whose allocator was used;
    [] when torch is not imported or CUDA not initialised (never initialises CUDA)."""

def start_allocator_sampler(interval_ms: float) -> bool:
    """Starts the thread that sends read_allocator_once()'s lines every interval_ms to torchmem run's recorder:
    the Unix socket named by TORCHMEM_EVENT_SOCKET (else the inherited pipe in TORCHMEM_EVENT_FD). False when
    neither is set or the recorder cannot be reached; True when running. Stops by itself at interpreter exit
    (atexit, after one last read) or when the connection closes.
    InputError (a ValueError) when interval_ms is not a positive number; TorchmemError when the thread cannot
    start."""

def stop_allocator_sampler() -> bool:
    """Stops and joins the sampler thread; True when one was running in this process."""

def allocator_sampler_running() -> bool:
    """True while the sampler thread runs in this process."""

# --- line profiler (crates/torchmem-py/src/line.rs) ---
def line_start(hook: str, gate_ns: float | None = None, gpu_probe: Any = None) -> LineStart:
    """Start the line profiler. `hook`: "settrace" (Python <= 3.11) or "monitoring" (>= 3.12). `gate_ns`
    overrides the calibrated gate (0 = read memory at every event). `gpu_probe()` returns None until CUDA is
    initialised, then `(device, stats, reset)`: the allocator's own `_cuda_memoryStats` and the peak ledger's
    reset for the line profiler. Returns {"hook", "gate_ns", "min_page_fault_ns"}."""

def line_fold_gpu_peak(device: int, peak_bytes: int) -> None:
    """The peak ledger's fold: another reader saw `peak_bytes` as device `device`'s allocated peak just before
    resetting the counters; the line profiler's next read of that device counts it."""

def line_stop() -> None:
    """Stop accounting (hooks still installed return at once)."""

def line_clear() -> None:
    """Forget all measured numbers; registered code objects stay."""

def line_add_code(code: Any, first_line: int, offsets: list[tuple[int, int, int | None]]) -> int:
    """Profile this code object; `offsets` is `list(code.co_lines())`."""

def line_set_matcher(matcher: Any = None) -> None:
    """`matcher(code) -> bool` is asked once per unknown code object at its first call (`--line=SPEC`)."""

def line_set_disable(obj: Any) -> None:
    """Give the profiler `sys.monitoring.DISABLE`."""

def line_monitoring_callbacks() -> LineCallbacks:
    """Raw METH_FASTCALL builtins for sys.monitoring: keys "line", "start", "resume", "exit"."""

def line_trace_install(on: bool) -> bool:
    """Install/remove the C trace function (PyEval_SetTrace via dlsym) on this thread; False if unavailable."""

def line_trace_install_all() -> int | None:
    """Python <= 3.11: install the C trace function on every existing thread (the calling one included), as
    3.12's PyEval_SetTraceAllThreads does. How many threads got it; None where _PyEval_SetTrace is missing."""

def line_thread_installer(_frame: Any, _event: Any, _arg: Any) -> None:
    """For `threading.settrace`: installs the C trace function in each new thread."""

def line_snapshot() -> LineSnapshot:
    """{"functions": [{"code", "calls", "threads", "lines": [(line, hits, rss_after_bytes, cpu_delta_bytes,
    cpu_delta_max_bytes, gpu_alloc_delta_bytes | None, gpu_peak_bytes | None, gpu_reserved_delta_bytes |
    None)]}], "warnings", "reads", "events", "gate_ns", "hook", "gpu_device"}."""

def line_render_text(payloads: LinePayload | list[LinePayload]) -> str:
    """memory_profiler-style tables for line-profile payloads (`line_snapshot()` dicts; torchmem_core::lines).
    InputError (a ValueError) for anything that is not such a dict or a list of them."""

def line_render_html(payloads: LinePayload | list[LinePayload]) -> str:
    """Self-contained HTML fragment (annotated source, heaviest lines highlighted)."""

def line_report(payloads: LinePayload | list[LinePayload]) -> LineReport:
    """The `lines` section of `torchmem report --format json`, as a dict."""

# --- allocator simulator (crates/torchmem-py/src/simulate.rs) ---
def simulate(
    path: str | None = None,
    data: bytes | None = None,
    alloc_conf: str | None = None,
    memory_limit_bytes: int | None = None,
    device_memory_bytes: int | None = None,
    min_memory: bool = False,
    device_memory_recorded: bool = False,
) -> SimulateResult:
    """Replays a snapshot (a path or its bytes) through the caching-allocator model: the dict of
    `torchmem simulate --json` plus `text` (and `min_memory` when asked). Raises SnapshotError, InputError
    (bad settings)."""

def whatif(path: str, memory_limit_bytes: int | None = None, device_total_bytes: int | None = None) -> WhatIfResult:
    """The what-if panel of a snapshot file (pickle, JSON, gzipped): `devices` (per device `headline`,
    `rows` of the common settings with peaks, `avoids_recorded_oom`, `min_memory_bytes`, or `unavailable`:
    one line on why the trace cannot be simulated) and `text`. `memory_limit_bytes`: the per-process cap
    the run had. Raises SnapshotError."""

# --- the estimate use case (crates/torchmem-py/src/estimate.rs) ---
def parse_size(text: str) -> int:
    """Bytes from a size as the CLI's flags take it (one parser: `--memory-limit 14g` means the same):
    `14g`/`14GiB`/`14.5 GiB` (1024-based), `24GB`/`24 MB` (1000-based), `100 B`, or a bare byte count of at
    least 1 MiB. Raises InputError (a ValueError) naming the accepted forms."""

def gpu_catalogue() -> list[GpuCatalogueEntry]:
    """The estimator's GPU catalogue (`torchmem estimate --list-gpus --json`): per GPU `key`, `name`,
    `nvml_total_bytes`, `cuda_total_bytes`, `cuda_total_measured`, `major`, `minor`, `multi_processor_count`,
    `context` (the measured CUDA context overhead or None)."""

def find_gpu(name: str) -> GpuCatalogueEntry:
    """The catalogue entry for `name` (case-insensitive; "H100" is the 80 GB SXM, "4090" the RTX 4090).
    Raises InputError naming the known keys."""

def estimate_report(
    trace: str,
    summary: TracerSummary,
    gpu: str = "H200",
    device_memory_bytes: int | None = None,
    alloc_conf: str | None = None,
) -> EstimateReport:
    """The estimate of a traced run, in-process (the code `torchmem estimate --trace T --summary S` runs):
    the tracer's trace file and summary dict replayed on `gpu` (with `device_memory_bytes` instead of its
    memory when given, under `alloc_conf` when given); the dict of `--json` plus `text`: the point peaks, the
    interval's `peak_allocated_upper_bytes`, `peak_reserved_upper_bytes`, `nvml_upper_bytes`,
    `margin_upper_bytes`, `fits_point` and `uncertainty` (the summary's `uncertain_requests` replayed at their
    upper size; `fits` is the upper bound's). Raises
    SnapshotError (an unreadable trace), InputError (unknown GPU, bad alloc_conf or summary)."""

# --- allocator snapshots (crates/torchmem-py/src/snapshot.rs) ---
def snapshot_summary(path: str, top: int = 10, at_time_us: int | None = None) -> SnapshotReport:
    """Summary (per-device reserved/allocated/active/requested bytes now and at the traced peak,
    fragmentation per segment, trace action counts, ring-buffer history) and the `top` allocation sites
    at the peak (or at `at_time_us`) of a snapshot file (pickle or JSON, either gzipped): {"file", "summary",
    "top"}. Raises SnapshotError."""

def snapshot_summary_bytes(data: bytes, top: int = 10, at_time_us: int | None = None) -> SnapshotReport:
    """The same for snapshot bytes. Raises SnapshotError."""

def snapshot_text(path: str, top: int = 10) -> str:
    """The text of `torchmem snapshot FILE` followed by `--top top`. Raises SnapshotError."""

def snapshot_html(path: str, out_path: str, memory_limit_bytes: int | None = None) -> None:
    """Writes the self-contained offline HTML report of a snapshot file, with the what-if panel (the trace
    under other allocator settings; `memory_limit_bytes`: the cap the run had). Raises SnapshotError, or the
    OSError subclass of a failed write (PermissionError, FileNotFoundError, IsADirectoryError)."""

def oom_diagnosis(
    requested_bytes: int,
    allocated_bytes: int,
    reserved_bytes: int,
    total_bytes: int | None = None,
    free_bytes: int | None = None,
    process_bytes: int | None = None,
    device: int | None = None,
) -> OomDiagnosis:
    """Diagnosis of an out-of-memory failure from the allocator's numbers (bytes), as a dict: verdict
    ("fragmentation" | "capacity" | "other_processes" | "request_too_large"), explanation, next_steps,
    batch_factor, shortfall_bytes, and `text`."""

def explain_oom(message: str) -> OomDiagnosis:
    """Parses a PyTorch CUDA OOM message (torch <= 2.0, 2.1, >= 2.2 wordings) and diagnoses it, as a dict
    (like `oom_diagnosis`, with the parsed numbers). Raises OomParseError (a ValueError) for text
    that is not one."""

# --- event buffer (crates/torchmem-py/src/events.rs) ---
def emit_event(line: str) -> bool:
    """Queue one JSON message (no newline) for `torchmem run`'s recorder; written by the sampler thread every
    tick, or at once when no sampler runs. False when there is no recorder."""

def emit_marker(
    t_ns: int,
    kind: str,
    edge: str,
    name: str,
    index: int | None,
    memory: dict[str, int],
    device: int | None = None,
) -> bool:
    """Queue one marker message (the `marker` wire format of `torchmem-core/src/wire.rs`), formatted in Rust.
    `kind`: epoch|step|phase|mark; `edge`: start|end|point; `memory`: the `MarkerMemory` fields read
    (`rss_bytes`, `allocated_bytes`, `reserved_bytes`, `peak_*_bytes`); `device`: the GPU `memory` read, by
    NVML index (None: CPU only). InputError (a ValueError) for an unknown kind or edge. False when there is
    no recorder."""

def flush_events() -> bool:
    """Write the queued messages now. False when there is no recorder."""

# --- leaks (crates/torchmem-py/src/leaks.rs; python/torchmem/_leaks.py drives them) ---
class HeldRss:
    """RSS less what glibc's malloc keeps freed, carried over torchmem's own `malloc_trim`s (a trim gives back
    pages malloc still counts free: the series does not fall by them). The Monitor pushes each epoch end's
    reading; the epoch growth warning judges this series, as the step detector does."""

    def __init__(self) -> None: ...
    def push(self, rss_bytes: int | None, malloc_free_bytes: int | None = None) -> int | None:
        """The next value of the series (None without RSS)."""

class StepGrowthDetector:
    """Step-level growth detection (torchmem_core::analysis::leaks): the Monitor pushes each step's end."""

    def __init__(self, warmup_steps: int = 5, window_steps: int = 8) -> None:
        """`warmup_steps` step ends are ignored (allocator warm-up, lazy optimizer state); growth is judged over
        the last `window_steps` steps. InputError when window_steps < 2."""
    def push(
        self, allocated_bytes: int | None, rss_bytes: int | None, malloc_free_bytes: int | None = None
    ) -> StepGrowth | None:
        """One step end (allocated bytes: None without CUDA; `malloc_free_bytes()`: None where it cannot be
        read). None, or the growth as a dict ({"what", "per_step_bytes", "window_steps", "rising_steps",
        "steps_seen"}) when at least 3/4 of the window's steps rose and the net rise per step is at least 512 B
        (allocated, over `window_steps`) or 512 KiB (RSS less what malloc keeps freed, over twice
        `window_steps`: RSS is noisy, and creeps in healthy loops by exactly what `free` keeps). A step in which
        torchmem called `malloc_trim` (`empty_cache()`) does not count as a fall: the trimmed pages stay counted
        free, so RSS less free bytes would drop by memory nothing held."""
    def rearm(self) -> None:
        """Forgets the window: growth must be seen again over fresh steps (after a probe)."""
    @property
    def steps_seen(self) -> int:
        """Step ends pushed so far."""

def leak_findings(probe: ProbeData) -> LeakReport:
    """The findings of one probe: an analysis::leaks::ProbeData dict ({"probe_steps", "first_step", "growth",
    "tensors": [TensorSite], "python": [PythonLine]}) in, a LeakReport dict ({"growth", "probe_steps",
    "first_step", "findings": [Leak], "unexplained"}) out. InputError for a dict not in that form."""

def leaks_text(findings: list[LeakFinding]) -> str:
    """The "Leaks" table (line, kind, per step, live, holds, source, and each finding's message) of a list of
    findings (Leak dicts), as aligned text; "" for an empty list."""
