"""The shapes of the dicts that cross the Rust boundary (`torchmem._native`), one `TypedDict` per shape.

`_native.pyi` and the Python modules import these names; tests/unit/test_stub_contract.py calls every function
typed here on real input and checks the returned dict against its `TypedDict` (keys and value types, nested ones
too), so a key added to or dropped from a Rust record fails a test. Each shape names the Rust record it comes
from (serde structs turned into dicts by pythonize, `crates/torchmem-py/src/convert.rs`, or dicts the binding
builds itself). Units: `*_bytes` bytes, `*_ns` nanoseconds, `*_us` microseconds.

Keys that a record really leaves out sometimes (serde's `skip_serializing_if`, a dict built key by key) sit in a
`total=False` base class (`_...Optional`); every other key is always there, its value `None` where the type says
`| None`. Records that are still free-form are `dict[str, Any]` and say so (see docs/python-api.md, "Types").
This module imports nothing but `typing`, so it needs no package at run time (Python >= 3.10).
"""

from __future__ import annotations

from types import CodeType
from typing import Any, Callable, Literal, TypedDict

#: model::MarkerKind, model::Edge (lowercase).
MarkerKind = Literal["epoch", "step", "phase", "mark"]
Edge = Literal["start", "end", "point"]
#: snapshot::oom::Backend, Wording.
OomBackend = Literal["cuda", "hip", "xpu", "mps", "cpu"]
OomWording = Literal["torch_le2_0", "torch2_1", "torch_ge2_2", "xpu", "mps", "cpu"]
#: analysis::growth::GrowthUnit, GrowthSeries.
GrowthUnit = Literal["epoch", "step"]
GrowthSeries = Literal["GPU allocated", "CPU RSS", "CPU RSS after empty_cache()"]
#: estimator::summary::EstimateKind.
EstimateKind = Literal["training", "inference", "backward without optimizer step"]

#: torch's own `torch._C._cuda_memoryStats(device)` dict (torch's shape, not torchmem's: nested
#: `{"allocated_bytes": {"all": {"current", "peak", ...}, ...}, ...}`), which the peak ledger reads and raises.
TorchMemoryStats = dict[str, Any]

# --- markers (model::Marker, read by MarkerLog.push) ---


class MarkerMemory(TypedDict, total=False):
    """model::MarkerMemory as `MarkerLog.push` reads it: a key left out reads as None."""

    rss_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    peak_rss_bytes: int | None
    held_rss_bytes: int | None


class Origin(TypedDict, total=False):
    """model::Origin as `MarkerLog.push` reads it (a key left out reads as None; left out: this process)."""

    pid: int | None
    rank: int | None
    local_rank: int | None
    world_size: int | None


class ModuleBytes(TypedDict, total=False):
    """breakdown::ModuleBytes: top-level module name -> bytes (a key left out reads as empty)."""

    parameters: dict[str, int]
    gradients: dict[str, int]


class _DeviceBreakdownOptional(TypedDict, total=False):
    parameters_bytes: int | None
    gradients_bytes: int | None
    optimizer_state_bytes: int | None
    activations_bytes: int | None
    inputs_bytes: int | None
    other_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    cache_bytes: int | None
    non_torch_bytes: int | None
    rss_bytes: int | None
    by_module: ModuleBytes
    #: Optimizer state bytes per param group.
    by_param_group: list[int]


class DeviceBreakdown(_DeviceBreakdownOptional):
    """breakdown::DeviceBreakdown: what one device's memory is at a boundary (a key left out reads as None)."""

    device: str


class _MarkerOptional(TypedDict, total=False):
    origin: Origin
    device: int | None
    breakdown: list[DeviceBreakdown] | None
    activations_by_module: dict[str, int] | None


class Marker(_MarkerOptional):
    """model::Marker: one epoch/step/phase edge or mark, as `MarkerLog.push` takes it."""

    t_ns: int
    kind: MarkerKind
    edge: Edge
    name: str
    index: int | None
    memory: MarkerMemory


# --- the run summary (analysis::Summary) and the report (report/json.rs) ---


class GpuPeak(TypedDict):
    """analysis::peaks::GpuPeak."""

    device: int
    name: str | None
    total_bytes: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    nvml_process_bytes: int | None
    nvml_used_bytes: int | None


class Peaks(TypedDict):
    """analysis::peaks::Peaks."""

    cpu_rss_bytes: int | None
    cpu_rss_t_ns: int | None
    cpu_pss_bytes: int | None
    cpu_uss_bytes: int | None
    gpus: list[GpuPeak]


class _EpochRowOptional(TypedDict, total=False):
    #: End-of-epoch RSS less malloc's free bytes; only when the epoch's marker has it.
    held_rss_bytes: int
    #: RSS at the "Cache emptied" mark (`torchmem.empty_cache()`) after this epoch; only where there is one.
    rss_after_emptied_cache_bytes: int


class EpochRow(_EpochRowOptional):
    """analysis::tables::EpochRow: one epoch of one process."""

    index: int
    pid: int | None
    rank: int | None
    duration_ns: int | None
    steps: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    rss_bytes: int | None
    peak_rss_bytes: int | None
    growth_allocated_bytes: int | None
    growth_rss_bytes: int | None


class PhaseRow(TypedDict):
    """analysis::tables::PhaseRow: one phase name over all its occurrences."""

    name: str
    count: int
    total_ns: int
    mean_delta_allocated_bytes: int | None
    max_peak_allocated_bytes: int | None
    max_peak_reserved_bytes: int | None
    mean_delta_rss_bytes: int | None
    max_peak_rss_bytes: int | None


class EpochTotalRow(TypedDict):
    """analysis::tables::EpochTotalRow: per process and epoch, the steps or one phase."""

    pid: int | None
    rank: int | None
    epoch: int | None
    kind: MarkerKind
    name: str
    count: int
    total_ns: int
    min_ns: int | None
    max_ns: int | None


class ProcessRow(TypedDict):
    """analysis::tables::ProcessRow."""

    pid: int
    ppid: int
    cmdline: str
    peak_rss_bytes: int | None
    peak_pss_bytes: int | None
    peak_uss_bytes: int | None
    peak_gpu_bytes: int | None
    lifetime_ns: int


class Growth(TypedDict):
    """analysis::growth::Growth: memory that rose at the end of every epoch (or step)."""

    unit: GrowthUnit
    what: GrowthSeries
    per_unit_bytes: int
    units: int


class ReportGrowth(Growth):
    """A `Growth` in the report, with its sentence (report::findings::growth_json)."""

    message: str


class KeptIn(TypedDict):
    """analysis::leaks::KeptIn: the container a leaking tensor was kept in."""

    container: str
    name: str | None
    file: str | None
    line: int | None
    source: str


class LeakFinding(TypedDict):
    """analysis::leaks::Leak: one line that keeps memory alive step after step."""

    file: str
    line: int
    function: str
    source: str
    kind: str
    device: str | None
    per_step_bytes: int
    live_count: int
    live_bytes: int
    steps_alive: int
    probe_steps: int
    holds_graph: bool
    graph_saved_bytes: int | None
    graph_per_step_bytes: int | None
    graph_nodes: int | None
    holds_tensors_of: list[str]
    kept_in: KeptIn | None
    message: str


#: breakdown::Category (snake_case), the names of `_native.BREAKDOWN_CATEGORIES`.
Category = Literal[
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "inputs",
    "other",
    "cache",
    "non_torch",
    "allocated",
    "reserved",
    "rss",
]


class MeanMax(TypedDict):
    """analysis::breakdown::MeanMax."""

    mean_bytes: int
    max_bytes: int


class BoundaryRow(TypedDict):
    """analysis::breakdown::BoundaryRow: one boundary (after forward, ...) of one process and device."""

    pid: int | None
    rank: int | None
    boundary: str
    device: str
    count: int
    categories: dict[Category, MeanMax]


class CompositionRow(TypedDict):
    """analysis::breakdown::CompositionRow."""

    category: Category
    bytes: int
    percent_of_peak: float


class PeakComposition(TypedDict):
    """analysis::breakdown::PeakComposition: what the memory was at the peak."""

    pid: int | None
    rank: int | None
    device: str
    #: "allocator" (a CUDA device) or "rss" (the CPU).
    basis: str
    step: int | None
    phase: str
    phase_start_t_ns: int
    boundary: str
    boundary_step: int | None
    boundary_t_ns: int
    boundary_source: str
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    peak_rss_bytes: int | None
    total_bytes: int
    rows: list[CompositionRow]
    non_torch_source: str | None


class ModuleRow(TypedDict):
    """analysis::breakdown::ModuleRow."""

    module: str
    parameters_bytes: int
    gradients_bytes: int | None


class ParamGroupRow(TypedDict):
    """analysis::breakdown::ParamGroupRow."""

    group: int
    optimizer_state_bytes: int


class ModuleActivationRow(TypedDict):
    """analysis::breakdown::ModuleActivationRow."""

    module: str
    activations_bytes: int


class BoundaryPoint(TypedDict):
    """analysis::breakdown::BoundaryPoint: one boundary reading, for the timeline."""

    t_ns: int
    pid: int | None
    step: int | None
    boundary: str
    device: str
    categories: dict[Category, int]


class BreakdownSummary(TypedDict):
    """analysis::breakdown::BreakdownSummary: what the memory is (parameters, gradients, ...)."""

    recorded: bool
    hint: str | None
    boundaries: list[BoundaryRow]
    peak: PeakComposition | None
    detail_device: str | None
    modules: list[ModuleRow]
    param_groups: list[ParamGroupRow]
    activations_by_module: list[ModuleActivationRow]
    timeline: list[BoundaryPoint]
    folded_boundaries: int


class JourneyStage(TypedDict):
    """journey::JourneyStage: one named point of the memory journey."""

    name: str
    #: journey::JourneySection.
    section: str
    allocated_bytes: int | None
    reserved_bytes: int | None
    rss_bytes: int | None
    capacity_bytes: int | None
    #: journey::PressureOn.
    measure: str


class _SummaryBase(TypedDict):
    samples: int
    torch_samples: int
    gpu_samples: int
    peak: Peaks
    epochs: list[EpochRow]
    steps: int
    phases: list[PhaseRow]
    epoch_totals: list[EpochTotalRow]
    processes: list[ProcessRow]
    leaks: list[LeakFinding]
    breakdown: BreakdownSummary
    journey: list[JourneyStage]


class MarkerSummary(_SummaryBase):
    """analysis::Summary (`MarkerLog.summary`, the Monitor's `to_dict`)."""

    command: list[str]
    exit_code: int | None
    duration_ns: int | None
    growth: list[Growth]


class EpochReport(TypedDict):
    """report::monitor::EpochReport (`MarkerLog.epoch_report`): the last finished epoch."""

    line: str
    row: EpochRow | None
    #: The growth warnings, as sentences.
    growth: list[str]
    growth_per_epoch_bytes: int | None


class OomFinding(TypedDict):
    """model::OomFinding: what the kernel's OOM killer did during the run."""

    cgroup_kills: int | None
    host_kills: int | None
    program_in_kernel_log: bool | None


class _JobPlaceLaunch(TypedDict, total=False):
    #: The node (torchrun's GROUP_RANK, else SLURM_NODEID) and the attempt (TORCHELASTIC_RESTART_COUNT, else
    #: SLURM_RESTART_COUNT); left out where the environment does not say (model::Launch).
    group_rank: int
    restart_count: int


class JobPlace(_JobPlaceLaunch):
    """model::JobPlace: where a launcher (torchrun, SLURM) placed the run: an Origin (pid always None: the
    launch's place, not a process's) and a Launch, flat, as the `identity` blob has them."""

    pid: None
    rank: int | None
    local_rank: int | None
    world_size: int | None


class WriteFailure(TypedDict):
    """model::WriteFailure: the profile could not be written to the end."""

    t_ns: int
    disk_full: bool
    error: str
    lost_samples: int


class ReportMeta(TypedDict):
    """The report's `meta` (model::RunMeta and what the run's end says)."""

    command: list[str]
    exit_code: int | None
    finished: bool
    recording: bool
    signal: int | None
    signal_name: str | None
    oom: OomFinding | None
    oom_killed: bool | None
    duration_ns: int | None
    interval_ms: float
    started_unix_s: float
    hostname: str
    host_total_bytes: int | None
    gpu_names: list[str]
    gpu_total_bytes: list[int]
    torchmem_version: str
    launch: JobPlace | None
    write_failure: WriteFailure | None


# --- line profiler (crates/torchmem-py/src/line.rs, torchmem_core::lines) ---


class LineStart(TypedDict):
    """`line_start`'s answer."""

    hook: str
    gate_ns: float
    min_page_fault_ns: float


class LineCallbacks(TypedDict):
    """`line_monitoring_callbacks`: raw builtins for sys.monitoring."""

    line: Callable[..., Any]
    start: Callable[..., Any]
    resume: Callable[..., Any]
    exit: Callable[..., Any]


#: (line, hits, rss_after_bytes, cpu_delta_bytes, cpu_delta_max_bytes, gpu_alloc_delta_bytes,
#: gpu_peak_bytes, gpu_reserved_delta_bytes).
LineSample = tuple[int, int, int, int, int, int | None, int | None, int | None]


class LineSnapshotFunction(TypedDict):
    code: CodeType
    calls: int
    threads: int
    lines: list[LineSample]


class _LineSnapshotOptional(TypedDict, total=False):
    warnings: list[str]
    reads: int
    events: int
    gate_ns: float
    hook: str
    gpu_device: int | None


class LineSnapshot(_LineSnapshotOptional):
    """`line_snapshot`: only `functions` (empty) before the line profiler ever started."""

    functions: list[LineSnapshotFunction]


class _LinePayloadRowOptional(TypedDict, total=False):
    cpu_rss_bytes: int
    cpu_delta_bytes: int
    cpu_delta_max_bytes: int
    gpu_alloc_delta_bytes: int | None
    gpu_peak_bytes: int | None
    gpu_reserved_delta_bytes: int | None


class LinePayloadRow(_LinePayloadRowOptional):
    """One source line of a payload; the numbers only on lines that ran."""

    line: int
    source: str
    hits: int


class LinePayloadFunction(TypedDict):
    name: str
    filename: str
    first_line: int
    calls: int
    threads: int
    lines: list[LinePayloadRow]


class LinePayload(TypedDict):
    """`line_profiler.profile_data()`: the `torchmem.lines/1` payload (lines::LineProfile) that the renderers
    and `line_report` read."""

    schema: str
    hook: str
    gate_ns: float
    gpu_device: int | None
    python: str
    reads: int
    events: int
    warnings: list[str]
    functions: list[LinePayloadFunction]


class LineReportRow(TypedDict):
    """lines::LineRow."""

    line: int
    source: str
    hits: int
    cpu_rss_bytes: int | None
    cpu_delta_bytes: int | None
    cpu_delta_max_bytes: int | None
    gpu_alloc_delta_bytes: int | None
    gpu_peak_bytes: int | None
    gpu_reserved_delta_bytes: int | None


class LineReportFunction(TypedDict):
    """lines::FunctionProfile with its payload's `gpu`, `gpu_device` and `hook`."""

    name: str
    filename: str
    first_line: int
    calls: int
    threads: int
    lines: list[LineReportRow]
    gpu: bool
    gpu_device: int | None
    hook: str


class LineReport(TypedDict):
    """The `lines` section of `torchmem report --format json` (lines::to_json)."""

    functions: list[LineReportFunction]
    warnings: list[str]


class ProfileReport(_SummaryBase):
    """`ProfileData.summary()`: the dict of `torchmem report --format json` (report/json.rs)."""

    format: str
    version: int
    profile: str
    meta: ReportMeta
    cuda: bool
    growth: list[ReportGrowth]
    lines: LineReport


# --- devices (sources::device_info) ---


class DeviceEntry(TypedDict):
    """sources::device_info::DeviceEntry: one NVML device."""

    index: int
    name: str
    uuid: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    this_process_bytes: int | None
    other_processes_bytes: int
    #: pid -> bytes NVML charges it.
    processes: dict[int, int]


class DeviceInfo(TypedDict):
    """sources::device_info::DeviceInfo (`device_info`)."""

    host_total_bytes: int | None
    host_available_bytes: int | None
    nvml_error: str | None
    driver_version: str | None
    cuda_driver_version: str | None
    devices: list[DeviceEntry]


class TorchDeviceInfo(DeviceInfo):
    """`torchmem.device_info()`: `DeviceInfo` (`devices` kept to the one asked for) plus torch's side, read
    without importing torch when it is not imported (None where unknown)."""

    torch_version: str | None
    torch_cuda_version: str | None
    #: None until the program imported torch.
    torch_cuda_available: bool | None


# --- leaks (analysis::leaks) ---


class StepGrowth(TypedDict):
    """analysis::leaks::StepGrowth (`StepGrowthDetector.push`)."""

    what: str
    per_step_bytes: int
    window_steps: int
    rising_steps: int
    steps_seen: int


class _KeptInArgOptional(TypedDict, total=False):
    name: str | None
    file: str | None
    line: int | None
    source: str


class KeptInArg(_KeptInArgOptional):
    """analysis::leaks::KeptIn as `leak_findings` reads it: only `container` is needed (a variable holder is
    {"container": "variable", "name"})."""

    container: str


class _TensorSiteOptional(TypedDict, total=False):
    function: str
    source: str
    graph_bytes_by_step: list[int]
    graph_nodes_by_step: list[int]
    inplace_live: int
    graph_truncated: bool
    held_by: str | None
    graph_saves_unread: bool
    kept_in: KeptInArg | None


class TensorSite(_TensorSiteOptional):
    """analysis::leaks::TensorSite as `leak_findings` reads it (the optional keys default)."""

    file: str
    line: int
    device: str
    live_by_step: list[int]
    live_bytes_by_step: list[int]


class _PythonLineOptional(TypedDict, total=False):
    source: str


class PythonLine(_PythonLineOptional):
    """analysis::leaks::PythonLine."""

    file: str
    line: int
    size_bytes_by_step: list[int]
    count_by_step: list[int]


class _ProbeDataOptional(TypedDict, total=False):
    first_step: int | None
    growth: StepGrowth | None
    tensors: list[TensorSite]
    python: list[PythonLine]


class ProbeData(_ProbeDataOptional):
    """analysis::leaks::ProbeData: one probe's facts, `leak_findings`'s input (the optional keys default)."""

    probe_steps: int


class LeakReport(TypedDict):
    """analysis::leaks::LeakReport (`leak_findings`)."""

    growth: StepGrowth | None
    probe_steps: int
    first_step: int | None
    findings: list[LeakFinding]
    unexplained: str | None


# --- allocator snapshots (torchmem-snapshot) ---


class SnapshotSegment(TypedDict):
    """snapshot::summary::SegmentInfo."""

    device: int
    address: int
    segment_type: str
    stream: int
    #: (a, b) as a list.
    pool_id: list[int]
    is_expandable: bool
    total_bytes: int
    allocated_bytes: int
    active_bytes: int
    requested_bytes: int
    inactive_split_bytes: int
    largest_free_block_bytes: int
    blocks: int


class SnapshotOom(TypedDict):
    """snapshot::summary::OomEvent: an OOM the trace recorded."""

    size_bytes: int
    device_free_bytes: int | None
    time_us: int


class SnapshotHistory(TypedDict):
    """snapshot::summary::History: what the trace's ring buffer kept."""

    wrapped: bool | None
    max_entries: int | None
    frees_without_alloc: int
    frees_without_alloc_bytes: int
    live_without_alloc: int
    live_without_alloc_bytes: int
    note: str


class SnapshotDevice(TypedDict):
    """snapshot::summary::DeviceSummary."""

    device: int
    segments: int
    reserved_bytes: int
    allocated_bytes: int
    active_bytes: int
    requested_bytes: int
    reserved_unallocated_bytes: int
    inactive_split_bytes: int
    largest_free_block_bytes: int
    blocks_allocated: int
    blocks_pending_free: int
    blocks_inactive: int
    trace_entries: int
    first_time_us: int | None
    last_time_us: int | None
    peak_requested_bytes: int
    peak_time_us: int | None
    peak_index: int | None
    end_requested_bytes: int
    history: SnapshotHistory
    ooms: list[SnapshotOom]


class SnapshotSummary(TypedDict):
    """snapshot::summary::Summary."""

    devices: list[SnapshotDevice]
    #: action name -> count.
    action_counts: dict[str, int]
    segments: list[SnapshotSegment]
    unique_frames: int
    unique_stacks: int
    trace_entries: int
    #: The snapshot's own allocator settings, as recorded (free-form).
    allocator_settings: dict[str, Any]
    annotations: int


class SiteRow(TypedDict):
    """snapshot::sites::SiteRow."""

    site: str
    bytes: int
    count: int
    before_history_count: int
    example_stack: list[str]


class TopSites(TypedDict):
    """snapshot::sites::TopSites: one device's top sites at a moment ("peak", "time" or "end")."""

    device: int
    moment: str
    time_us: int | None
    total_bytes: int
    rows: list[SiteRow]


class SnapshotReport(TypedDict):
    """`snapshot_summary` / `snapshot_summary_bytes`."""

    file: str
    summary: SnapshotSummary
    top: list[TopSites]


class OomNumbers(TypedDict):
    """snapshot::oom::OomNumbers: the numbers of an OOM (unknown ones None, never 0)."""

    backend: OomBackend
    wording: OomWording | None
    device: int | None
    requested_bytes: int
    total_bytes: int | None
    total_is_limit: bool
    free_bytes: int | None
    process_bytes: int | None
    allocated_bytes: int | None
    reserved_unallocated_bytes: int | None
    other_allocations_bytes: int | None
    #: [pid, bytes] pairs.
    other_processes: list[list[int]]
    listed_processes: list[list[int]]
    this_process_pid: int | None
    this_process_note: str | None
    largest_free_block_bytes: int | None


class OomDiagnosis(TypedDict):
    """snapshot::oom::Diagnosis plus its `text` (`oom_diagnosis`, `explain_oom`)."""

    numbers: OomNumbers
    reserved_bytes: int | None
    #: "fragmentation" | "capacity" | "other_processes" | "request_too_large" | ...
    verdict: str
    explanation: str
    shortfall_bytes: int | None
    non_pytorch_bytes: int | None
    other_processes_bytes: int | None
    other_processes_at_least: bool
    batch_factor: float | None
    next_steps: list[str]
    notes: list[str]
    text: str


# --- allocator simulator (torchmem-sim) ---


class SimStats(TypedDict):
    """sim::allocator::Stats: the simulated allocator's counters at the end."""

    allocated_bytes: int
    peak_allocated_bytes: int
    reserved_bytes: int
    peak_reserved_bytes: int
    active_bytes: int
    peak_active_bytes: int
    requested_bytes: int
    peak_requested_bytes: int
    segments: int
    peak_segments: int
    num_device_alloc: int
    num_device_free: int
    num_alloc_retries: int
    num_ooms: int


class SimSegEvent(TypedDict):
    """sim::allocator::SegEvent: one segment event of the replay or the recording."""

    kind: Literal["segment_alloc", "segment_free", "segment_map", "segment_unmap"]
    addr: int
    size_bytes: int
    #: The trace entry whose allocation (or `empty_cache`) caused it.
    entry: int


class SimDivergence(TypedDict):
    """sim::replay::Divergence: the first segment event where the replay and the recording differ."""

    event_index: int
    entry: int
    expected: SimSegEvent | None
    got: SimSegEvent | None
    what: str


class SimLiveBlock(TypedDict):
    """sim::replay::LiveBlock: a block alive at the simulated OOM."""

    addr: int
    size_bytes: int
    requested_bytes: int
    entry: int | None
    frame: str | None


class SimOom(TypedDict):
    """sim::replay::OomReport: the request the simulated allocator could not serve."""

    entry: int
    time_us: int
    trace_start_us: int
    requested_bytes: int
    rounded_bytes: int
    segment_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    over_memory_limit: bool
    frames: list[str]
    live_blocks: int
    largest_live: list[SimLiveBlock]
    recorded: bool


class SimComparison(TypedDict):
    """sim::replay::Comparison: the replay against the recorded segment events."""

    matches: bool
    segment_events: int
    recorded_segment_events: int
    recorded_peak_reserved_bytes: int
    divergence: SimDivergence | None


class SimDevice(TypedDict):
    """One device's result (render::device_json: sim::replay::DeviceResult, `matches_recording`, `verdict`)."""

    device: int
    entries: int
    settings: str
    recorded_settings: str
    memory_limit_bytes: int | None
    device_memory_bytes: int | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_active_bytes: int
    peak_requested_bytes: int
    reserved_unallocated_at_peak_bytes: int
    num_cuda_malloc: int
    num_cuda_free: int
    num_map: int
    num_unmap: int
    num_alloc_retries: int
    num_ooms: int
    stats: SimStats
    oom: SimOom | None
    #: Trace entries of recorded OOMs the simulation does not hit.
    recorded_ooms_avoided: list[int]
    comparison: SimComparison | None
    starts_empty: bool
    start_reserved_bytes: int
    start_segments: int
    notes: list[str]
    matches_recording: bool | None
    verdict: str


class _SimTopOptional(TypedDict, total=False):
    # The first device's fields, at the top (absent when no device could be simulated).
    device: int
    entries: int
    settings: str
    recorded_settings: str
    memory_limit_bytes: int | None
    device_memory_bytes: int | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_active_bytes: int
    peak_requested_bytes: int
    reserved_unallocated_at_peak_bytes: int
    num_cuda_malloc: int
    num_cuda_free: int
    num_map: int
    num_unmap: int
    num_alloc_retries: int
    num_ooms: int
    stats: SimStats
    oom: SimOom | None
    recorded_ooms_avoided: list[int]
    comparison: SimComparison | None
    starts_empty: bool
    start_reserved_bytes: int
    start_segments: int
    notes: list[str]
    matches_recording: bool | None
    verdict: str
    #: Only with `min_memory=True`.
    min_memory: list[MinMemoryDevice]


class SimRefused(TypedDict):
    """sim::Refused: a device the simulator would not replay."""

    device: int
    reason: str


class MinMemory(TypedDict):
    """sim::search::MinMemory: the least device memory the trace fits in under `settings`."""

    settings: str
    min_memory_bytes: int | None
    unlimited_peak_reserved_bytes: int
    runs: int


class MinMemoryDevice(TypedDict):
    device: int
    settings: list[MinMemory]


class SimulateResult(_SimTopOptional):
    """`simulate`: the dict of `torchmem simulate --json` (render::json) plus `text`."""

    file: str
    rules: str
    version_note: str | None
    refused: list[SimRefused]
    devices: list[SimDevice]
    text: str


class WhatIfRow(TypedDict):
    """sim::whatif::WhatIfRow: the trace under one allocator setting."""

    settings: str
    recorded: bool
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    reserved_change_bytes: int
    num_alloc_retries: int
    oom: bool
    avoids_recorded_oom: bool | None
    min_memory_bytes: int | None
    min_memory_searched: bool
    min_memory_change_bytes: int | None


class WhatIfPanel(TypedDict):
    """sim::whatif::WhatIf: one device's panel."""

    device: int
    unavailable: str | None
    headline: str
    recorded_oom: bool
    conditions: str
    rows: list[WhatIfRow]
    notes: list[str]


class WhatIfResult(TypedDict):
    """`whatif`."""

    devices: list[WhatIfPanel]
    text: str


# --- the estimator (torchmem-estimator) ---


class GpuContext(TypedDict):
    """estimator::gpus::ContextOverhead: the measured CUDA context."""

    base_bytes: int
    half_precision_bytes: int
    convolution_bytes: int


class GpuCatalogueEntry(TypedDict):
    """estimator::gpus::Gpu: one catalogue entry (`gpu_catalogue`, `find_gpu`)."""

    key: str
    name: str
    nvml_total_bytes: int
    cuda_total_bytes: int
    cuda_total_measured: bool
    major: int
    minor: int
    multi_processor_count: int
    context: GpuContext | None


class Uncertainty(TypedDict):
    """estimator::summary::Uncertainty: a request whose size the emulation could not know exactly."""

    kind: str
    what: str
    op: str
    shapes: str
    site: str
    calls: int
    bytes: int


class EstimateOomAt(TypedDict):
    """estimator::report::OomAt."""

    entry: int
    frames: list[str]


class LargestTensor(TypedDict):
    """estimator::summary::LargestTensor."""

    size_bytes: int
    phase: str | None
    what: str | None
    site: str | None
    step: int | None


class NcclCommunicator(TypedDict):
    """estimator::summary::NcclCommunicator."""

    ranks: int
    peers: int
    channels: int
    bytes: int


class NcclModel(TypedDict):
    """estimator::summary::NcclModel."""

    bytes: int
    low_bytes: int
    high_bytes: int
    buffsize_bytes: int
    channels: int
    verified: bool
    source: str
    communicators: list[NcclCommunicator]


class RankClass(TypedDict):
    """estimator::report::RankClass."""

    ranks: list[int]
    traced_rank: int
    what: str
    traced: bool
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    nvml_bytes: int
    nccl_bytes: int
    fits: bool
    fits_point: bool
    margin_bytes: int
    peak_allocated_upper_bytes: int
    peak_reserved_upper_bytes: int
    nvml_upper_bytes: int
    margin_upper_bytes: int
    num_alloc_retries: int
    oom: EstimateOomAt | None


class TracerSummary(TypedDict, total=False):
    """The tracer's summary, `estimate_report`'s input: estimator::summary::Summary (every key defaults on the
    Rust side), as python/torchmem/estimator/_runner.py `summary()` writes it. Its nested records built in
    Python (`uncertainty`, `distributed`, `convolution_workspaces`) are free-form here."""

    kind: EstimateKind | None
    steps_traced: int | None
    forward_calls: int | None
    generate_calls: int | None
    backward_calls: int | None
    #: estimator::summary::StopReason: "steps", "forward calls", "program ended", "error" (others read as other).
    reason: str | None
    error: str | None
    notes: list[str]
    trace_peak_bytes: int | None
    phase_peak_bytes: dict[str, int] | None
    largest_at_peak: list[LargestTensor] | None
    uses_half_precision: bool
    uses_convolution: bool
    convolution_workspaces: Any
    requests: int | None
    trace_seconds: float | None
    torch_version: str | None
    gpu: str | None
    distributed: dict[str, Any] | None
    uncertainty: list[dict[str, Any]]
    #: [trace address, upper size in bytes, anchor] per request whose size is not known exactly.
    uncertain_requests: list[list[int]]


class EstimateReport(TypedDict):
    """estimator::report::EstimateReport plus its `text` (`estimate_report`)."""

    gpu: str
    gpu_key: str
    device_memory_bytes: int
    nvml_total_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    peak_requested_bytes: int
    context_bytes: int
    context_measured: bool
    nvml_bytes: int
    fits: bool
    margin_bytes: int
    peak_allocated_upper_bytes: int
    peak_reserved_upper_bytes: int
    nvml_upper_bytes: int
    margin_upper_bytes: int
    fits_point: bool
    uncertainty: list[Uncertainty]
    num_alloc_retries: int
    oom: EstimateOomAt | None
    kind: EstimateKind
    steps_traced: int | None
    forward_calls: int | None
    generate_calls: int | None
    traced: str
    phase_peak_bytes: dict[str, int] | None
    largest_at_peak: list[LargestTensor] | None
    trace_seconds: float | None
    requests: int | None
    #: The convolution workspaces the trace asked for (free-form JSON).
    convolution_workspaces: Any
    alloc_conf: str
    simulator_rules: str
    notes: list[str]
    world_size: int
    rank: int
    nccl_bytes: int
    nccl: NcclModel | None
    ranks: list[RankClass]
    text: str
