//! torchmem-sim: a byte-exact model of PyTorch's CUDA caching allocator (torch 2.11 rules) that replays
//! an allocator snapshot's trace and answers what-if questions (other settings, a memory cap, a smaller
//! device). No PyO3.
//!
//! One file per concern: `config` (allocator settings: parsing and the snapshot's), `rounding` (sizes),
//! `pool` (blocks and pools), `allocator` (the state machine), `expandable` (expandable segments' pages),
//! `device` (capacity and addresses), `start` (the state at a trace's start), `replay` (the driver and
//! the check against the recording), `search` (`--min-memory`, `--compare`), `render` (text and JSON),
//! `whatif` (the what-if panel of the snapshot page and of on_oom's report).

pub mod allocator;
pub mod config;
pub mod device;
pub mod expandable;
pub mod pool;
pub mod render;
pub mod replay;
pub mod rounding;
pub mod search;
pub mod start;
pub mod whatif;

use std::path::Path;

use serde::Serialize;
use torchmem_snapshot::Snapshot;

pub use config::{AllocConf, ConfError};
pub use replay::{DeviceResult, Prepared, SimOptions};

/// The allocator rules the model implements.
pub const RULES: &str = "torch 2.11";

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Snapshot(#[from] torchmem_snapshot::SnapshotError),
    #[error(transparent)]
    Conf(#[from] ConfError),
    #[error("{0}")]
    Other(String),
}

/// A device the simulator refused, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Refused {
    pub device: i64,
    pub reason: String,
}

/// The result for a whole snapshot.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimResult {
    pub file: String,
    pub rules: &'static str,
    /// Set when the snapshot looks older than torch 2.9 (its settings lack 2.9+ keys).
    pub version_note: Option<String>,
    pub devices: Vec<DeviceResult>,
    pub refused: Vec<Refused>,
}

/// Reads a snapshot file: pickle or JSON, optionally gzip-compressed (the snapshot crate's one reader).
pub fn read_snapshot(path: &Path) -> Result<Snapshot, SimError> {
    Ok(torchmem_snapshot::read_path(path)?)
}

/// The same for bytes.
pub fn read_snapshot_bytes(data: &[u8], name: &str) -> Result<Snapshot, SimError> {
    Ok(torchmem_snapshot::read_bytes(data, name)?)
}

/// A note when the snapshot's settings lack keys every torch ≥ 2.9 writes.
pub fn version_note(snap: &Snapshot) -> Option<String> {
    let s = &snap.allocator_settings;
    if s.is_empty() {
        return Some(format!(
            "the snapshot has no allocator_settings (torch older than 2.1?): the recorded settings are taken as the \
             defaults and {RULES} rules are used"
        ));
    }
    if !s.contains_key("graph_capture_record_stream_reuse") {
        return Some(format!(
            "the snapshot comes from a torch older than 2.9 (no graph_capture_record_stream_reuse in its settings); \
             {RULES} rules are used, which differ from older versions in expandable segments' garbage collection \
             and the oversize rounding slack"
        ));
    }
    None
}

/// Simulates every device of a snapshot.
pub fn simulate(snap: &Snapshot, name: &str, opts: &SimOptions) -> SimResult {
    let mut devices = Vec::new();
    let mut refused = Vec::new();
    for d in replay::devices(snap) {
        match Prepared::new(snap, d) {
            Ok(p) => devices.push(p.run(opts)),
            Err(reason) => refused.push(Refused { device: d, reason }),
        }
    }
    SimResult { file: name.to_string(), rules: RULES, version_note: version_note(snap), devices, refused }
}
