//! What the recorder writes: one enum of typed records, so one channel carries every kind. The store
//! (`crate::store::ProfileWriter`) persists them; sinks (`torchmem-recorder`) fold or export them.
//!
//! Every record is typed (schema v3): the samples and markers have their tables; the line profiler's table is
//! a `lines::LineProfile`; the named side records ("blobs") are a closed set of kinds, one serde struct each
//! (`Blob`), stored in the `blobs` table as their name and JSON. A name this torchmem does not know (a newer
//! writer's), or a known one whose JSON does not read as its struct, loads as `Blob::Other`, kept as it is.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::analysis::leaks::LeakReport;
use crate::lines::LineProfile;
use crate::model::*;

/// Everything the recorder writes, in one enum so one channel carries it.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Cpu(CpuSample),
    Process(ProcessSample),
    ProcessSeen(ProcessInfo),
    Gpu(GpuSample),
    Torch(TorchSample),
    Marker(Marker),
    /// A folded-spans row with its totals so far: replaces the previous row of the same key.
    Aggregate(SpanAggregate),
    /// A folded-breakdowns row with its totals so far: replaces the previous rows of the same key.
    BreakdownAggregate(BreakdownAggregate),
    /// The line profiler's tables, from the process `origin`.
    LineProfile {
        t_ns: u64,
        origin: Origin,
        profile: LineProfile,
    },
    /// A side record of one of the `Blob` kinds; `origin` is the process that sent it (all None for the
    /// recorder's own: `vmhwm`, `gpu_processes`, `outlived_program`, `identity`).
    Blob {
        t_ns: u64,
        origin: Origin,
        blob: Blob,
    },
}

/// The side records, one kind each. Stored as `(name, data)`: `name` is `Blob::name`, `data` the kind's
/// serde JSON (the names and JSON are those of the v1/v2 files, which read into the same kinds).
#[derive(Debug, Clone, PartialEq)]
pub enum Blob {
    /// `identity`: a process's hello (who it is, its node and attempt), one per connection.
    Identity(Identity),
    /// `gpu_processes`: the recorder's per (pid, GPU) NVML peaks so far (the latest holds them all).
    GpuProcesses(GpuProcesses),
    /// `vmhwm`: the kernel's RSS high-water mark of each process of the tree, stored when one rose.
    Vmhwm(Vmhwm),
    /// `outlived_program`: the processes of the tree still running when the program ended.
    Outlived(Outlived),
    /// `oom`: the post-mortem `torchmem.on_oom` writes, sent to the recorder too.
    Oom(Box<OomPostMortem>),
    /// `leaks`: a process's leak findings so far (its latest holds them all).
    Leaks(Box<LeakBlob>),
    /// A name this torchmem does not know, or data that does not read as its kind: kept as it is.
    Other { name: String, data: serde_json::Value },
}

impl Blob {
    pub const IDENTITY: &'static str = "identity";
    pub const GPU_PROCESSES: &'static str = "gpu_processes";
    pub const VMHWM: &'static str = "vmhwm";
    pub const OUTLIVED: &'static str = "outlived_program";
    pub const OOM: &'static str = "oom";
    pub const LEAKS: &'static str = "leaks";

    /// The name it is stored (and sent) under.
    pub fn name(&self) -> &str {
        match self {
            Blob::Identity(_) => Self::IDENTITY,
            Blob::GpuProcesses(_) => Self::GPU_PROCESSES,
            Blob::Vmhwm(_) => Self::VMHWM,
            Blob::Outlived(_) => Self::OUTLIVED,
            Blob::Oom(_) => Self::OOM,
            Blob::Leaks(_) => Self::LEAKS,
            Blob::Other { name, .. } => name,
        }
    }

    /// Its JSON, as stored in the `blobs` table's `data`.
    pub fn data(&self) -> serde_json::Value {
        let v = match self {
            Blob::Identity(b) => serde_json::to_value(b),
            Blob::GpuProcesses(b) => serde_json::to_value(b),
            Blob::Vmhwm(b) => serde_json::to_value(b),
            Blob::Outlived(b) => serde_json::to_value(b),
            Blob::Oom(b) => serde_json::to_value(b),
            Blob::Leaks(b) => serde_json::to_value(b),
            Blob::Other { data, .. } => return data.clone(),
        };
        v.unwrap_or_default()
    }

    /// The kind a stored (or sent) `(name, data)` is; `Other` when the name is unknown or the data does
    /// not read as its kind (never an error: a profile stays readable).
    pub fn from_parts(name: String, data: serde_json::Value) -> Blob {
        fn typed<T: serde::de::DeserializeOwned>(data: &serde_json::Value) -> Option<T> {
            T::deserialize(data).ok()
        }
        let known = match name.as_str() {
            Self::IDENTITY => typed(&data).map(Blob::Identity),
            Self::GPU_PROCESSES => typed(&data).map(Blob::GpuProcesses),
            Self::VMHWM => typed(&data).map(Blob::Vmhwm),
            Self::OUTLIVED => typed(&data).map(Blob::Outlived),
            Self::OOM => typed(&data).map(|b| Blob::Oom(Box::new(b))),
            Self::LEAKS => typed(&data).map(|b| Blob::Leaks(Box::new(b))),
            _ => None,
        };
        known.unwrap_or(Blob::Other { name, data })
    }
}

/// The `identity` blob: a process's hello, when the recorder got it (ns since the run's start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    #[serde(flatten)]
    pub origin: Origin,
    #[serde(flatten)]
    pub launch: Launch,
    #[serde(default)]
    pub t_ns: u64,
}

/// One GPU as the recorder's NVML listed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuIdentity {
    pub index: u32,
    #[serde(default)]
    pub uuid: String,
    #[serde(default)]
    pub name: String,
}

/// The highest NVML reading of one process on one GPU, and when it was first and last seen there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcessPeak {
    pub pid: u32,
    pub device: u32,
    pub peak_bytes: u64,
    pub first_t_ns: u64,
    pub last_t_ns: u64,
}

/// The `gpu_processes` blob.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcesses {
    #[serde(default)]
    pub devices: Vec<GpuIdentity>,
    #[serde(default)]
    pub processes: Vec<GpuProcessPeak>,
}

impl GpuProcesses {
    /// Folds one NVML reading of `pid` on `device` (bytes) taken at `t_ns`. True when it is worth storing
    /// again: the process is new on that GPU, or its peak there rose.
    pub fn observe(&mut self, pid: u32, device: u32, bytes: u64, t_ns: u64) -> bool {
        match self.processes.iter_mut().find(|p| p.pid == pid && p.device == device) {
            Some(p) => {
                p.last_t_ns = t_ns;
                let rose = bytes > p.peak_bytes;
                p.peak_bytes = p.peak_bytes.max(bytes);
                rose
            }
            None => {
                let first = GpuProcessPeak { pid, device, peak_bytes: bytes, first_t_ns: t_ns, last_t_ns: t_ns };
                self.processes.push(first);
                true
            }
        }
    }

    /// The latest `gpu_processes` blob of a profile.
    pub fn of(profile: &Profile) -> Option<GpuProcesses> {
        profile.blobs.iter().rev().find_map(|b| match b {
            Blob::GpuProcesses(g) => Some(g.clone()),
            _ => None,
        })
    }
}

/// The `vmhwm` blob: `{"pids": {"PID": bytes}}`, each process's `VmHWM` so far.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vmhwm {
    pub pids: BTreeMap<u32, u64>,
}

/// The `outlived_program` blob: `{"t_ns": end, "pids": [PID, …]}`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outlived {
    #[serde(default)]
    pub t_ns: u64,
    pub pids: Vec<u32>,
}

/// The `oom` blob: `torchmem.on_oom`'s post-mortem (`python/torchmem/snapshot.py`, the same record as its
/// `.json` file) and when it was written. The numbers PyTorch gave at the failure are None where unknown.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OomPostMortem {
    pub pid: u32,
    #[serde(default)]
    pub device: Option<u32>,
    #[serde(default)]
    pub requested_bytes: Option<u64>,
    #[serde(default)]
    pub device_total_bytes: Option<u64>,
    #[serde(default)]
    pub device_free_bytes: Option<u64>,
    #[serde(default)]
    pub memory_limit_bytes: Option<u64>,
    #[serde(default)]
    pub allocated_bytes: Option<u64>,
    #[serde(default)]
    pub reserved_bytes: Option<u64>,
    #[serde(default)]
    pub reserved_unallocated_bytes: Option<i64>,
    /// The Python frames that were allocating, innermost last.
    #[serde(default)]
    pub allocating_frames: Vec<String>,
    /// The snapshot's live blocks by allocation site (`torchmem_snapshot::sites::SiteRow`; the snapshot crate
    /// is not core's dependency, so kept as JSON).
    #[serde(default)]
    pub top_holders: Vec<serde_json::Value>,
    /// `torchmem_snapshot::oom::Diagnosis` less its text (JSON, as above).
    #[serde(default)]
    pub diagnosis: serde_json::Value,
    /// The simulator's what-if for the device (`torchmem_sim::whatif`; JSON, as above).
    #[serde(default)]
    pub what_if: Option<serde_json::Value>,
    /// The allocator snapshot written at the failure, or why none was.
    #[serde(default)]
    pub snapshot: Option<String>,
    #[serde(default)]
    pub snapshot_error: Option<String>,
    /// The snapshot recording's setting (`on_oom(recording=…)`).
    #[serde(default)]
    pub recording: serde_json::Value,
    /// When it was written (Unix seconds): the first failure of a job is the earliest.
    #[serde(default)]
    pub unix_s: Option<f64>,
}

/// The `leaks` blob: a process's latest probe report, with its findings so far.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LeakBlob {
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub rank: Option<u32>,
    #[serde(flatten)]
    pub report: LeakReport,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_by_name_and_unknown_ones_stay_as_they_are() {
        let kinds = [
            Blob::Identity(Identity {
                origin: Origin { pid: Some(4), rank: Some(1), local_rank: None, world_size: Some(2) },
                launch: Launch { group_rank: Some(0), restart_count: None },
                t_ns: 9,
            }),
            Blob::GpuProcesses(GpuProcesses {
                devices: vec![GpuIdentity { index: 0, uuid: "GPU-a".into(), name: "H200".into() }],
                processes: vec![GpuProcessPeak { pid: 4, device: 0, peak_bytes: 7, first_t_ns: 1, last_t_ns: 2 }],
            }),
            Blob::Vmhwm(Vmhwm { pids: [(4, 100), (12, 5)].into() }),
            Blob::Outlived(Outlived { t_ns: 3, pids: vec![5, 6] }),
            Blob::Oom(Box::new(OomPostMortem { pid: 4, requested_bytes: Some(1 << 30), ..Default::default() })),
            Blob::Leaks(Box::new(LeakBlob { pid: Some(4), rank: None, report: LeakReport::default() })),
        ];
        for b in kinds {
            let again = Blob::from_parts(b.name().to_string(), b.data());
            assert_eq!(again, b);
        }
        // The names and JSON of the v2 files.
        let hello = serde_json::json!({"pid": 4, "rank": null, "local_rank": null, "world_size": null, "t_ns": 5,
            "restart_count": 1});
        let Blob::Identity(i) = Blob::from_parts("identity".into(), hello.clone()) else { panic!() };
        assert_eq!((i.origin.pid, i.launch.restart_count, i.t_ns), (Some(4), Some(1), 5));
        assert_eq!(Blob::Identity(i).data(), hello);
        let Blob::Vmhwm(v) = Blob::from_parts("vmhwm".into(), serde_json::json!({"pids": {"7": 91}})) else { panic!() };
        assert_eq!(v.pids[&7], 91);
        for (name, data) in [("future_kind", serde_json::json!([1])), ("vmhwm", serde_json::json!({"pids": 3}))] {
            let b = Blob::from_parts(name.into(), data.clone());
            assert_eq!(b, Blob::Other { name: name.into(), data: data.clone() });
            assert_eq!((b.name(), b.data()), (name, data));
        }
    }
}
