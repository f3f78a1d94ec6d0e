//! torchmem-estimator: the estimate use case, shared by `torchmem estimate` (the CLI) and
//! `torchmem.estimate()` (the Python binding, in-process). No PyO3, no clap.
//!
//! A program runs under the Python tracer (`torchmem.estimator`) on an emulated CUDA device; the tracer
//! writes a storage trace (an allocator snapshot) and a `Summary`. This crate does the rest:
//! - `gpus`: the GPU catalogue and its one alias rule (`gpus::find`), and `Target` (a GPU and the memory CUDA
//!   can use on it);
//! - `report`: `estimate_trace` replays the trace through the allocator simulator (`torchmem_sim`) on the
//!   target, adds the CUDA context NVML counts and builds the typed `EstimateReport` (its JSON is
//!   `torchmem estimate --json`), whose `text()` is the text report;
//! - `fit`: the `--fit NAME=LO..HI[:STEP]` spec and the search for the largest value that fits (doubling,
//!   then bisection) over any function that estimates one value;
//! - `summary`: the tracer's summary, typed.
//!
//! Launching the program under the tracer (the sitecustomize, the environment) stays in the CLI.

pub mod fit;
pub mod gpus;
pub mod report;
pub mod summary;

use std::path::PathBuf;

pub use fit::{FitPeaks, FitReport, FitResult, FitSpec, FitTry};
pub use gpus::Gpu;
pub use report::{estimate_trace, merge_rank_classes, EstimateReport, OomAt, RankClass};
pub use summary::{Distributed, EstimateKind, LargestTensor, NcclModel, StopReason, Summary};

/// Why an estimate could not be made. The messages name the problem and the fix.
#[derive(Debug, thiserror::Error)]
pub enum EstimateError {
    #[error("unknown GPU {name:?}. Known: {known} (or give the device memory instead)")]
    UnknownGpu { name: String, known: String },
    /// A bad argument value (alloc conf, fit spec, summary).
    #[error("{0}")]
    Input(String),
    /// The trace could not be read or simulated.
    #[error(transparent)]
    Sim(#[from] torchmem_sim::SimError),
    #[error("cannot read {}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

impl From<torchmem_sim::ConfError> for EstimateError {
    fn from(e: torchmem_sim::ConfError) -> EstimateError {
        EstimateError::Input(e.to_string())
    }
}

/// The device an estimate is for: a catalogue GPU and what CUDA can use on it.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub gpu: Gpu,
    /// What CUDA can use: the GPU's totalGlobalMem, or a device memory given instead.
    pub cuda_total_bytes: u64,
}

impl Target {
    /// The GPU named `gpu` (looked up by `gpus::find`), with `device_memory_bytes` instead of its memory when
    /// given (a card not in the catalogue).
    pub fn new(gpu: &str, device_memory_bytes: Option<u64>) -> Result<Target, EstimateError> {
        let found = gpus::find(gpu)
            .ok_or_else(|| EstimateError::UnknownGpu { name: gpu.to_string(), known: gpus::keys().join(", ") })?;
        let cuda_total_bytes = device_memory_bytes.unwrap_or(found.cuda_total_bytes);
        Ok(Target { gpu: found, cuda_total_bytes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_is_a_catalogue_gpu_with_its_memory_or_the_one_given() {
        let t = Target::new("a100_40gb", None).unwrap();
        assert_eq!(t.gpu.key, "A100-40GB");
        assert_eq!(t.cuda_total_bytes, t.gpu.cuda_total_bytes);
        assert_eq!(Target::new("L4", Some(24 << 30)).unwrap().cuda_total_bytes, 24 << 30);
        let e = Target::new("TPUv5", None).unwrap_err().to_string();
        assert!(e.contains("unknown GPU \"TPUv5\"") && e.contains("H200"), "{e}");
    }
}
