//! "What is the memory?": the facts the reports show from the Monitor's per-category breakdowns
//! (`Marker::breakdown`, see `crate::breakdown`):
//! - per boundary (step start, end of forward, end of backward, end of optimizer step) and device, the mean
//!   and max of every category over all steps (the kept markers plus the folded `BreakdownAggregate` rows,
//!   so a long run's numbers are exact);
//! - the composition at the step peak: parameters / gradients / optimizer state / activations / inputs
//!   from the boundary nearest that phase's peak (`read_at`: the end of forward for forward and backward,
//!   the end of the optimizer step for it) of the peak's own step when that step was measured, else of the
//!   nearest measured step (`Monitor(breakdown_every=...)` measures one step in ten); `other` = peak
//!   allocated − those, `cache` = peak reserved − peak allocated, `non_torch` from the nearest NVML reading
//!   (on the CPU: `other` = peak RSS − those). The composition says which step and boundary it was read at;
//! - parameters and gradients per top-level module, optimizer state per param group, activations by module;
//! - the timeline of the kept boundaries (for the stacked chart).

use std::collections::{BTreeMap, HashMap};

use serde::Serialize;

use super::spans::{spans, Span};
use crate::breakdown::{boundary_of, boundary_rank, BreakdownAggregate, BreakdownKey, Category, DeviceBreakdown};
use crate::model::*;

/// What to do when no marker carries a breakdown (the reports say this instead of showing zeros).
pub const NO_BREAKDOWN_HINT: &str = "no breakdown recorded: wrap the training loop in `torchmem.Monitor(model, optimizer)` (or `torchmem.watch(model, optimizer)`) and mark its steps and phases; their boundaries then carry parameters, gradients, optimizer state, activations and inputs";

/// The mean and highest value of one category at one boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MeanMax {
    pub mean_bytes: u64,
    pub max_bytes: u64,
}

/// One boundary of one process on one device, over every step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BoundaryRow {
    pub pid: Option<u32>,
    pub rank: Option<u32>,
    pub boundary: String,
    pub device: String,
    /// Boundaries counted (kept and folded).
    pub count: u64,
    /// Per category (`parameters`, …, `rss`): only the measured ones.
    pub categories: BTreeMap<Category, MeanMax>,
}

impl BoundaryRow {
    pub fn mean(&self, c: Category) -> Option<u64> {
        self.categories.get(&c).map(|m| m.mean_bytes)
    }
    pub fn max(&self, c: Category) -> Option<u64> {
        self.categories.get(&c).map(|m| m.max_bytes)
    }
}

/// One category's share of the memory at the peak.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompositionRow {
    pub category: Category,
    /// Signed: `other` is a difference and goes negative when the boundary's counts exceed the peak.
    pub bytes: i64,
    /// bytes / total_bytes, in percent.
    pub percent_of_peak: f64,
}

/// What the memory was at the step's peak.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PeakComposition {
    pub pid: Option<u32>,
    pub rank: Option<u32>,
    pub device: String,
    /// `allocator` (a CUDA device: the peak is PyTorch's peak allocated) or `rss` (the CPU: the peak RSS).
    pub basis: &'static str,
    /// The step (its index) and the phase in which the peak occurred.
    pub step: Option<i64>,
    pub phase: String,
    pub phase_start_t_ns: u64,
    /// The boundary whose breakdown gave the named categories (`read_at(phase)`, see `boundary_source`).
    pub boundary: String,
    /// The step that boundary belongs to: `step` when the peak's step was measured, else another one.
    pub boundary_step: Option<i64>,
    pub boundary_t_ns: u64,
    /// Why that boundary: `peak step` (the peak's own step was measured there), `nearest measured step`
    /// (the peak's step was not measured: the same boundary of the measured step nearest in time), or
    /// `last before the phase` (no such boundary was recorded: the last one before the phase began).
    pub boundary_source: &'static str,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
    /// What the rows add up to: peak reserved + non-PyTorch (CUDA), or peak RSS (CPU).
    pub total_bytes: u64,
    pub rows: Vec<CompositionRow>,
    /// Where `non_torch` came from: `nvml` (the nearest NVML reading), `boundary` (the boundary's own
    /// reading) or None (not measured).
    pub non_torch_source: Option<&'static str>,
}

impl PeakComposition {
    pub fn bytes(&self, c: Category) -> Option<i64> {
        self.rows.iter().find(|r| r.category == c).map(|r| r.bytes)
    }
}

/// Parameters and gradients of one top-level module.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModuleRow {
    pub module: String,
    pub parameters_bytes: u64,
    /// None when the boundary held no gradient for it.
    pub gradients_bytes: Option<u64>,
}

/// Optimizer state of one param group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParamGroupRow {
    pub group: usize,
    pub optimizer_state_bytes: u64,
}

/// Activations one module's forward left saved for backward.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModuleActivationRow {
    pub module: String,
    pub activations_bytes: u64,
}

/// One kept boundary on one device, for the timeline.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BoundaryPoint {
    pub t_ns: u64,
    pub pid: Option<u32>,
    pub step: Option<i64>,
    pub boundary: String,
    pub device: String,
    pub categories: BTreeMap<Category, u64>,
}

/// Everything the reports show about what the memory is.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BreakdownSummary {
    /// True when at least one boundary carried a breakdown.
    pub recorded: bool,
    /// What to do to get one, when none was recorded.
    pub hint: Option<String>,
    pub boundaries: Vec<BoundaryRow>,
    pub peak: Option<PeakComposition>,
    /// The device the module and group tables are of (the composition's).
    pub detail_device: Option<String>,
    pub modules: Vec<ModuleRow>,
    pub param_groups: Vec<ParamGroupRow>,
    pub activations_by_module: Vec<ModuleActivationRow>,
    pub timeline: Vec<BoundaryPoint>,
    /// Boundaries folded by the recorder (counted in `boundaries`, absent from the rest, which read the
    /// kept steps only).
    pub folded_boundaries: u64,
}

/// A kept marker that carries a breakdown, with the step open in its process when it was marked.
type Boundary<'a> = (&'a Marker, Option<i64>);

/// Per process (pid, rank): the step open now and how many steps started.
type StepOf = HashMap<(Option<u32>, Option<u32>), (Option<i64>, i64)>;

/// The kept markers that carry a breakdown, with the step open in their process when they were marked.
fn breakdown_markers(markers: &[Marker]) -> Vec<Boundary<'_>> {
    let mut step_of: StepOf = HashMap::new();
    let mut out = Vec::new();
    for m in markers {
        let st = step_of.entry(m.origin.stream()).or_insert((None, 0));
        if m.kind == MarkerKind::Step && m.edge == Edge::Start {
            st.0 = Some(m.index.unwrap_or(st.1));
            st.1 += 1;
        }
        if m.breakdown.as_ref().is_some_and(|b| !b.is_empty()) {
            out.push((m, st.0));
        }
    }
    out
}

/// The entry of a breakdown that belongs to the device a peak was measured on: the (first) CUDA entry for
/// a marker that read a GPU, the CPU entry otherwise.
fn entry_for(b: &[DeviceBreakdown], cuda: bool) -> Option<&DeviceBreakdown> {
    b.iter().find(|e| e.is_cuda() == cuda)
}

/// Per-boundary rows: every kept breakdown plus the folded rows, merged per (pid, rank, boundary, device).
fn boundary_rows(kept: &[Boundary], folded: &[BreakdownAggregate]) -> Vec<BoundaryRow> {
    let mut rows: HashMap<BreakdownKey, BreakdownAggregate> = HashMap::new();
    for (m, _) in kept {
        let boundary = boundary_of(m);
        for e in m.breakdown.iter().flatten() {
            rows.entry((m.origin.pid, m.origin.rank, boundary.clone(), e.device.clone()))
                .or_insert_with(|| BreakdownAggregate::new(m.origin, boundary.clone(), e.device.clone()))
                .add(e);
        }
    }
    for a in folded {
        rows.entry(a.key())
            .or_insert_with(|| BreakdownAggregate::new(a.origin, a.boundary.clone(), a.device.clone()))
            .merge(a);
    }
    let mut out: Vec<BoundaryRow> = rows
        .into_values()
        .map(|a| BoundaryRow {
            pid: a.origin.pid,
            rank: a.origin.rank,
            boundary: a.boundary.clone(),
            device: a.device.clone(),
            count: a.count,
            categories: a
                .categories
                .iter()
                .filter_map(|(c, s)| Some((*c, MeanMax { mean_bytes: s.mean_bytes()?, max_bytes: s.max_bytes })))
                .collect(),
        })
        .collect();
    out.sort_by_key(|r| (r.rank, r.pid, r.device.clone(), boundary_rank(&r.boundary)));
    out
}

/// The NVML reading nearest to `t_ns` on NVML device `device` (the process's bytes, else the device's used).
fn nearest_nvml(gpu: &[GpuSample], device: Option<u32>, t_ns: u64) -> Option<u64> {
    gpu.iter()
        .filter(|s| device.is_none_or(|d| d == s.device))
        .min_by_key(|s| s.t_ns.abs_diff(t_ns))
        .map(|s| s.process_bytes.unwrap_or(s.used_bytes))
}

/// The allocator's reserved bytes nearest to `t_ns` on `device` (for NVML − reserved).
fn nearest_reserved(torch: &[TorchSample], device: Option<u32>, origin: &Origin, t_ns: u64) -> Option<u64> {
    torch
        .iter()
        .filter(|s| {
            device.is_none_or(|d| d == s.device)
                && (origin.pid.is_none() || s.origin.pid.is_none() || s.origin.pid == origin.pid)
        })
        .min_by_key(|s| s.t_ns.abs_diff(t_ns))
        .map(|s| s.reserved_bytes)
}

/// A span's peak on the device kind asked: the allocator's peak allocated (CUDA) or the peak RSS (CPU),
/// from the exit marker's exact peak, else the highest exit or entry value.
fn span_peak(s: &Span, cuda: bool) -> Option<u64> {
    let exit = s.exit?;
    if cuda {
        opt_max(exit.peak_allocated_bytes, opt_max(exit.allocated_bytes, s.entry.allocated_bytes))
    } else {
        opt_max(exit.peak_rss_bytes, opt_max(exit.rss_bytes, s.entry.rss_bytes))
    }
}

/// The boundary a peak inside `phase` is read against: the one nearest where such a peak happens. Forward's
/// peak comes at its end (every activation is saved then), backward's at its start (the activations are
/// still all saved, the first gradients appear: the end of forward), the optimizer step's once its state
/// exists (its end). None for other phases and for steps.
pub fn read_at(phase: &str) -> Option<&'static str> {
    match phase {
        "forward" | "backward" => Some("end of forward"),
        "optimizer step" => Some("end of optimizer step"),
        _ => None,
    }
}

/// The step open in each span's process when the span started, by (process, start time, kind, name).
type SpanStep<'a> = HashMap<((Option<u32>, Option<u32>), u64, MarkerKind, &'a str), Option<i64>>;

fn span_steps(markers: &[Marker]) -> SpanStep<'_> {
    let mut step_of: StepOf = HashMap::new();
    let mut out = HashMap::new();
    for m in markers {
        let st = step_of.entry(m.origin.stream()).or_insert((None, 0));
        if m.kind == MarkerKind::Step && m.edge == Edge::Start {
            st.0 = Some(m.index.unwrap_or(st.1));
            st.1 += 1;
        }
        if m.edge == Edge::Start {
            out.insert((m.origin.stream(), m.t_ns, m.kind, m.name.as_str()), st.0);
        }
    }
    out
}

fn composition(
    kept: &[Boundary],
    markers: &[Marker],
    gpu: &[GpuSample],
    torch: &[TorchSample],
) -> Option<PeakComposition> {
    let cuda = kept.iter().any(|(m, _)| m.breakdown.iter().flatten().any(DeviceBreakdown::is_cuda));
    let sp = spans(markers);
    let steps = span_steps(markers);
    let step_of = |s: &Span| steps.get(&(s.origin.stream(), s.start_t_ns, s.kind, s.name)).copied().flatten();
    let usable = |m: &Marker| m.breakdown.as_deref().and_then(|b| entry_for(b, cuda)).is_some();
    // The breakdown a span's peak is read against, and why that one (see `PeakComposition::boundary_source`).
    let read = |s: &Span| -> Option<(Boundary, &'static str)> {
        let stream = s.origin.stream();
        let step = if s.kind == MarkerKind::Step { s.index.or(step_of(s)) } else { step_of(s) };
        let want = if s.kind == MarkerKind::Step { Some("step start") } else { read_at(s.name) };
        if let Some(want) = want {
            let same: Vec<&Boundary> = kept
                .iter()
                .filter(|(m, _)| m.origin.stream() == stream && usable(m) && boundary_of(m) == want)
                .collect();
            if let Some(b) = same.iter().find(|(_, st)| step.is_some() && *st == step) {
                return Some((**b, "peak step"));
            }
            if let Some(b) = same.iter().min_by_key(|(m, _)| m.t_ns.abs_diff(s.start_t_ns)) {
                return Some((**b, "nearest measured step"));
            }
        }
        let upto = kept.partition_point(|(m, _)| m.t_ns <= s.start_t_ns);
        kept[..upto]
            .iter()
            .rev()
            .find(|(m, _)| m.origin.stream() == stream && usable(m))
            .map(|b| (*b, "last before the phase"))
    };
    let best = |kind: MarkerKind| {
        let mut best: Option<(u64, &Span, (Boundary, &'static str))> = None;
        for s in sp.iter().filter(|s| s.kind == kind) {
            let Some(peak) = span_peak(s, cuda) else { continue };
            if best.as_ref().is_some_and(|b| peak <= b.0) {
                continue;
            }
            if let Some(r) = read(s) {
                best = Some((peak, s, r));
            }
        }
        best
    };
    let (peak, span, ((open, boundary_step), boundary_source)) =
        best(MarkerKind::Phase).or_else(|| best(MarkerKind::Step))?;
    let step = if span.kind == MarkerKind::Step { span.index.or(step_of(span)) } else { step_of(span) };
    let entry = entry_for(open.breakdown.as_deref()?, cuda)?;
    let exit = span.exit.cloned().unwrap_or_default();
    let named: [(Category, Option<u64>); 5] = [
        (Category::Parameters, entry.parameters_bytes),
        (Category::Gradients, entry.gradients_bytes),
        (Category::OptimizerState, entry.optimizer_state_bytes),
        (Category::Activations, entry.activations_bytes),
        (Category::Inputs, entry.inputs_bytes),
    ];
    // A category the boundary did not measure gets no row (its bytes are then part of `other`).
    let mut rows: Vec<(Category, i64)> = named.iter().filter_map(|&(c, b)| Some((c, b? as i64))).collect();
    rows.push((Category::Other, peak as i64 - entry.named_bytes() as i64));
    let mut non_torch_source = None;
    let (peak_allocated, peak_reserved, total) = if cuda {
        let reserved = opt_max(exit.peak_reserved_bytes, opt_max(exit.reserved_bytes, span.entry.reserved_bytes));
        let mut total = reserved.unwrap_or(peak).max(peak);
        if let Some(r) = reserved {
            rows.push((Category::Cache, r.saturating_sub(peak) as i64));
        }
        let t = span.end_t_ns.unwrap_or(span.start_t_ns);
        let nvml = nearest_nvml(gpu, span.device, t).map(|n| {
            let r = nearest_reserved(torch, span.device, &span.origin, t).or(reserved).unwrap_or(0);
            n as i64 - r as i64
        });
        let non_torch = match nvml {
            Some(v) => {
                non_torch_source = Some("nvml");
                Some(v)
            }
            None => entry.non_torch_bytes.inspect(|_| non_torch_source = Some("boundary")),
        };
        if let Some(v) = non_torch {
            rows.push((Category::NonTorch, v));
            total += v.max(0) as u64;
        }
        (Some(peak), reserved, total)
    } else {
        (None, None, peak)
    };
    let pct = |b: i64| if total > 0 { b as f64 * 100.0 / total as f64 } else { 0.0 };
    Some(PeakComposition {
        pid: span.origin.pid,
        rank: span.origin.rank,
        device: entry.device.clone(),
        basis: if cuda { "allocator" } else { "rss" },
        step,
        phase: span.name.to_string(),
        phase_start_t_ns: span.start_t_ns,
        boundary: boundary_of(open),
        boundary_step,
        boundary_t_ns: open.t_ns,
        boundary_source,
        peak_allocated_bytes: peak_allocated,
        peak_reserved_bytes: peak_reserved,
        peak_rss_bytes: if cuda { opt_max(exit.peak_rss_bytes, exit.rss_bytes) } else { Some(peak) },
        total_bytes: total,
        rows: rows
            .into_iter()
            .map(|(category, bytes)| CompositionRow { category, bytes, percent_of_peak: pct(bytes) })
            .collect(),
        non_torch_source,
    })
}

/// Builds the breakdown facts from the kept markers, the folded rows and (for `non_torch` at the peak) the
/// NVML and allocator samples.
pub fn breakdown_summary(
    markers: &[Marker],
    folded: &[BreakdownAggregate],
    gpu: &[GpuSample],
    torch: &[TorchSample],
) -> BreakdownSummary {
    let kept = breakdown_markers(markers);
    if kept.is_empty() && folded.is_empty() {
        return BreakdownSummary { hint: Some(NO_BREAKDOWN_HINT.into()), ..Default::default() };
    }
    let peak = composition(&kept, markers, gpu, torch);
    let detail_device = peak
        .as_ref()
        .map(|p| p.device.clone())
        .or_else(|| kept.iter().flat_map(|(m, _)| m.breakdown.iter().flatten()).map(|e| e.device.clone()).next());
    let entries_of = |dev: &Option<String>| {
        let dev = dev.clone();
        kept.iter().filter_map(move |(m, _)| m.breakdown.iter().flatten().find(|e| Some(&e.device) == dev.as_ref()))
    };
    // Per module: the last boundary holding gradients (after backward), else the last with parameters.
    let with_modules: Vec<&DeviceBreakdown> = entries_of(&detail_device).filter(|e| !e.by_module.is_empty()).collect();
    let module_src =
        with_modules.iter().rev().find(|e| !e.by_module.gradients.is_empty()).or(with_modules.last()).copied();
    let mut modules: Vec<ModuleRow> =
        module_src
            .map(|e| {
                e.by_module
                    .parameters
                    .iter()
                    .map(|(m, b)| ModuleRow {
                        module: m.clone(),
                        parameters_bytes: *b,
                        gradients_bytes: e.by_module.gradients.get(m).copied(),
                    })
                    .chain(
                        e.by_module.gradients.iter().filter(|(m, _)| !e.by_module.parameters.contains_key(*m)).map(
                            |(m, b)| ModuleRow { module: m.clone(), parameters_bytes: 0, gradients_bytes: Some(*b) },
                        ),
                    )
                    .collect()
            })
            .unwrap_or_default();
    modules.sort_by(|a, b| b.parameters_bytes.cmp(&a.parameters_bytes).then(a.module.cmp(&b.module)));
    let param_groups = entries_of(&detail_device)
        .rfind(|e| !e.by_param_group.is_empty())
        .map(|e| {
            e.by_param_group
                .iter()
                .enumerate()
                .map(|(group, &b)| ParamGroupRow { group, optimizer_state_bytes: b })
                .collect()
        })
        .unwrap_or_default();
    let mut activations_by_module: Vec<ModuleActivationRow> = markers
        .iter()
        .rev()
        .find_map(|m| m.activations_by_module.as_ref().filter(|a| !a.is_empty()))
        .map(|a| a.iter().map(|(m, b)| ModuleActivationRow { module: m.clone(), activations_bytes: *b }).collect())
        .unwrap_or_default();
    activations_by_module.sort_by(|a, b| b.activations_bytes.cmp(&a.activations_bytes).then(a.module.cmp(&b.module)));
    let timeline = kept
        .iter()
        .flat_map(|(m, step)| {
            let boundary = boundary_of(m);
            m.breakdown.iter().flatten().map(move |e| BoundaryPoint {
                t_ns: m.t_ns,
                pid: m.origin.pid,
                step: *step,
                boundary: boundary.clone(),
                device: e.device.clone(),
                categories: Category::ALL.iter().filter_map(|&c| Some((c, e.get(c)?))).collect(),
            })
        })
        .collect();
    BreakdownSummary {
        recorded: true,
        hint: None,
        boundaries: boundary_rows(&kept, folded),
        peak,
        detail_device,
        modules,
        param_groups,
        activations_by_module,
        timeline,
        folded_boundaries: folded.iter().map(|a| a.count).sum(),
    }
}

#[cfg(test)]
mod tests {
    //! Hand-built markers (no Monitor, no torch): the arithmetic of the analysis on known numbers.
    use super::*;

    const MIB: u64 = 1 << 20;

    fn hand_built_marker(t: u64, kind: MarkerKind, edge: Edge, name: &str, index: Option<i64>) -> Marker {
        Marker { index, device: Some(0), ..Marker::new(t, kind, edge, name) }
    }

    fn hand_built_cuda_entry(params: u64, grads: u64, opt: u64, acts: u64, inputs: u64) -> DeviceBreakdown {
        let named = params + grads + opt + acts + inputs;
        DeviceBreakdown {
            device: "cuda:0".into(),
            parameters_bytes: Some(params),
            gradients_bytes: Some(grads),
            optimizer_state_bytes: Some(opt),
            activations_bytes: Some(acts),
            inputs_bytes: Some(inputs),
            other_bytes: Some(MIB as i64),
            allocated_bytes: Some(named + MIB),
            reserved_bytes: Some(named + 9 * MIB),
            cache_bytes: Some(8 * MIB),
            non_torch_bytes: Some(500 * MIB as i64),
            rss_bytes: None,
            by_module: Default::default(),
            by_param_group: vec![],
        }
    }

    /// One hand-built training step on cuda:0 (params 100 MiB): step start, forward (peak 260 MiB),
    /// backward (peak `backward_peak`), optimizer step (peak 420 MiB once its state exists).
    fn hand_built_step(t0: u64, i: i64, backward_peak: u64, opt_state: u64) -> Vec<Marker> {
        let p = 100 * MIB;
        let mut start = hand_built_marker(t0, MarkerKind::Step, Edge::Start, "step", Some(i));
        start.breakdown = Some(vec![hand_built_cuda_entry(p, 0, opt_state, 0, 4 * MIB)]);
        start.memory.allocated_bytes = Some(p + opt_state + 5 * MIB);
        let phase = |t: u64, edge, name: &str, peak: Option<u64>, b: Option<DeviceBreakdown>| {
            let mut m = hand_built_marker(t0 + t, MarkerKind::Phase, edge, name, None);
            m.memory.peak_allocated_bytes = peak;
            m.memory.peak_reserved_bytes = peak.map(|x| x + 64 * MIB);
            m.breakdown = b.map(|b| vec![b]);
            m
        };
        let mut fwd_end = phase(
            20,
            Edge::End,
            "forward",
            Some(260 * MIB),
            Some(hand_built_cuda_entry(p, 0, opt_state, 120 * MIB, 4 * MIB)),
        );
        fwd_end.activations_by_module = Some([("enc.0".to_string(), 80 * MIB), ("head".to_string(), 40 * MIB)].into());
        let mut bwd_end = phase(
            40,
            Edge::End,
            "backward",
            Some(backward_peak),
            Some(hand_built_cuda_entry(p, p, opt_state, 0, 4 * MIB)),
        );
        if let Some(b) = bwd_end.breakdown.as_mut() {
            b[0].by_module.parameters = [("enc".to_string(), 70 * MIB), ("head".to_string(), 30 * MIB)].into();
            b[0].by_module.gradients = [("enc".to_string(), 70 * MIB), ("head".to_string(), 30 * MIB)].into();
        }
        let mut opt_end = phase(
            60,
            Edge::End,
            "optimizer step",
            Some(420 * MIB),
            Some(hand_built_cuda_entry(p, p, 2 * p, 0, 4 * MIB)),
        );
        if let Some(b) = opt_end.breakdown.as_mut() {
            b[0].by_param_group = vec![150 * MIB, 50 * MIB];
        }
        vec![
            start,
            phase(1, Edge::Start, "forward", None, None),
            fwd_end,
            phase(21, Edge::Start, "backward", None, None),
            bwd_end,
            phase(41, Edge::Start, "optimizer step", None, None),
            opt_end,
            hand_built_marker(t0 + 70, MarkerKind::Step, Edge::End, "step", Some(i)),
        ]
    }

    #[test]
    fn hand_built_markers_give_the_composition_at_the_backward_peak() {
        // Step 0: no optimizer state yet; step 1: 200 MiB of it; step 1's backward peaks highest (500 MiB).
        let mut m = hand_built_step(0, 0, 380 * MIB, 0);
        m.extend(hand_built_step(100, 1, 500 * MIB, 200 * MIB));
        let gpu = [GpuSample {
            t_ns: 141,
            device: 0,
            used_bytes: 9000 * MIB,
            total_bytes: 80_000 * MIB,
            process_bytes: Some(1200 * MIB),
        }];
        let torch = [TorchSample {
            t_ns: 139,
            device: 0,
            allocated_bytes: 300 * MIB,
            reserved_bytes: 600 * MIB,
            peak_allocated_bytes: 500 * MIB,
            peak_reserved_bytes: 600 * MIB,
            active_bytes: 0,
            inactive_split_bytes: 0,
            origin: Origin::default(),
        }];
        let s = breakdown_summary(&m, &[], &gpu, &torch);
        assert!(s.recorded && s.hint.is_none());
        let p = s.peak.as_ref().expect("a composition");
        assert_eq!((p.step, p.phase.as_str(), p.boundary.as_str()), (Some(1), "backward", "end of forward"));
        assert_eq!(p.peak_allocated_bytes, Some(500 * MIB));
        // From the end-of-forward boundary of step 1: params 100, opt 200, activations 120, inputs 4.
        assert_eq!(p.bytes(Category::Parameters), Some(100 * MIB as i64));
        assert_eq!(p.bytes(Category::Gradients), Some(0));
        assert_eq!(p.bytes(Category::OptimizerState), Some(200 * MIB as i64));
        assert_eq!(p.bytes(Category::Activations), Some(120 * MIB as i64));
        assert_eq!(p.bytes(Category::Other), Some((500 - 100 - 200 - 120 - 4) as i64 * MIB as i64));
        assert_eq!(p.bytes(Category::Cache), Some(64 * MIB as i64), "peak reserved − peak allocated");
        assert_eq!(p.bytes(Category::NonTorch), Some(600 * MIB as i64), "NVML 1200 MiB − reserved 600 MiB");
        assert_eq!(p.non_torch_source, Some("nvml"));
        assert_eq!(p.total_bytes, (500 + 64 + 600) * MIB);
        let sum: i64 = p.rows.iter().map(|r| r.bytes).sum();
        assert_eq!(sum as u64, p.total_bytes, "the rows add up to the total");
        let pct: f64 = p.rows.iter().map(|r| r.percent_of_peak).sum();
        assert!((pct - 100.0).abs() < 1e-9, "{pct}");
        // Per boundary: mean and max over both steps.
        let row = |b: &str| s.boundaries.iter().find(|r| r.boundary == b).unwrap();
        assert_eq!(
            s.boundaries.iter().map(|r| r.boundary.as_str()).collect::<Vec<_>>(),
            ["step start", "end of forward", "end of backward", "end of optimizer step"]
        );
        assert_eq!(row("step start").count, 2);
        assert_eq!(row("step start").mean(Category::OptimizerState), Some(100 * MIB));
        assert_eq!(row("step start").max(Category::OptimizerState), Some(200 * MIB));
        assert_eq!(row("end of backward").mean(Category::Gradients), Some(100 * MIB));
        assert_eq!(row("end of forward").max(Category::Activations), Some(120 * MIB));
        assert_eq!(row("end of forward").mean(Category::Rss), None, "not measured on a GPU entry");
        // Detail: modules sorted by bytes, groups in order, activations sorted.
        assert_eq!(
            s.modules.iter().map(|r| (r.module.as_str(), r.gradients_bytes)).collect::<Vec<_>>(),
            [("enc", Some(70 * MIB)), ("head", Some(30 * MIB))]
        );
        assert_eq!(s.param_groups.iter().map(|g| g.optimizer_state_bytes).collect::<Vec<_>>(), [150 * MIB, 50 * MIB]);
        assert_eq!(
            s.activations_by_module[0],
            ModuleActivationRow { module: "enc.0".into(), activations_bytes: 80 * MIB }
        );
        assert_eq!(s.timeline.len(), 8);
        assert_eq!(s.timeline[4].step, Some(1));
    }

    #[test]
    fn hand_built_cpu_markers_compose_the_peak_rss() {
        let cpu = |params: u64, acts: u64, rss: u64| DeviceBreakdown {
            device: "cpu".into(),
            parameters_bytes: Some(params),
            activations_bytes: Some(acts),
            rss_bytes: Some(rss),
            ..Default::default()
        };
        let mut start = hand_built_marker(0, MarkerKind::Step, Edge::Start, "step", Some(0));
        start.device = None;
        start.breakdown = Some(vec![cpu(10 * MIB, 0, 300 * MIB)]);
        let mut fs = hand_built_marker(1, MarkerKind::Phase, Edge::Start, "forward", None);
        fs.device = None;
        fs.memory.rss_bytes = Some(300 * MIB);
        let mut fe = hand_built_marker(5, MarkerKind::Phase, Edge::End, "forward", None);
        fe.device = None;
        fe.memory.rss_bytes = Some(320 * MIB);
        fe.memory.peak_rss_bytes = Some(350 * MIB);
        fe.breakdown = Some(vec![cpu(10 * MIB, 20 * MIB, 320 * MIB)]);
        let s = breakdown_summary(&[start, fs, fe], &[], &[], &[]);
        let p = s.peak.unwrap();
        // A forward peak is read at the end of forward, where its activations are saved (not at the step
        // start, where they are 0 B).
        assert_eq!((p.basis, p.device.as_str(), p.boundary.as_str()), ("rss", "cpu", "end of forward"));
        assert_eq!((p.step, p.boundary_step, p.boundary_source), (Some(0), Some(0), "peak step"));
        assert_eq!(p.bytes(Category::Activations), Some(20 * MIB as i64));
        assert_eq!(p.bytes(Category::Other), Some(320 * MIB as i64), "peak RSS − parameters − activations");
        assert_eq!((p.bytes(Category::Cache), p.bytes(Category::NonTorch)), (None, None), "no allocator, no NVML");
        assert_eq!(p.total_bytes, 350 * MIB);
    }

    #[test]
    fn a_peak_in_a_step_not_measured_names_its_step_and_the_measured_one() {
        // Steps 0, 1 and 3 measured; step 2 (not measured: no breakdown on its markers) peaks highest, in its
        // optimizer step. The peak is step 2's; the categories come from the end of the optimizer step of
        // the nearest measured step (step 1: 81 ns before, step 3: 119 ns after), and say so.
        let mut m = hand_built_step(0, 0, 380 * MIB, 0);
        m.extend(hand_built_step(100, 1, 380 * MIB, 200 * MIB));
        let mut unmeasured = hand_built_step(200, 2, 380 * MIB, 200 * MIB);
        for x in &mut unmeasured {
            x.breakdown = None;
            if x.name == "optimizer step" && x.edge == Edge::End {
                x.memory.peak_allocated_bytes = Some(900 * MIB);
            }
        }
        m.extend(unmeasured);
        m.extend(hand_built_step(300, 3, 380 * MIB, 200 * MIB));
        let p = breakdown_summary(&m, &[], &[], &[]).peak.expect("a composition");
        assert_eq!((p.step, p.phase.as_str(), p.phase_start_t_ns), (Some(2), "optimizer step", 241));
        assert_eq!((p.boundary.as_str(), p.boundary_step), ("end of optimizer step", Some(1)));
        assert_eq!((p.boundary_t_ns, p.boundary_source), (160, "nearest measured step"));
        assert_eq!(p.bytes(Category::OptimizerState), Some(200 * MIB as i64));
        assert_eq!(p.bytes(Category::Other), Some((900 - 100 - 100 - 200 - 4) as i64 * MIB as i64));
        // The peak's own step measured: read there.
        let mut m = hand_built_step(0, 0, 380 * MIB, 0);
        let mut peaky = hand_built_step(100, 1, 380 * MIB, 200 * MIB);
        peaky[2].memory.peak_allocated_bytes = Some(700 * MIB); // end of forward
        m.extend(peaky);
        m.extend(hand_built_step(200, 2, 380 * MIB, 200 * MIB));
        let p = breakdown_summary(&m, &[], &[], &[]).peak.unwrap();
        assert_eq!((p.step, p.phase.as_str(), p.boundary.as_str()), (Some(1), "forward", "end of forward"));
        assert_eq!((p.boundary_step, p.boundary_t_ns, p.boundary_source), (Some(1), 120, "peak step"));
        assert_eq!(p.bytes(Category::Activations), Some(120 * MIB as i64), "the forward's saved tensors");
    }

    #[test]
    fn no_breakdown_says_how_to_get_one() {
        let m = [hand_built_marker(0, MarkerKind::Step, Edge::Start, "step", Some(0))];
        let s = breakdown_summary(&m, &[], &[], &[]);
        assert!(!s.recorded && s.boundaries.is_empty() && s.peak.is_none());
        assert!(s.hint.unwrap().contains("torchmem.Monitor(model, optimizer)"));
    }

    #[test]
    fn folded_rows_join_the_kept_boundaries_exactly() {
        // 10 steps; the folder keeps 3: the per-boundary mean and max equal those over all 10.
        let mut all = Vec::new();
        for i in 0..10i64 {
            all.extend(hand_built_step(i as u64 * 100, i, (380 + i as u64) * MIB, i as u64 * 10 * MIB));
        }
        let full = breakdown_summary(&all, &[], &[], &[]);
        let mut folder = crate::fold::SpanFolder::new(3);
        let kept: Vec<Marker> = all.iter().cloned().filter_map(|m| folder.push(m)).collect();
        folder.finish();
        let folded = folder.breakdown_aggregates();
        let s = breakdown_summary(&kept, &folded, &[], &[]);
        assert_eq!(s.boundaries, full.boundaries);
        assert_eq!(s.folded_boundaries, 4 * 7);
        assert_eq!(s.timeline.len(), 4 * 3, "the timeline holds the kept steps only");
        let start = s.boundaries.iter().find(|r| r.boundary == "step start").unwrap();
        assert_eq!(
            (start.count, start.mean(Category::OptimizerState), start.max(Category::OptimizerState)),
            (10, Some(45 * MIB), Some(90 * MIB))
        );
    }
}
