//! The tracer's summary: what `torchmem.estimator._runner.summary` writes next to the trace (`summary.json`
//! for `torchmem estimate`, a dict for `torchmem.estimate()`), read into one typed record. Every field has a
//! default, so a summary from an older tracer still reads.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::EstimateError;

/// What the traced program did: trained (optimizer steps seen), only ran forward passes, or ran backward
/// passes without a torch.optim step (a hand-written update).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum EstimateKind {
    #[default]
    #[serde(rename = "training")]
    Training,
    #[serde(rename = "inference")]
    Inference,
    #[serde(rename = "backward without optimizer step")]
    BackwardWithoutOptimizerStep,
}

/// Why the trace stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopReason {
    /// The `--steps` bound (or `torchmem.estimate()`'s `steps` calls).
    #[serde(rename = "steps")]
    Steps,
    /// The `--forward-calls` bound.
    #[serde(rename = "forward calls")]
    ForwardCalls,
    #[serde(rename = "program ended")]
    ProgramEnded,
    /// The program raised; `Summary::error` says what.
    #[serde(rename = "error")]
    Error,
    /// A reason this reader does not know (a newer tracer).
    #[serde(other)]
    Other,
}

/// One of the largest tensors live at the trace's peak.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LargestTensor {
    pub size_bytes: u64,
    /// forward, backward, optimizer, …
    pub phase: Option<String>,
    /// What the tensor is (the op or the parameter).
    pub what: Option<String>,
    /// `file:line (function)` of the first frame outside torch; empty when no frame was kept.
    pub site: Option<String>,
    pub step: Option<i64>,
}

/// The tracer's summary of one traced run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Summary {
    pub kind: Option<EstimateKind>,
    pub steps_traced: Option<u64>,
    pub forward_calls: Option<u64>,
    pub generate_calls: Option<u64>,
    pub backward_calls: Option<u64>,
    pub reason: Option<StopReason>,
    pub error: Option<String>,
    pub notes: Vec<String>,
    pub trace_peak_bytes: Option<u64>,
    /// Peak live bytes per phase (forward, backward, optimizer).
    pub phase_peak_bytes: Option<BTreeMap<String, u64>>,
    pub largest_at_peak: Option<Vec<LargestTensor>>,
    pub uses_half_precision: bool,
    pub uses_convolution: bool,
    /// The tracer's cuDNN workspace catalogue use (calls by match quality, unknown shapes, the catalogue's
    /// header), passed into the report as the tracer wrote it.
    pub convolution_workspaces: serde_json::Value,
    /// Allocation requests in the trace.
    pub requests: Option<u64>,
    pub trace_seconds: Option<f64>,
    pub torch_version: Option<String>,
    pub gpu: Option<String>,
    /// The emulated world of a distributed program (`torchmem.estimator._distributed`); absent from older
    /// tracers (one rank).
    pub distributed: Option<Distributed>,
    /// What the trace does not know exactly, grouped by reason (the report's `uncertainty`).
    pub uncertainty: Vec<Uncertainty>,
    /// The requests behind `uncertainty`, for the upper bound's replay: `[addr, upper_bytes, anchor_addr]`;
    /// addr > 0 widens that request of the trace to upper_bytes, addr 0 adds a request of upper_bytes (freed at
    /// once) right after the allocation at anchor_addr.
    pub uncertain_requests: Vec<[u64; 3]>,
}

/// One reason the estimate is an interval: what is not exactly known, where, and how many bytes it can add at
/// the peak (`bytes`: the most at any one moment; a workspace is live only inside its call).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Uncertainty {
    /// "unrecorded convolution", "cuDNN choice on another GPU", "interpolated convolution workspace", "NCCL
    /// buffers", …
    pub kind: String,
    /// The same in a sentence, with the bound's rule.
    pub what: String,
    /// The operator (`aten.convolution.default`), empty when none.
    pub op: String,
    /// Its shapes (the catalogue key's arguments and the batch).
    pub shapes: String,
    /// `file:line (function)` of the program's line that made it.
    pub site: String,
    /// Calls in the trace.
    pub calls: u64,
    pub bytes: u64,
}

/// The emulated world the tracer ran the program in: `world_size` ranks, `rank` traced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Distributed {
    pub world_size: u64,
    pub rank: u64,
    pub nproc_per_node: u64,
    pub nnodes: u64,
    /// "fake" once the program made a process group, else None.
    pub process_group: Option<String>,
    /// The size of every communicator (process group of more than one rank) the traced rank belongs to.
    pub communicators: Vec<u64>,
    pub ddp_modules: u64,
    pub nccl: NcclModel,
    /// Ranks that behave alike, each traced once.
    pub rank_classes: Vec<RankClassSummary>,
}

impl Default for Distributed {
    fn default() -> Distributed {
        Distributed {
            world_size: 1,
            rank: 0,
            nproc_per_node: 1,
            nnodes: 1,
            process_group: None,
            communicators: vec![],
            ddp_modules: 0,
            nccl: NcclModel::default(),
            rank_classes: vec![],
        }
    }
}

/// NCCL's device memory outside PyTorch's allocator for the traced rank, from NCCL's documented buffer sizes
/// (`_distributed.nccl_model`): a model, unverified until measured, with its range.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NcclModel {
    pub bytes: u64,
    pub low_bytes: u64,
    pub high_bytes: u64,
    pub buffsize_bytes: u64,
    pub channels: u64,
    pub verified: bool,
    pub source: String,
    /// One per communicator the model counts (a group this rank ran collectives on), in first-use order.
    pub communicators: Vec<NcclCommunicator>,
}

/// One NCCL communicator of the model: its group's size, the peers it keeps buffers for, and those bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NcclCommunicator {
    pub ranks: u64,
    pub peers: u64,
    pub channels: u64,
    pub bytes: u64,
}

/// A class of ranks that behave alike: `traced_rank`'s trace stands for all of `ranks`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RankClassSummary {
    pub ranks: Vec<u64>,
    pub traced_rank: u64,
    pub symmetric: bool,
    /// What sets the class apart ("pipeline stage 1 of 4", "2 of 2 uneven split(s) smaller, 1 empty").
    pub what: String,
}

impl Summary {
    /// Reads the summary JSON written with a trace; the error names the file and what to pass instead.
    pub fn read(path: &Path) -> Result<Summary, EstimateError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| EstimateError::Io { path: path.to_path_buf(), source })?;
        serde_json::from_str(&text).map_err(|e| {
            EstimateError::Input(format!(
                "{} is not the summary JSON written with the trace ({e}); pass the file torchmem wrote",
                path.display()
            ))
        })
    }

    /// What the trace covered: "3 optimizer step(s)", or for a program without an optimizer step "12 forward
    /// call(s), 1 generate call(s)".
    pub fn progress(&self) -> String {
        let steps = self.steps_traced.unwrap_or(0);
        if steps > 0 || self.forward_calls.is_none() {
            return format!("{steps} optimizer step(s)");
        }
        let forwards = self.forward_calls.unwrap_or(0);
        let generates = self.generate_calls.unwrap_or(0);
        if generates > 0 {
            format!("{forwards} forward call(s), {generates} generate call(s)")
        } else {
            format!("{forwards} forward call(s)")
        }
    }

    /// "to the --forward-calls bound" or "to its end".
    pub(crate) fn traced_to(&self) -> &'static str {
        if self.reason == Some(StopReason::ForwardCalls) {
            "to the --forward-calls bound"
        } else {
            "to its end"
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tracers_summary_reads_and_says_what_was_traced() {
        let s: Summary = serde_json::from_str(
            r#"{"kind": "inference", "steps_traced": 0, "forward_calls": 0, "generate_calls": 2,
                "reason": "program ended", "notes": ["n"], "largest_at_peak": [{"size_bytes": 5, "phase": "forward",
                "what": "x", "site": "", "step": 0}], "convolution_workspaces": {"calls": {"exact": 0}}}"#,
        )
        .unwrap();
        assert_eq!(s.kind, Some(EstimateKind::Inference));
        assert_eq!(s.reason, Some(StopReason::ProgramEnded));
        assert_eq!(s.progress(), "0 forward call(s), 2 generate call(s)");
        let training: Summary =
            serde_json::from_str(r#"{"kind": "training", "steps_traced": 3, "forward_calls": 3}"#).unwrap();
        assert_eq!(training.progress(), "3 optimizer step(s)");
        let world: Summary = serde_json::from_str(
            r#"{"distributed": {"world_size": 16, "rank": 3, "communicators": [16, 8],
                "nccl": {"bytes": 100, "low_bytes": 50, "high_bytes": 200, "verified": false, "communicators": []},
                "rank_classes": [{"ranks": [0, 1], "traced_rank": 0, "symmetric": true}]}}"#,
        )
        .unwrap();
        let d = world.distributed.unwrap();
        assert_eq!((d.world_size, d.rank, d.nccl.bytes, d.rank_classes[0].ranks.len()), (16, 3, 100, 2));
        assert_eq!(Distributed::default().world_size, 1);
        let odd: Summary = serde_json::from_str(r#"{"reason": "a newer reason"}"#).unwrap();
        assert_eq!(odd.reason, Some(StopReason::Other));
        assert_eq!(Summary::default().progress(), "0 optimizer step(s)");
    }
}
