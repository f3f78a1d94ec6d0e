//! The narrow record types that flow from the sources into the store and out to analysis.
//!
//! Times are `t_ns`: nanoseconds since the run started, on CLOCK_MONOTONIC. Sizes are bytes. A value
//! that could not be measured (no GPU, PSS not read this tick) is `None`, never a fake zero.

use serde::{Deserialize, Serialize};

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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
}
