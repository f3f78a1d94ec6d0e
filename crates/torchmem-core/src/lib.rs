//! torchmem-core: everything torchmem does that needs no Python.
//!
//! Data flows one way through the modules:
//! `sources` (read /proc and NVML) → `model` (the narrow record types) → `store` (the SQLite profile
//! file) → `analysis` (peaks, phases, epochs, leaks, journey) → `report` (text, JSON, CSV, Markdown,
//! Mermaid, HTML). `wire` is the message format the profiled Python process sends to the recorder.

pub mod analysis;
pub mod clock;
pub mod error;
pub mod inprocess;
pub mod journey;
pub mod lines;
pub mod model;
pub mod report;
pub mod sources;
pub mod store;
pub mod units;
pub mod wire;

pub use error::{CoreError, Result};
