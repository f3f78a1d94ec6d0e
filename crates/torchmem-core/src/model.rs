//! The narrow record types that flow from the sources into the store and out to analysis.
//!
//! Times are `t_ns`: nanoseconds since the run started, on CLOCK_MONOTONIC. Sizes are bytes. A value
//! that could not be measured (no GPU, PSS not read this tick) is `None`, never a fake zero.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use crate::breakdown::{BreakdownAggregate, DeviceBreakdown};

/// Who sent a record: the profiled process, and its place in a distributed job when the environment says
/// (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`; else Slurm's `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`).
/// All None in a schema-v1 profile (recorded before torchmem kept identity).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Origin {
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub rank: Option<u32>,
    #[serde(default)]
    pub local_rank: Option<u32>,
    #[serde(default)]
    pub world_size: Option<u32>,
}

impl Origin {
    /// Rank, local rank and world size from the variables `get` reads (`|n| std::env::var(n).ok()` for this
    /// process's environment); no pid.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Self {
        Origin {
            pid: None,
            rank: var_u32(get, RANK_VARS),
            local_rank: var_u32(get, LOCAL_RANK_VARS),
            world_size: var_u32(get, WORLD_SIZE_VARS),
        }
    }

    /// The part of the identity that tells two span streams apart: spans pair, and fold, per (pid, rank).
    pub fn stream(&self) -> (Option<u32>, Option<u32>) {
        (self.pid, self.rank)
    }
}

/// A distributed launch's variables, by the name torchrun sets first and Slurm's second (the same order
/// as `Origin`'s: `RANK` then `SLURM_PROCID`, …).
const RANK_VARS: [&str; 2] = ["RANK", "SLURM_PROCID"];
const LOCAL_RANK_VARS: [&str; 2] = ["LOCAL_RANK", "SLURM_LOCALID"];
const WORLD_SIZE_VARS: [&str; 2] = ["WORLD_SIZE", "SLURM_NTASKS"];
const GROUP_RANK_VARS: [&str; 2] = ["GROUP_RANK", "SLURM_NODEID"];
const RESTART_COUNT_VARS: [&str; 2] = ["TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"];

fn var_u32(get: &dyn Fn(&str) -> Option<String>, names: [&str; 2]) -> Option<u32> {
    names.iter().find_map(|n| get(n)?.trim().parse().ok())
}

/// Where in a distributed launch a process runs beyond its rank (`Origin`): its node (torchrun's
/// `GROUP_RANK`, else Slurm's `SLURM_NODEID`) and its attempt (`TORCHELASTIC_RESTART_COUNT`, else Slurm's
/// `SLURM_RESTART_COUNT`: 0 the first time, 1 after one restart). None where the environment does not say.
/// Carried by the hello and kept in the `identity` blob (no table column).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Launch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_rank: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_count: Option<u32>,
}

impl Launch {
    /// From the variables `get` reads (`|n| std::env::var(n).ok()` for this process's environment).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Self {
        Launch { group_rank: var_u32(get, GROUP_RANK_VARS), restart_count: var_u32(get, RESTART_COUNT_VARS) }
    }
}

/// The recorder's own place in a distributed launch, from its environment: set when `torchmem run` itself
/// runs as a rank (`torchrun -m torchmem run …`, `srun torchmem run …`), so a profile whose program sent
/// no hello still says whose it is. Kept in the run's metadata (`RunMeta::launch`), its fields flat.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobPlace {
    /// Rank, local rank and world size (`Origin::from_vars`; no pid: the launch's place, not a process's).
    #[serde(flatten)]
    pub origin: Origin,
    #[serde(flatten)]
    pub launch: Launch,
}

impl JobPlace {
    /// From the variables `get` reads; None when none of them is set (not a distributed launch).
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Option<Self> {
        let place = JobPlace { origin: Origin::from_vars(get), launch: Launch::from_vars(get) };
        (place != JobPlace::default()).then_some(place)
    }
}

/// CPU memory of the whole profiled process tree at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CpuSample {
    pub t_ns: u64,
    /// Sum of resident set sizes (counts pages shared between processes once per process).
    pub rss_bytes: u64,
    /// Sum of proportional set sizes: shared pages split between sharers, so the sum never double counts.
    pub pss_bytes: Option<u64>,
    /// Sum of unique set sizes (private pages only).
    pub uss_bytes: Option<u64>,
    pub process_count: u32,
}

/// One process of the tree at one moment (taken at the slower PSS/USS rate).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessSample {
    pub t_ns: u64,
    pub pid: u32,
    pub rss_bytes: u64,
    pub pss_bytes: Option<u64>,
    pub uss_bytes: Option<u64>,
    /// NVML's used GPU memory for this pid, summed over devices; None without NVML.
    pub gpu_bytes: Option<u64>,
}

/// A process seen in the tree, with its command line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProcessInfo {
    pub pid: u32,
    pub ppid: u32,
    pub cmdline: String,
    pub first_t_ns: u64,
    pub last_t_ns: u64,
}

/// One GPU as NVML sees it at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    pub t_ns: u64,
    /// NVML device index.
    pub device: u32,
    /// Device-wide used memory (what nvidia-smi shows), all processes.
    pub used_bytes: u64,
    pub total_bytes: u64,
    /// NVML per-process used memory summed over the profiled tree (CUDA context included).
    pub process_bytes: Option<u64>,
}

/// PyTorch's caching allocator, read inside the profiled process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TorchSample {
    pub t_ns: u64,
    /// The GPU's NVML index, as in `GpuSample`: the in-process sampler maps torch's device index (which
    /// CUDA_VISIBLE_DEVICES renumbers) through the device's UUID; torch's own index where NVML cannot say.
    pub device: u32,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    /// torch's own peak counters (since start or the last reset_peak_memory_stats).
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub active_bytes: u64,
    pub inactive_split_bytes: u64,
    /// The process whose allocator this is.
    #[serde(default)]
    pub origin: Origin,
}

/// The mark `torchmem.empty_cache()` records after it emptied PyTorch's cache and gave glibc's free heap back
/// (`python/torchmem/api.py`): its RSS is what the process still holds.
pub const CACHE_EMPTIED_MARK: &str = "Cache emptied";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MarkerKind {
    Epoch,
    Step,
    Phase,
    Mark,
}

impl MarkerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MarkerKind::Epoch => "epoch",
            MarkerKind::Step => "step",
            MarkerKind::Phase => "phase",
            MarkerKind::Mark => "mark",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "epoch" => MarkerKind::Epoch,
            "step" => MarkerKind::Step,
            "phase" => MarkerKind::Phase,
            "mark" => MarkerKind::Mark,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Edge {
    Start,
    End,
    Point,
}

impl Edge {
    pub fn as_str(self) -> &'static str {
        match self {
            Edge::Start => "start",
            Edge::End => "end",
            Edge::Point => "point",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "start" => Edge::Start,
            "end" => Edge::End,
            "point" => Edge::Point,
            _ => return None,
        })
    }
}

/// Memory read at a marker, by the Python API inside the profiled process.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MarkerMemory {
    pub rss_bytes: Option<u64>,
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    /// At an End edge: the peak reached inside the span (exact, from the allocator's peak counters).
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
    /// At an epoch's End edge (the in-process Monitor): RSS less what glibc's malloc keeps freed and resident
    /// (`analysis::leaks::held_rss_bytes`, the series the step leak detector judges). The epoch growth
    /// warning judges it instead of RSS. Stored since schema v4 (`markers.held_rss_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_rss_bytes: Option<u64>,
}

/// A phase, step or epoch boundary, or a point mark, from the Python API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Marker {
    pub t_ns: u64,
    pub kind: MarkerKind,
    pub edge: Edge,
    pub name: String,
    /// Epoch or step number when the API knows it.
    pub index: Option<i64>,
    pub memory: MarkerMemory,
    /// The process (and rank) that marked it: spans pair within one process only.
    #[serde(default)]
    pub origin: Origin,
    /// The GPU whose allocator `memory` read, by NVML index as in `TorchSample::device`; None when the
    /// marker read no GPU (CPU only). Its peaks count for that GPU alone.
    #[serde(default)]
    pub device: Option<u32>,
    /// What the memory is at this boundary, per device (the Monitor's step start and phase ends; see
    /// `breakdown`); None when the marker carries none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breakdown: Option<Vec<DeviceBreakdown>>,
    /// Bytes each module's forward left saved for backward (qualified module name -> bytes; opt-in, in the
    /// end-of-forward marker).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activations_by_module: Option<std::collections::BTreeMap<String, u64>>,
}

impl Marker {
    /// A marker with nothing read: no index, no memory, no identity, no device, no breakdown. Set the rest
    /// with struct update syntax: `Marker { index: Some(3), ..Marker::new(t, kind, edge, "epoch") }`.
    pub fn new(t_ns: u64, kind: MarkerKind, edge: Edge, name: impl Into<String>) -> Marker {
        Marker {
            t_ns,
            kind,
            edge,
            name: name.into(),
            index: None,
            memory: MarkerMemory::default(),
            origin: Origin::default(),
            device: None,
            breakdown: None,
            activations_by_module: None,
        }
    }
}

/// Running totals of some spans (steps, phases): counts, durations, delta sums and peaks. Sums and counts, not
/// means, so totals add up exactly (`merge`): the folded rows (`SpanAggregate`) and the tables' sums over kept
/// spans plus folded rows (`analysis::aggregate`) are the same record.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpanTotals {
    /// Spans counted, open ones included.
    pub count: u64,
    pub total_ns: u64,
    pub min_ns: Option<u64>,
    pub max_ns: Option<u64>,
    /// Σ (exit − entry) over the spans where both were read, and how many those were.
    pub delta_allocated_sum_bytes: i64,
    pub delta_allocated_count: u64,
    pub delta_rss_sum_bytes: i64,
    pub delta_rss_count: u64,
    /// The highest value inside any of the spans (the exit's exact peak, else exit or entry value).
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
}

impl SpanTotals {
    /// Adds another total.
    pub fn merge(&mut self, o: &SpanTotals) {
        self.count += o.count;
        self.total_ns += o.total_ns;
        self.min_ns = opt_min(self.min_ns, o.min_ns);
        self.max_ns = opt_max(self.max_ns, o.max_ns);
        self.delta_allocated_sum_bytes += o.delta_allocated_sum_bytes;
        self.delta_allocated_count += o.delta_allocated_count;
        self.delta_rss_sum_bytes += o.delta_rss_sum_bytes;
        self.delta_rss_count += o.delta_rss_count;
        self.peak_allocated_bytes = opt_max(self.peak_allocated_bytes, o.peak_allocated_bytes);
        self.peak_reserved_bytes = opt_max(self.peak_reserved_bytes, o.peak_reserved_bytes);
        self.peak_rss_bytes = opt_max(self.peak_rss_bytes, o.peak_rss_bytes);
    }
}

/// The spans (steps, phases) that were folded instead of kept as markers: every occurrence after the first
/// `keep_spans` of one (pid, rank, kind, name), summed per epoch and device. Rows of the same key add up
/// exactly (`merge`), and together with the kept markers give exactly the totals that all markers would.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpanAggregate {
    pub origin: Origin,
    pub kind: MarkerKind,
    pub name: String,
    /// The index of the epoch open in that process when the spans started; None outside any epoch.
    pub epoch: Option<i64>,
    pub device: Option<u32>,
    /// The folded spans' totals (`count` includes open ones).
    #[serde(flatten)]
    pub totals: SpanTotals,
    /// Spans still open when the recording ended: counted, without a duration.
    pub open_count: u64,
    pub first_start_t_ns: u64,
    pub last_end_t_ns: Option<u64>,
}

/// What identifies one aggregate row: (pid, rank, kind, name, epoch, device).
pub type AggregateKey = (Option<u32>, Option<u32>, MarkerKind, String, Option<i64>, Option<u32>);

impl SpanAggregate {
    pub fn key(&self) -> AggregateKey {
        (self.origin.pid, self.origin.rank, self.kind, self.name.clone(), self.epoch, self.device)
    }

    /// Adds another row of the same key.
    pub fn merge(&mut self, o: &SpanAggregate) {
        self.totals.merge(&o.totals);
        self.open_count += o.open_count;
        self.first_start_t_ns = self.first_start_t_ns.min(o.first_start_t_ns);
        self.last_end_t_ns = opt_max(self.last_end_t_ns, o.last_end_t_ns);
    }
}

/// The larger of two optional values (None only when both are None).
pub fn opt_max(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

fn opt_min(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// What the profile says about the run as a whole.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunMeta {
    pub command: Vec<String>,
    pub started_unix_s: f64,
    pub interval_ms: f64,
    pub torchmem_version: String,
    pub hostname: String,
    /// Filled when the run ends; None in a profile whose recorder was killed.
    pub exit_code: Option<i32>,
    pub duration_ns: Option<u64>,
    /// Total bytes per NVML device index.
    pub gpu_total_bytes: Vec<u64>,
    pub gpu_names: Vec<String>,
    pub host_total_bytes: Option<u64>,
    /// CLOCK_MONOTONIC at the run's start (ns): add it to any `t_ns` to compare with `time.monotonic_ns()`.
    #[serde(default)]
    pub start_monotonic_ns: Option<u64>,
    /// How many occurrences of each (pid, rank, kind, name) step or phase the recorder kept as markers (the
    /// rest are `SpanAggregate` rows); None in a profile recorded before folding (schema v1: all kept).
    #[serde(default)]
    pub keep_spans: Option<u64>,
    /// The signal that killed the program (its exit code is then 128 + it, as a shell reports); None when
    /// it exited by itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// What the kernel's OOM killer did during the run, as far as torchmem could read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oom: Option<OomFinding>,
    /// The recorder's own rank, node and attempt when it runs inside a distributed launch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch: Option<JobPlace>,
    /// Why the profile stops before the run's end: the recorder could not write it any more (the disk
    /// filled up). None when everything was written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub write_failure: Option<WriteFailure>,
    /// Not stored: set when the profile is opened while a live `torchmem run` still holds it.
    #[serde(skip)]
    pub recording: bool,
    /// Not stored: set when an unfinished profile is opened without its write-ahead log (`-wal`) beside
    /// it: the main file of a live run, copied alone, holding the data up to the log's last checkpoint.
    #[serde(skip)]
    pub copied_without_wal: bool,
}

/// The recorder could not write the profile any more (the disk filled up, an I/O error): the program ran
/// on to its end, what was committed before is kept, and the samples taken from `t_ns` on were dropped.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WriteFailure {
    /// The first lost sample's time, ns since the run started.
    pub t_ns: u64,
    /// The filesystem (or the user's quota) was full.
    pub disk_full: bool,
    /// The error as the store said it.
    pub error: String,
    /// CPU samples taken but not written (PyTorch, NVML and marker records of the same time went too).
    pub lost_samples: u64,
}

impl WriteFailure {
    /// One line for the report and the run's end: "the disk filled up at t=2.350 s; 180 samples lost".
    pub fn describe(&self) -> String {
        let at = format!("t={:.3} s", self.t_ns as f64 / 1e9);
        let lost = match self.lost_samples {
            1 => "1 sample lost".to_string(),
            n => format!("{n} samples lost"),
        };
        if self.disk_full {
            format!("the disk filled up at {at}; {lost}")
        } else {
            format!("the profile could not be written from {at} on ({}); {lost}", self.error)
        }
    }
}

/// The OOM killer's doing during a run: its counters before and after (the run's memory cgroup, the host)
/// and, where the kernel log was readable, whether it named the program as its victim.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OomFinding {
    /// OOM kills counted in the run's memory cgroup during the run (`memory.events` `oom_kill` on cgroup
    /// v2, `memory.oom_control` on v1); None where it could not be read.
    pub cgroup_kills: Option<u64>,
    /// OOM kills counted on the whole host during the run (`/proc/vmstat` `oom_kill`).
    pub host_kills: Option<u64>,
    /// The kernel log's "Killed process PID" named the program; None where the log was not readable.
    pub program_in_kernel_log: Option<bool>,
}

impl OomFinding {
    /// Whether the program's death by `signal` was the OOM killer's: Some(true) sure or very likely,
    /// Some(false) not (the counters were read and did not move), None unknown.
    pub fn killed_program(&self, signal: i32) -> Option<bool> {
        if signal != 9 {
            return Some(false);
        }
        if let Some(named) = self.program_in_kernel_log {
            if named {
                return Some(true);
            }
        }
        match (self.cgroup_kills, self.host_kills) {
            (Some(c), _) if c > 0 => Some(true),
            (_, Some(h)) if h > 0 => None,
            (Some(_), _) | (_, Some(_)) => Some(false),
            (None, None) => None,
        }
    }

    /// One sentence about the OOM killer for a run whose program died of `signal` (None: it exited).
    pub fn describe(&self, signal: Option<i32>) -> Option<String> {
        let kills = |n: u64| if n == 1 { "1 process".to_string() } else { format!("{n} processes") };
        match signal {
            Some(9) => Some(match (self.program_in_kernel_log, self.cgroup_kills, self.host_kills) {
                (Some(true), _, _) => "the kernel's OOM killer killed it (kernel log)".into(),
                (_, Some(c), _) if c > 0 => format!(
                    "the kernel's OOM killer, most likely: it killed {} in this run's memory cgroup during the run",
                    kills(c)
                ),
                (_, _, Some(h)) if h > 0 => {
                    format!("perhaps the kernel's OOM killer: it killed {} on this host during the run", kills(h))
                }
                (_, None, None) => "the kernel's OOM killer? (its counters could not be read)".into(),
                _ => "not the OOM killer (it killed nothing during the run): something sent SIGKILL".into(),
            }),
            _ => match self.cgroup_kills {
                Some(c) if c > 0 => Some(format!(
                    "the kernel's OOM killer killed {} in this run's memory cgroup during the run (a worker?)",
                    kills(c)
                )),
                _ => None,
            },
        }
    }
}

/// A signal's name, as `kill -l` spells it with the SIG prefix (`SIGKILL`, `SIGRTMIN+3`), or `signal N`.
pub fn signal_name(signal: i32) -> String {
    const NAMES: [&str; 32] = [
        "",
        "SIGHUP",
        "SIGINT",
        "SIGQUIT",
        "SIGILL",
        "SIGTRAP",
        "SIGABRT",
        "SIGBUS",
        "SIGFPE",
        "SIGKILL",
        "SIGUSR1",
        "SIGSEGV",
        "SIGUSR2",
        "SIGPIPE",
        "SIGALRM",
        "SIGTERM",
        "SIGSTKFLT",
        "SIGCHLD",
        "SIGCONT",
        "SIGSTOP",
        "SIGTSTP",
        "SIGTTIN",
        "SIGTTOU",
        "SIGURG",
        "SIGXCPU",
        "SIGXFSZ",
        "SIGVTALRM",
        "SIGPROF",
        "SIGWINCH",
        "SIGIO",
        "SIGPWR",
        "SIGSYS",
    ];
    match signal {
        1..=31 => NAMES[signal as usize].to_string(),
        34..=64 => format!("SIGRTMIN+{}", signal - 34),
        _ => format!("signal {signal}"),
    }
}

/// A whole profile, loaded for analysis and reports (by `Profile::open` in `store`; plain data, no SQLite here).
/// The markers are the kept ones; `aggregates` stand for the folded rest, so a long run loads in bounded
/// memory.
#[derive(Debug, Clone, Default)]
pub struct Profile {
    pub path: PathBuf,
    pub meta: RunMeta,
    /// The file's schema version (1: no identity, no aggregates).
    pub schema_version: i64,
    pub cpu: Vec<CpuSample>,
    pub processes: Vec<ProcessInfo>,
    pub process_samples: Vec<ProcessSample>,
    pub gpu: Vec<GpuSample>,
    pub torch: Vec<TorchSample>,
    pub markers: Vec<Marker>,
    pub aggregates: Vec<SpanAggregate>,
    /// The breakdowns of folded boundaries (exact per-category count/sum/max), with `markers`' own.
    pub breakdown_aggregates: Vec<BreakdownAggregate>,
    pub line_profiles: Vec<crate::lines::LineProfile>,
    /// Who sent each of `line_profiles` (same order).
    pub line_profile_origins: Vec<Origin>,
    /// The side records (`record::Blob`), in the order written; unknown kinds are `Blob::Other`.
    pub blobs: Vec<crate::record::Blob>,
    /// Who sent each of `blobs` (same order; all None for the recorder's own, and in v1/v2 files).
    pub blob_origins: Vec<Origin>,
}
