//! torchmem-core: everything torchmem does that needs no Python.
//!
//! Data flows mostly one way through the modules:
//! `sources` (read /proc and NVML) → `model` (the narrow record types) → `store` (the SQLite profile
//! file) → `analysis` (peaks, phases, epochs, leaks, journey) → `report` (text, JSON, CSV, Markdown,
//! Mermaid, HTML). `record` is what the recorder writes (one enum of typed records: samples, markers, the
//! line profile, the side records `Blob`; its `leaks` kind holds `analysis::leaks`' report). One known back-edge:
//! `sources::allocator` and `wire` share the allocator counters' record. `wire` is the message format the
//! profiled Python process sends to the recorder; `fold` is the keep-or-fold rule that bounds a long run's
//! markers (applied by the recorder and the loader); `breakdown` the what-the-memory-is record (the GPU
//! catalogue lives in torchmem-estimator); `journey` the run's journey; `lines` the line profiler's record.

pub mod analysis;
pub mod breakdown;
pub mod clock;
pub mod error;
pub mod fold;
pub mod journey;
pub mod lines;
pub mod model;
pub mod record;
pub mod report;
pub mod sources;
pub mod store;
pub mod units;
pub mod wire;

pub use error::{CoreError, Result};
