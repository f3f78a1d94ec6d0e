//! The estimate report: `estimate_trace` replays a tracer's trace on a `Target` through the allocator
//! simulator and builds the typed `EstimateReport`; its serde form is `torchmem estimate --json` (and the
//! dict `torchmem.estimate()` returns), `EstimateReport::text` the text report both print.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use torchmem_sim::{AllocConf, SimOptions};
use torchmem_snapshot::model::{Action, TraceEntry, NO_STACK};
use torchmem_units::format_bytes;

use crate::summary::{Distributed, EstimateKind, LargestTensor, NcclModel, Summary, Uncertainty};
use crate::{EstimateError, Target};

/// The uncertainty kind of NCCL's modelled buffers (its `calls` count communicators).
const NCCL_KIND: &str = "NCCL buffers";

/// Where the simulated allocator ran out of memory: the trace entry and its frames.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OomAt {
    pub entry: u32,
    pub frames: Vec<String>,
}

/// A class of ranks that behave alike (issue 24): one trace stands for all of `ranks`; the numbers are its
/// prediction, the same keys as the report's top level. `torchmem estimate --json`'s `ranks` lists them worst
/// first (`merge_rank_classes`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RankClass {
    pub ranks: Vec<u64>,
    /// The rank whose program was traced for this class.
    pub traced_rank: u64,
    /// What sets the class apart ("pipeline stage 1 of 4", "2 of 2 uneven split(s) smaller, 1 empty"); empty
    /// when every rank is alike.
    pub what: String,
    /// Whether `traced_rank` was traced (false: a report of one trace lists the other classes it found with the
    /// traced rank's numbers; `torchmem estimate` traces each class and merges them).
    pub traced: bool,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub peak_requested_bytes: u64,
    pub nvml_bytes: u64,
    pub nccl_bytes: u64,
    pub fits: bool,
    pub fits_point: bool,
    pub margin_bytes: i64,
    pub peak_allocated_upper_bytes: u64,
    pub peak_reserved_upper_bytes: u64,
    pub nvml_upper_bytes: u64,
    pub margin_upper_bytes: i64,
    pub num_alloc_retries: u64,
    pub oom: Option<OomAt>,
}

/// The prediction for one traced program on one target. Bytes throughout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EstimateReport {
    /// The device name torch reports (`NVIDIA H200`).
    pub gpu: String,
    /// The catalogue key (`H200`).
    pub gpu_key: String,
    /// What CUDA can use on the target.
    pub device_memory_bytes: u64,
    /// The total nvidia-smi shows for the GPU.
    pub nvml_total_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub peak_requested_bytes: u64,
    /// The CUDA context and libraries NVML counts beyond torch's reserved memory.
    pub context_bytes: u64,
    /// Whether `context_bytes` was measured on this GPU (else the H200's is assumed).
    pub context_measured: bool,
    /// What nvidia-smi would show for the process: peak reserved + context + NCCL's buffers (the model).
    pub nvml_bytes: u64,
    /// Whether the upper bound fits (no OOM with every uncertain request at its upper size, and
    /// `nvml_upper_bytes` within the device). `fits_point` is the point estimate's answer.
    pub fits: bool,
    /// Device memory − `nvml_bytes` (the point estimate's; negative: over).
    pub margin_bytes: i64,
    /// The interval's upper ends: the trace replayed a second time with each request whose size is not
    /// exactly known at its upper size (`uncertainty`), NCCL at its range's top. Equal to the point
    /// estimates when nothing is uncertain.
    #[serde(default)]
    pub peak_allocated_upper_bytes: u64,
    #[serde(default)]
    pub peak_reserved_upper_bytes: u64,
    #[serde(default)]
    pub nvml_upper_bytes: u64,
    /// Device memory − `nvml_upper_bytes`.
    #[serde(default)]
    pub margin_upper_bytes: i64,
    /// Whether the point estimate fits.
    #[serde(default)]
    pub fits_point: bool,
    /// Why the upper bound is above the point, largest first (empty: upper = point).
    #[serde(default)]
    pub uncertainty: Vec<Uncertainty>,
    /// Times the simulated allocator freed its cache and retried.
    pub num_alloc_retries: u64,
    pub oom: Option<OomAt>,
    pub kind: EstimateKind,
    pub steps_traced: Option<u64>,
    pub forward_calls: Option<u64>,
    pub generate_calls: Option<u64>,
    /// What the trace covered, in words ("3 optimizer step(s)").
    pub traced: String,
    pub phase_peak_bytes: Option<BTreeMap<String, u64>>,
    pub largest_at_peak: Option<Vec<LargestTensor>>,
    pub trace_seconds: Option<f64>,
    pub requests: Option<u64>,
    pub convolution_workspaces: serde_json::Value,
    /// The PYTORCH_CUDA_ALLOC_CONF simulated ("" for the trace's own).
    pub alloc_conf: String,
    pub simulator_rules: String,
    pub notes: Vec<String>,
    /// The emulated world: its size (1 for a one-GPU program) and the traced rank.
    #[serde(default = "one")]
    pub world_size: u64,
    #[serde(default)]
    pub rank: u64,
    /// NCCL's buffers outside the allocator (the documented model; 0 without a communicator of 2+ ranks): a
    /// named part of `nvml_bytes`, unverified until measured.
    #[serde(default)]
    pub nccl_bytes: u64,
    #[serde(default)]
    pub nccl: Option<NcclModel>,
    /// Every class of ranks, worst first; the top-level numbers are the worst class's.
    #[serde(default)]
    pub ranks: Vec<RankClass>,
}

fn one() -> u64 {
    1
}

/// Replays `trace` (the tracer's allocator snapshot) on `target`, under `alloc_conf` when given (else the
/// settings the trace recorded), and builds the report from it and the tracer's `summary`.
pub fn estimate_trace(
    trace: &Path,
    summary: &Summary,
    target: &Target,
    alloc_conf: Option<&str>,
) -> Result<EstimateReport, EstimateError> {
    let alloc_conf = alloc_conf.filter(|c| !c.is_empty());
    let conf = alloc_conf.map(AllocConf::parse).transpose()?;
    let mut snap = torchmem_sim::read_snapshot(trace)?;
    let (ctx, measured) = target.gpu.context_or_assumed();
    let context_bytes = ctx.for_run(summary.uses_half_precision, summary.uses_convolution);
    let usable = target.cuda_total_bytes.saturating_sub(context_bytes);
    let opts = SimOptions {
        conf,
        device_memory_bytes: Some(usable),
        device_total_bytes: Some(target.cuda_total_bytes),
        detailed: true,
        frees_at_request: true,
        driver_addresses: true,
        ..SimOptions::default()
    };
    let result = torchmem_sim::simulate(&snap, &trace.display().to_string(), &opts);
    let d = result
        .devices
        .first()
        .ok_or_else(|| EstimateError::Input(format!("the trace {} has no device to simulate", trace.display())))?;
    let world = summary.distributed.clone().unwrap_or_default();
    let nccl_bytes = world.nccl.bytes;
    let nvml_bytes = d.peak_reserved_bytes + context_bytes + nccl_bytes;
    let fits_point = d.oom.is_none() && nvml_bytes <= target.cuda_total_bytes;
    let margin_bytes = target.cuda_total_bytes as i64 - nvml_bytes as i64;
    // The upper bound: a second replay with every uncertain request at its upper size (the extra bytes can
    // change the allocator's segments, so they are simulated, not added), NCCL at its range's top.
    let (mut allocated_upper, mut reserved_upper, mut oom_upper) =
        (d.peak_allocated_bytes, d.peak_reserved_bytes, false);
    if !summary.uncertain_requests.is_empty() {
        for entries in snap.device_traces.iter_mut() {
            *entries = widen_trace(entries, &summary.uncertain_requests);
        }
        let name = trace.display().to_string();
        let mut upper = torchmem_sim::simulate(&snap, &name, &opts);
        oom_upper = upper.devices.first().is_some_and(|u| u.oom.is_some() || u.num_ooms > 0);
        if oom_upper {
            // Out of memory at the upper bound: what it would need, on a device without that limit.
            let unlimited = SimOptions { device_memory_bytes: Some(UNLIMITED_BYTES), ..opts.clone() };
            upper = torchmem_sim::simulate(&snap, &name, &unlimited);
        }
        if let Some(u) = upper.devices.first() {
            allocated_upper = allocated_upper.max(u.peak_allocated_bytes);
            reserved_upper = reserved_upper.max(u.peak_reserved_bytes);
        }
    }
    let mut uncertainty = summary.uncertainty.clone();
    let nccl_upper = if nccl_bytes > 0 { world.nccl.high_bytes.max(nccl_bytes) } else { 0 };
    if nccl_upper > nccl_bytes {
        uncertainty.push(Uncertainty {
            kind: NCCL_KIND.into(),
            what: format!(
                "NCCL's buffers are a model from NCCL's documented sizes, not measured: {} to {} (the top of the \
                 stated range is the upper bound)",
                format_bytes(world.nccl.low_bytes),
                format_bytes(world.nccl.high_bytes)
            ),
            calls: world.communicators.len() as u64,
            bytes: nccl_upper - nccl_bytes,
            ..Uncertainty::default()
        });
    }
    let nvml_upper_bytes = reserved_upper + context_bytes + nccl_upper;
    let fits = fits_point && !oom_upper && nvml_upper_bytes <= target.cuda_total_bytes;
    let margin_upper_bytes = target.cuda_total_bytes as i64 - nvml_upper_bytes as i64;
    let kind = summary.kind.unwrap_or_default();
    let mut notes = summary.notes.clone();
    match kind {
        EstimateKind::Inference => notes.insert(
            0,
            format!(
                "inference estimate: no optimizer step was seen (no backward either); the program was traced {} \
                 ({})",
                summary.traced_to(),
                summary.progress()
            ),
        ),
        EstimateKind::BackwardWithoutOptimizerStep => notes.insert(
            0,
            format!(
                "no torch.optim optimizer step was seen, but {} backward pass(es) ran (a hand-written update?): \
                 the program was traced {} ({})",
                summary.backward_calls.unwrap_or(0),
                summary.traced_to(),
                summary.progress()
            ),
        ),
        EstimateKind::Training => {}
    }
    if !measured {
        notes.push(format!(
            "the CUDA context overhead of {} is not measured; the H200's ({}) is used",
            target.gpu.key,
            format_bytes(context_bytes)
        ));
    }
    notes.push(
        "other CUDA kernels' small temporary buffers (reductions other than sum/mean, sort buffers: tens of KiB) \
         are not modelled, in the point or the upper bound (transient: reserved may be slightly low; see \
         docs/estimator.md)"
            .to_string(),
    );
    if nccl_bytes > 0 {
        notes.push(format!(
            "NCCL's buffers ({}, {} communicator(s): the groups this rank ran collectives on) are a model from \
             NCCL's documented sizes (NCCL_BUFFSIZE {} x {} channels x peers), not measured: the real figure may \
             be {} to {} (docs/estimator.md §7)",
            format_bytes(nccl_bytes),
            world.communicators.len(),
            format_bytes(world.nccl.buffsize_bytes),
            world.nccl.channels,
            format_bytes(world.nccl.low_bytes),
            format_bytes(world.nccl.high_bytes)
        ));
    }
    let mut report = EstimateReport {
        gpu: target.gpu.name.to_string(),
        gpu_key: target.gpu.key.to_string(),
        device_memory_bytes: target.cuda_total_bytes,
        nvml_total_bytes: target.gpu.nvml_total_bytes,
        peak_allocated_bytes: d.peak_allocated_bytes,
        peak_reserved_bytes: d.peak_reserved_bytes,
        peak_requested_bytes: d.peak_requested_bytes,
        context_bytes,
        context_measured: measured,
        nvml_bytes,
        fits,
        margin_bytes,
        peak_allocated_upper_bytes: allocated_upper,
        peak_reserved_upper_bytes: reserved_upper,
        nvml_upper_bytes,
        margin_upper_bytes,
        fits_point,
        uncertainty,
        num_alloc_retries: d.num_alloc_retries,
        oom: d.oom.as_ref().map(|o| OomAt { entry: o.entry, frames: o.frames.clone() }),
        kind,
        steps_traced: summary.steps_traced,
        forward_calls: summary.forward_calls,
        generate_calls: summary.generate_calls,
        traced: summary.progress(),
        phase_peak_bytes: summary.phase_peak_bytes.clone(),
        largest_at_peak: summary.largest_at_peak.clone(),
        trace_seconds: summary.trace_seconds,
        requests: summary.requests,
        convolution_workspaces: summary.convolution_workspaces.clone(),
        alloc_conf: alloc_conf.unwrap_or("").to_string(),
        simulator_rules: result.rules.to_string(),
        notes,
        world_size: world.world_size.max(1),
        rank: world.rank,
        nccl_bytes,
        nccl: summary.distributed.as_ref().map(|w| w.nccl.clone()),
        ranks: vec![],
    };
    report.ranks = rank_classes(&world, &report);
    Ok(report)
}

/// The report of a world whose rank classes were each traced (issue 24): `first` (the trace that found the
/// classes) and `others`, one report per other class, traced as that class's rank. Each class takes the numbers
/// of the report that traced its rank; the classes are ordered worst first (not fitting, then not fitting at the
/// point estimate, then the largest NVML upper bound, then the largest NVML point); the top-level keys are the
/// worst class's report's, with `fits` / `fits_point` true only when every class fits.
pub fn merge_rank_classes(first: EstimateReport, others: Vec<EstimateReport>) -> EstimateReport {
    let mut all = vec![first];
    all.extend(others);
    let mut classes: Vec<RankClass> = all[0]
        .ranks
        .iter()
        .map(|c| match all.iter().find(|r| r.rank == c.traced_rank) {
            Some(r) => r.class(c.ranks.clone(), c.traced_rank, c.what.clone(), true),
            None => c.clone(),
        })
        .collect();
    classes.sort_by_key(|c| {
        (c.fits, c.fits_point, std::cmp::Reverse(c.nvml_upper_bytes), std::cmp::Reverse(c.nvml_bytes), c.traced_rank)
    });
    let worst = classes.first().map(|c| c.traced_rank).unwrap_or(all[0].rank);
    let i = all.iter().position(|r| r.rank == worst).unwrap_or(0);
    let mut top = all.swap_remove(i);
    if classes.len() > 1 {
        let traced = classes.iter().filter(|c| c.traced).count();
        top.notes.insert(
            0,
            format!(
                "{} classes of ranks ({traced} traced, one rank each, and simulated apart): the numbers above are                  the worst class's, rank {} ({}); `ranks` lists every class",
                classes.len(),
                worst,
                classes[0].what
            ),
        );
        top.fits = classes.iter().all(|c| c.fits);
        top.fits_point = classes.iter().all(|c| c.fits_point);
    }
    top.ranks = classes;
    top
}

/// The device memory of the upper bound's replay when it runs out at the target's: 1 PiB, no limit.
const UNLIMITED_BYTES: u64 = 1 << 50;

/// Base of the addresses of the requests the upper bound adds (below the tracer's, which start at
/// 0x7f00_0000_0000 and grow): no collision with a traced request.
const ADDED_ADDR_BASE: u64 = 0x7e00_0000_0000;

/// The upper bound's trace: `entries` with each uncertain request (`Summary::uncertain_requests`) at its upper
/// size. `[addr, upper, _]` with addr > 0 widens that request (its alloc and its frees); `[0, upper, anchor]`
/// adds a request of `upper` bytes, freed at once, right after the allocation at `anchor` (a workspace the
/// point trace lacks, live only inside its call).
pub fn widen_trace(entries: &[TraceEntry], requests: &[[u64; 3]]) -> Vec<TraceEntry> {
    let mut widen: BTreeMap<u64, u64> = BTreeMap::new();
    let mut added: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for &[addr, upper, anchor] in requests {
        if addr > 0 {
            let w = widen.entry(addr).or_insert(upper);
            *w = (*w).max(upper);
        } else if anchor > 0 {
            added.entry(anchor).or_default().push(upper);
        }
    }
    let mut next_addr = ADDED_ADDR_BASE;
    let mut out = Vec::with_capacity(entries.len() + 3 * requests.len());
    for e in entries {
        let action = e.action();
        let is_request = matches!(action, Action::Alloc | Action::FreeRequested | Action::FreeCompleted);
        match widen.get(&e.addr) {
            Some(&upper) if is_request && upper > e.size_bytes => {
                out.push(TraceEntry::new(action, e.addr, upper, e.time_us, e.stack, e.info()))
            }
            _ => out.push(*e),
        }
        if action != Action::Alloc {
            continue;
        }
        for &upper in added.get(&e.addr).map(Vec::as_slice).unwrap_or(&[]) {
            for a in [Action::Alloc, Action::FreeRequested, Action::FreeCompleted] {
                out.push(TraceEntry::new(a, next_addr, upper, e.time_us, NO_STACK, e.info()));
            }
            next_addr += 1 << 12;
        }
    }
    out
}

/// The rank classes of one trace: each class the tracer named (one for symmetric FSDP2 / DDP / TP; one per
/// pipeline stage or uneven shard pattern) with the trace's numbers, `traced` only for the traced rank's class;
/// without a world, rank 0 alone.
fn rank_classes(world: &Distributed, report: &EstimateReport) -> Vec<RankClass> {
    if world.rank_classes.is_empty() {
        return vec![report.class((0..world.world_size.max(1)).collect(), world.rank, String::new(), true)];
    }
    world
        .rank_classes
        .iter()
        .map(|c| {
            let what = if world.rank_classes.len() > 1 { c.what.clone() } else { String::new() };
            report.class(c.ranks.clone(), c.traced_rank, what, c.ranks.contains(&world.rank))
        })
        .collect()
}

/// "0-1023" for a contiguous list of ranks, else the ranks joined by commas (the first 16, then "…").
fn rank_list(ranks: &[u64]) -> String {
    match (ranks.first(), ranks.last()) {
        (Some(a), Some(b)) if ranks.len() > 2 && b - a + 1 == ranks.len() as u64 => format!("{a}-{b}"),
        _ => {
            let mut parts: Vec<String> = ranks.iter().take(16).map(u64::to_string).collect();
            if ranks.len() > 16 {
                parts.push("…".into());
            }
            parts.join(",")
        }
    }
}

impl EstimateReport {
    /// This report's numbers as the class of `ranks`.
    pub fn class(&self, ranks: Vec<u64>, traced_rank: u64, what: String, traced: bool) -> RankClass {
        RankClass {
            ranks,
            traced_rank,
            what,
            traced,
            peak_allocated_bytes: self.peak_allocated_bytes,
            peak_reserved_bytes: self.peak_reserved_bytes,
            peak_requested_bytes: self.peak_requested_bytes,
            nvml_bytes: self.nvml_bytes,
            nccl_bytes: self.nccl_bytes,
            fits: self.fits,
            fits_point: self.fits_point,
            margin_bytes: self.margin_bytes,
            peak_allocated_upper_bytes: self.peak_allocated_upper_bytes,
            peak_reserved_upper_bytes: self.peak_reserved_upper_bytes,
            nvml_upper_bytes: self.nvml_upper_bytes,
            margin_upper_bytes: self.margin_upper_bytes,
            num_alloc_retries: self.num_alloc_retries,
            oom: self.oom.clone(),
        }
    }

    /// The exit status of `torchmem estimate`: 0 when it fits, 1 when it does not.
    pub fn exit_code(&self) -> i32 {
        if self.fits {
            0
        } else {
            1
        }
    }

    /// The text report (`torchmem estimate` without `--json`, `str(torchmem.estimate(...))`).
    pub fn text(&self) -> String {
        let mut s = String::new();
        let total = self.device_memory_bytes;
        let kind = match self.kind {
            EstimateKind::Inference => "inference (no optimizer step), ",
            EstimateKind::BackwardWithoutOptimizerStep => "no optimizer step, ",
            EstimateKind::Training => "",
        };
        let requests = self.requests.map(|r| r.to_string()).unwrap_or_else(|| "null".into());
        s += &format!(
            "torchmem estimate: {} ({} usable by CUDA), {kind}{} traced in {:.1} s, {requests} requests\n",
            self.gpu,
            format_bytes(self.device_memory_bytes),
            self.traced,
            self.trace_seconds.unwrap_or(0.0),
        );
        let upper = |point: u64, upper: u64| {
            if upper > point {
                format!(" .. {} (upper bound)", format_bytes(upper))
            } else {
                String::new()
            }
        };
        s += &format!(
            "  peak allocated   {:>12}{}\n",
            format_bytes(self.peak_allocated_bytes),
            upper(self.peak_allocated_bytes, self.peak_allocated_upper_bytes)
        );
        s += &format!(
            "  peak reserved    {:>12}{}   (caching allocator simulated, {})\n",
            format_bytes(self.peak_reserved_bytes),
            upper(self.peak_reserved_bytes, self.peak_reserved_upper_bytes),
            self.simulator_rules
        );
        let nccl = if self.nccl_bytes > 0 {
            // Its own named part, with its range (the model is unverified until measured: issue 24).
            let range = match &self.nccl {
                Some(m) if m.high_bytes > m.low_bytes => {
                    format!(" ({} to {})", format_bytes(m.low_bytes), format_bytes(m.high_bytes))
                }
                _ => String::new(),
            };
            format!(" + {} NCCL buffers, modelled{range}", format_bytes(self.nccl_bytes))
        } else {
            String::new()
        };
        s += &format!(
            "  process (NVML)   {:>12}{}   (reserved + {} CUDA context and libraries{}{nccl})\n",
            format_bytes(self.nvml_bytes),
            upper(self.nvml_bytes, self.nvml_upper_bytes),
            format_bytes(self.context_bytes),
            if self.context_measured { ", measured" } else { ", assumed" }
        );
        if self.world_size > 1 {
            if self.ranks.iter().any(|c| !c.traced) {
                s += &format!(
                    "  ranks: a world of {}, {} classes, only rank {} traced\n",
                    self.world_size,
                    self.ranks.len(),
                    self.rank
                );
            } else if self.ranks.len() > 1 {
                s += &format!(
                    "  ranks: a world of {}, {} classes, worst first (the numbers above: rank {})\n",
                    self.world_size,
                    self.ranks.len(),
                    self.rank
                );
            } else {
                s += &format!("  ranks: a world of {}, rank {} traced\n", self.world_size, self.rank);
            }
            for c in &self.ranks {
                let what = if c.what.is_empty() { String::new() } else { format!(" [{}]", c.what) };
                let untraced = if c.traced { "" } else { " (not traced: the traced rank's numbers)" };
                s += &format!(
                    "    ranks {:<12} (as rank {}): peak allocated {}, reserved {}, NVML {}, fits: {}{what}{untraced}\n",
                    rank_list(&c.ranks),
                    c.traced_rank,
                    format_bytes(c.peak_allocated_bytes),
                    format_bytes(c.peak_reserved_bytes),
                    format_bytes(c.nvml_bytes),
                    if c.fits { "yes" } else { "NO" }
                );
            }
        }
        let widened = self.nvml_upper_bytes > self.nvml_bytes;
        let margin = if widened { self.margin_upper_bytes } else { self.margin_bytes };
        if self.fits {
            let pct = if total > 0 { 100.0 * margin as f64 / total as f64 } else { 0.0 };
            if widened {
                s += &format!(
                    "  fits: yes (upper bound {} of {}), {} to spare at the upper bound ({pct:.0} % of the device)\n",
                    format_bytes(self.nvml_upper_bytes),
                    format_bytes(total),
                    format_bytes(margin as u64)
                );
            } else {
                s += &format!("  fits: yes, {} to spare ({pct:.0} % of the device)\n", format_bytes(margin as u64));
            }
            let retries = self.num_alloc_retries;
            if retries > 0 {
                s += &format!(
                    "  warning: it fits only by flushing: the caching allocator ran out of memory {retries} \
                     time(s), freed its cache and retried (num_alloc_retries {retries}). Each retry synchronizes \
                     the GPU and slows the step; a little more memory (a larger batch, another GPU) will not fit\n"
                );
            }
        } else if self.fits_point {
            s += &format!(
                "  fits: may not fit: the point estimate {} fits, the upper bound {} does not (of {})\n",
                format_bytes(self.nvml_bytes),
                format_bytes(self.nvml_upper_bytes),
                format_bytes(total)
            );
        } else if self.oom.is_some() {
            s += &format!(
                "  fits: NO, the allocator runs out of memory ({} short at the peak)\n",
                format_bytes(self.margin_bytes.unsigned_abs())
            );
        } else if widened {
            s += &format!(
                "  fits: NO, {} over ({} over at the upper bound)\n",
                format_bytes(self.margin_bytes.unsigned_abs()),
                format_bytes(self.margin_upper_bytes.unsigned_abs())
            );
        } else {
            s += &format!("  fits: NO, {} over\n", format_bytes(self.margin_bytes.unsigned_abs()));
        }
        if let Some(ph) = &self.phase_peak_bytes {
            let parts: Vec<String> = ["forward", "backward", "optimizer"]
                .iter()
                .filter_map(|k| ph.get(*k).map(|v| format!("{k} {}", format_bytes(*v))))
                .collect();
            if !parts.is_empty() {
                s += &format!("  peak per phase (live tensors): {}\n", parts.join(", "));
            }
        }
        if let Some(top) = self.largest_at_peak.as_ref().filter(|t| !t.is_empty()) {
            s += "  largest tensors live at the peak:\n";
            for t in top.iter().take(8) {
                let site = t
                    .site
                    .as_deref()
                    .filter(|x| !x.is_empty())
                    .unwrap_or("(no frame: kept for requests of 1 MiB or more)");
                s += &format!(
                    "    {:>10}  {:<9} {:<40} {}\n",
                    format_bytes(t.size_bytes),
                    t.phase.as_deref().unwrap_or(""),
                    t.what.as_deref().unwrap_or(""),
                    site
                );
            }
        }
        s += &self.uncertainty_text();
        for n in &self.notes {
            s += &format!("  note: {n}\n");
        }
        s
    }

    /// The interval's lines: what widens it, largest first, or that nothing does.
    fn uncertainty_text(&self) -> String {
        if self.uncertainty.is_empty() {
            return "  interval: none, nothing in this estimate is uncertain (upper bound = point estimate)\n".into();
        }
        let mut s = format!(
            "  uncertain (the upper bound: reserved +{}, NVML +{}; each part at most, at any one moment):\n",
            format_bytes(self.peak_reserved_upper_bytes.saturating_sub(self.peak_reserved_bytes)),
            format_bytes(self.nvml_upper_bytes.saturating_sub(self.nvml_bytes))
        );
        const SHOWN: usize = 8;
        for u in self.uncertainty.iter().take(SHOWN) {
            let mut what = u.kind.clone();
            if !u.op.is_empty() {
                what += &format!(": {} {}", u.op, u.shapes);
            }
            if !u.site.is_empty() {
                what += &format!(" at {}", u.site);
            }
            // NCCL's part counts communicators (the groups this rank ran collectives on), the others calls.
            let unit = if u.kind == NCCL_KIND { "communicator(s)" } else { "call(s)" };
            s += &format!("    +{:>10}  {what} ({} {unit})\n", format_bytes(u.bytes), u.calls);
        }
        if self.uncertainty.len() > SHOWN {
            let rest = &self.uncertainty[SHOWN..];
            s += &format!(
                "    and {} more part(s), at most +{} each (--json lists them all)\n",
                rest.len(),
                format_bytes(rest.iter().map(|u| u.bytes).max().unwrap_or(0))
            );
        }
        s
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A report for the text tests: a fake made by hand (no trace behind it).
    pub(crate) fn fake_report() -> EstimateReport {
        EstimateReport {
            gpu: "NVIDIA L4".into(),
            gpu_key: "L4".into(),
            device_memory_bytes: 23_580_639_232,
            nvml_total_bytes: 23_034 << 20,
            peak_allocated_bytes: 20 << 30,
            peak_reserved_bytes: 21 << 30,
            peak_requested_bytes: 20 << 30,
            context_bytes: 1 << 28,
            context_measured: true,
            nvml_bytes: 22 << 30,
            fits: true,
            margin_bytes: 86_900_000,
            peak_allocated_upper_bytes: 20 << 30,
            peak_reserved_upper_bytes: 21 << 30,
            nvml_upper_bytes: 22 << 30,
            margin_upper_bytes: 86_900_000,
            fits_point: true,
            uncertainty: vec![],
            num_alloc_retries: 7,
            oom: None,
            kind: EstimateKind::Training,
            steps_traced: Some(3),
            forward_calls: Some(3),
            generate_calls: Some(0),
            traced: "3 optimizer step(s)".into(),
            phase_peak_bytes: None,
            largest_at_peak: None,
            trace_seconds: Some(1.0),
            requests: Some(10),
            convolution_workspaces: serde_json::Value::Null,
            alloc_conf: String::new(),
            simulator_rules: "torch 2.11".into(),
            notes: vec![],
            world_size: 1,
            rank: 0,
            nccl_bytes: 0,
            nccl: None,
            ranks: vec![],
        }
    }

    const MIB: u64 = 1 << 20;

    /// A trace file (the tracer's JSON snapshot form) of `requests`: (action, addr, bytes).
    fn trace_file(name: &str, requests: &[(&str, u64, u64)]) -> std::path::PathBuf {
        let mut entries = Vec::new();
        for (i, &(action, addr, size)) in requests.iter().enumerate() {
            let e = |a: &str| serde_json::json!({"action": a, "addr": addr, "size": size, "time_us": i});
            if action == "alloc" {
                entries.push(e("alloc"));
            } else {
                entries.push(e("free_requested"));
                entries.push(e("free_completed"));
            }
        }
        let snap = serde_json::json!({"segments": [], "device_traces": [entries], "allocator_settings": {
            "PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
            "expandable_segments": false, "graph_capture_record_stream_reuse": false}});
        let path = std::env::temp_dir().join(format!("torchmem-estimator-{}-{name}.json", std::process::id()));
        std::fs::write(&path, serde_json::to_string(&snap).unwrap()).unwrap();
        path
    }

    /// The interval's logic on a real trace file and the real simulator (the tracer is not involved): a
    /// 100 MiB tensor, a 2 MiB one. Uncertain: a workspace the point trace lacks (50 MiB after the first
    /// allocation, freed at once) and the 2 MiB request at up to 40 MiB. The upper bound is simulated: the
    /// 40 MiB request reuses the freed workspace's 50 MiB block, so reserved goes 120 -> 150 MiB (adding the
    /// extra bytes would say 208). Nothing uncertain: upper = point, said so.
    #[test]
    fn the_upper_bound_is_a_second_simulation_with_the_uncertain_requests_at_their_upper_size() {
        let reqs = [("alloc", 0x1000, 100 * MIB), ("alloc", 0x2000, 2 * MIB), ("free", 0x2000, 2 * MIB)];
        let path = trace_file("interval", &reqs);
        let mut summary = Summary {
            uncertain_requests: vec![[0, 50 * MIB, 0x1000], [0x2000, 40 * MIB, 0]],
            uncertainty: vec![Uncertainty {
                kind: "unrecorded convolution".into(),
                op: "aten.convolution.default".into(),
                site: "train.py:12 (forward)".into(),
                calls: 1,
                bytes: 50 * MIB,
                ..Uncertainty::default()
            }],
            ..Summary::default()
        };
        let big = Target::new("H200", None).unwrap();
        let r = estimate_trace(&path, &summary, &big, None).unwrap();
        assert_eq!((r.peak_allocated_bytes, r.peak_reserved_bytes), (102 * MIB, 120 * MIB));
        assert_eq!((r.peak_allocated_upper_bytes, r.peak_reserved_upper_bytes), (150 * MIB, 150 * MIB));
        assert_eq!(r.nvml_upper_bytes - r.nvml_bytes, 30 * MIB);
        assert!(r.fits && r.fits_point);
        let text = r.text();
        assert!(text.contains("peak reserved       120.0 MiB .. 150.0 MiB (upper bound)"), "{text}");
        assert!(text.contains("unrecorded convolution: aten.convolution.default  at train.py:12 (forward)"), "{text}");
        // A device where the point fits and the upper bound does not: "may not fit", exit 1.
        let tight = Target::new("H200", Some(r.nvml_bytes + 10 * MIB)).unwrap();
        let t = estimate_trace(&path, &summary, &tight, None).unwrap();
        assert!(t.fits_point && !t.fits && t.exit_code() == 1);
        // Out of memory at the upper bound: its peak is what it would need, not where it stopped.
        assert_eq!(t.peak_reserved_upper_bytes, 150 * MIB);
        assert!(t.text().contains("fits: may not fit: the point estimate"), "{}", t.text());
        let json = serde_json::to_value(&t).unwrap();
        for key in ["peak_reserved_upper_bytes", "peak_allocated_upper_bytes", "nvml_upper_bytes", "uncertainty"] {
            assert!(json.get(key).is_some(), "{key}");
        }
        assert_eq!(json["uncertainty"][0]["site"], "train.py:12 (forward)");
        // Nothing uncertain: the upper bound is the point estimate.
        summary.uncertain_requests.clear();
        summary.uncertainty.clear();
        let p = estimate_trace(&path, &summary, &tight, None).unwrap();
        assert_eq!((p.peak_reserved_upper_bytes, p.nvml_upper_bytes), (p.peak_reserved_bytes, p.nvml_bytes));
        assert!(p.fits && p.uncertainty.is_empty());
        assert!(p.text().contains("interval: none"), "{}", p.text());
        std::fs::remove_file(&path).unwrap();
    }

    /// NCCL's modelled buffers: the top of their stated range is the upper bound, a reason of its own.
    #[test]
    fn nccl_widens_nvml_by_the_top_of_its_range() {
        let path = trace_file("nccl", &[("alloc", 0x1000, 10 * MIB)]);
        let mut world = Distributed { world_size: 8, communicators: vec![8], ..Distributed::default() };
        world.nccl = NcclModel { bytes: 100 * MIB, low_bytes: 50 * MIB, high_bytes: 200 * MIB, ..NcclModel::default() };
        let summary = Summary { distributed: Some(world), ..Summary::default() };
        let r = estimate_trace(&path, &summary, &Target::new("H100", None).unwrap(), None).unwrap();
        assert_eq!(r.nvml_upper_bytes - r.nvml_bytes, 100 * MIB);
        assert_eq!(r.peak_reserved_upper_bytes, r.peak_reserved_bytes);
        assert_eq!(r.uncertainty.len(), 1);
        assert_eq!((r.uncertainty[0].kind.as_str(), r.uncertainty[0].bytes), ("NCCL buffers", 100 * MIB));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn widening_keeps_the_trace_and_adds_requests_after_their_anchor() {
        let e = |a: Action, addr: u64, size: u64| TraceEntry::new(a, addr, size, 0, NO_STACK, 0);
        let trace = [
            e(Action::Alloc, 0x1000, 8),
            e(Action::Alloc, 0x2000, 16),
            e(Action::FreeRequested, 0x2000, 16),
            e(Action::FreeCompleted, 0x2000, 16),
        ];
        let out = widen_trace(&trace, &[[0x2000, 64, 0], [0, 32, 0x1000], [0x2000, 8, 0]]);
        let got: Vec<(Action, u64, u64)> = out.iter().map(|t| (t.action(), t.addr, t.size_bytes)).collect();
        assert_eq!(
            got,
            vec![
                (Action::Alloc, 0x1000, 8),
                (Action::Alloc, ADDED_ADDR_BASE, 32),
                (Action::FreeRequested, ADDED_ADDR_BASE, 32),
                (Action::FreeCompleted, ADDED_ADDR_BASE, 32),
                (Action::Alloc, 0x2000, 64),
                (Action::FreeRequested, 0x2000, 64),
                (Action::FreeCompleted, 0x2000, 64),
            ]
        );
        assert_eq!(widen_trace(&trace, &[]), trace.to_vec());
    }

    #[test]
    fn a_world_lists_its_rank_classes_and_the_nccl_part() {
        let mut r = fake_report();
        r.world_size = 1024;
        r.nccl_bytes = 640 << 20;
        r.ranks = rank_classes(&Distributed { world_size: 1024, ..Distributed::default() }, &r);
        assert_eq!(r.ranks.len(), 1);
        assert_eq!(r.ranks[0].ranks.len(), 1024);
        let text = r.text();
        assert!(text.contains("+ 640.0 MiB NCCL buffers, modelled"), "{text}");
        r.nccl =
            Some(NcclModel { bytes: 640 << 20, low_bytes: 320 << 20, high_bytes: 1280 << 20, ..NcclModel::default() });
        assert!(r.text().contains("+ 640.0 MiB NCCL buffers, modelled (320.0 MiB to 1.25 GiB))"), "{}", r.text());
        assert!(text.contains("ranks: a world of 1024, rank 0 traced"), "{text}");
        assert!(text.contains("ranks 0-1023"), "{text}");
        assert_eq!(rank_list(&[0, 4, 8]), "0,4,8");
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["ranks"][0]["ranks"].as_array().unwrap().len(), 1024);
        assert_eq!(json["nccl_bytes"], 640 << 20);
    }

    #[test]
    fn classes_traced_apart_merge_worst_first_and_every_class_must_fit() {
        use crate::summary::RankClassSummary;
        let stage = |r: u64, reserved: u64, fits: bool| {
            let mut rep = fake_report();
            rep.world_size = 4;
            rep.rank = r;
            rep.peak_reserved_bytes = reserved;
            rep.nvml_bytes = reserved + 100;
            rep.nvml_upper_bytes = reserved + 200;
            rep.fits = fits;
            rep.fits_point = fits;
            let world = Distributed {
                world_size: 4,
                rank: r,
                rank_classes: (0..4)
                    .map(|s| RankClassSummary {
                        ranks: vec![s],
                        traced_rank: s,
                        what: format!("stage {s}"),
                        ..Default::default()
                    })
                    .collect(),
                ..Distributed::default()
            };
            rep.ranks = rank_classes(&world, &rep);
            rep
        };
        let first = stage(0, 5 << 30, true);
        assert_eq!(first.ranks.iter().filter(|c| c.traced).count(), 1, "one trace: only its own class is traced");
        assert!(first.text().contains("(not traced: the traced rank's numbers)"), "{}", first.text());
        assert!(first.text().contains("4 classes, only rank 0 traced"), "{}", first.text());
        let merged =
            merge_rank_classes(first, vec![stage(1, 7 << 30, true), stage(2, 9 << 30, false), stage(3, 1 << 30, true)]);
        let order: Vec<u64> = merged.ranks.iter().map(|c| c.traced_rank).collect();
        assert_eq!(order, vec![2, 1, 0, 3], "not fitting first, then the largest NVML");
        assert_eq!((merged.rank, merged.peak_reserved_bytes, merged.fits), (2, 9 << 30, false));
        assert!(merged.ranks.iter().all(|c| c.traced));
        assert_eq!(merged.ranks[1].peak_reserved_bytes, 7 << 30);
        let text = merged.text();
        assert!(text.contains("4 classes, worst first (the numbers above: rank 2)"), "{text}");
        assert!(text.contains("[stage 1]") && merged.notes[0].starts_with("4 classes of ranks (4 traced"), "{text}");
        let json = serde_json::to_value(&merged).unwrap();
        for key in ["peak_allocated_bytes", "peak_reserved_bytes", "nvml_bytes", "fits", "margin_bytes", "oom"] {
            assert!(json["ranks"][3].get(key).is_some(), "{key}");
        }
    }

    #[test]
    fn a_fit_that_needs_alloc_retries_says_it_only_fits_by_flushing() {
        let mut r = fake_report();
        let text = r.text();
        assert!(text.contains("fits: yes, 82.9 MiB to spare"), "{text}");
        assert!(text.contains("warning: it fits only by flushing") && text.contains("7 time(s)"), "{text}");
        r.num_alloc_retries = 0;
        assert!(!r.text().contains("warning"), "no retry, no warning");
        r.fits = false;
        r.fits_point = false;
        r.margin_bytes = -(1 << 30);
        r.nvml_upper_bytes = r.nvml_bytes + (1 << 30);
        r.margin_upper_bytes = -(2 << 30);
        assert!(r.text().contains("fits: NO, 1.00 GiB over"), "{}", r.text());
        assert_eq!(r.exit_code(), 1);
    }

    #[test]
    fn a_program_without_an_optimizer_step_is_reported_as_inference() {
        let mut r = fake_report();
        r.gpu = "NVIDIA H200".into();
        r.device_memory_bytes = 150_109_880_320;
        r.kind = EstimateKind::Inference;
        r.traced = "0 forward call(s), 2 generate call(s)".into();
        r.trace_seconds = Some(2.0);
        let text = r.text();
        assert!(
            text.starts_with(
                "torchmem estimate: NVIDIA H200 (139.80 GiB usable by CUDA), inference (no optimizer step), 0 \
                 forward call(s), 2 generate call(s) traced in 2.0 s, 10 requests"
            ),
            "{text}"
        );
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["kind"], "inference");
        assert_eq!(json["oom"], serde_json::Value::Null);
    }
}
