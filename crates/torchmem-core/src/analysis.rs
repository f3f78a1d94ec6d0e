//! Turns a loaded profile (or a list of markers from the in-process Monitor) into the facts the reports
//! show: peaks, spans (epochs, steps, phases) with their memory, per-phase aggregates, per-process peaks,
//! growth ("leak") warnings and the memory journey.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::journey::JourneyStage;
use crate::model::*;
use crate::store::Profile;

/// The highest value a series reached and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PeakAt {
    pub bytes: u64,
    pub t_ns: u64,
}

fn max_by<T>(items: &[T], f: impl Fn(&T) -> Option<u64>, t: impl Fn(&T) -> u64) -> Option<PeakAt> {
    let mut best: Option<PeakAt> = None;
    for it in items {
        if let Some(b) = f(it) {
            if best.is_none_or(|p| b > p.bytes) {
                best = Some(PeakAt { bytes: b, t_ns: t(it) });
            }
        }
    }
    best
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuPeak {
    pub device: u32,
    pub name: Option<String>,
    pub total_bytes: Option<u64>,
    /// PyTorch allocator, exact (from its own peak counters when recorded).
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    /// NVML: memory of the profiled processes on this device (CUDA context included).
    pub nvml_process_bytes: Option<u64>,
    /// NVML: device-wide used memory, every process.
    pub nvml_used_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Peaks {
    pub cpu_rss_bytes: Option<u64>,
    pub cpu_rss_t_ns: Option<u64>,
    pub cpu_pss_bytes: Option<u64>,
    pub cpu_uss_bytes: Option<u64>,
    pub gpus: Vec<GpuPeak>,
}

/// One epoch, step or phase: a matched start and end marker, borrowed from the markers (a million-step run has
/// millions of spans: they must not copy what the markers hold).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Span<'a> {
    pub kind: MarkerKind,
    pub name: &'a str,
    pub index: Option<i64>,
    pub start_t_ns: u64,
    /// None when the run ended inside the span (crash, kill).
    pub end_t_ns: Option<u64>,
    pub entry: &'a MarkerMemory,
    pub exit: Option<&'a MarkerMemory>,
}

impl Span<'_> {
    pub fn duration_ns(&self) -> Option<u64> {
        self.end_t_ns.map(|e| e.saturating_sub(self.start_t_ns))
    }
    pub fn delta_allocated(&self) -> Option<i64> {
        Some(self.exit?.allocated_bytes? as i64 - self.entry.allocated_bytes? as i64)
    }
    pub fn delta_rss(&self) -> Option<i64> {
        Some(self.exit?.rss_bytes? as i64 - self.entry.rss_bytes? as i64)
    }
}

/// Pairs start and end markers into spans (nesting allowed; a start without end stays open).
pub fn spans(markers: &[Marker]) -> Vec<Span<'_>> {
    let mut out: Vec<Span<'_>> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    for m in markers {
        match m.edge {
            Edge::Start => {
                out.push(Span {
                    kind: m.kind,
                    name: &m.name,
                    index: m.index,
                    start_t_ns: m.t_ns,
                    end_t_ns: None,
                    entry: &m.memory,
                    exit: None,
                });
                open.push(out.len() - 1);
            }
            Edge::End => {
                if let Some(pos) = open.iter().rposition(|&i| out[i].kind == m.kind && out[i].name == m.name.as_str()) {
                    let i = open.remove(pos);
                    out[i].end_t_ns = Some(m.t_ns);
                    out[i].exit = Some(&m.memory);
                    if out[i].index.is_none() {
                        out[i].index = m.index;
                    }
                }
            }
            Edge::Point => {}
        }
    }
    out
}

/// One row of the per-epoch (or per-step) table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochRow {
    pub index: i64,
    pub duration_ns: Option<u64>,
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub rss_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
    /// End-of-epoch allocated (GPU) minus the previous epoch's; RSS on CPU-only runs.
    pub growth_allocated_bytes: Option<i64>,
    pub growth_rss_bytes: Option<i64>,
}

/// Per-phase aggregate over all its occurrences (e.g. every "forward").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PhaseRow {
    pub name: String,
    pub count: u64,
    pub total_ns: u64,
    pub mean_delta_allocated_bytes: Option<i64>,
    pub max_peak_allocated_bytes: Option<u64>,
    pub max_peak_reserved_bytes: Option<u64>,
    pub mean_delta_rss_bytes: Option<i64>,
    pub max_peak_rss_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcessRow {
    pub pid: u32,
    pub ppid: u32,
    pub cmdline: String,
    pub peak_rss_bytes: Option<u64>,
    pub peak_pss_bytes: Option<u64>,
    pub peak_uss_bytes: Option<u64>,
    pub peak_gpu_bytes: Option<u64>,
    pub lifetime_ns: u64,
}

/// Memory that grows every epoch (or step): the classic `total_loss += loss` leak.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Growth {
    /// "epoch" or "step".
    pub unit: String,
    /// "GPU allocated" or "CPU RSS".
    pub what: String,
    pub per_unit_bytes: i64,
    pub units: usize,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub command: Vec<String>,
    pub exit_code: Option<i32>,
    pub duration_ns: Option<u64>,
    /// Number of CPU samples (the timeline's resolution).
    pub samples: usize,
    pub torch_samples: usize,
    pub gpu_samples: usize,
    pub peak: Peaks,
    pub epochs: Vec<EpochRow>,
    pub steps: usize,
    pub phases: Vec<PhaseRow>,
    pub processes: Vec<ProcessRow>,
    pub growth: Vec<Growth>,
    pub journey: Vec<JourneyStage>,
}

fn opt_max(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// Highest allocated/reserved/RSS inside a span: the exit marker's exact peak where the API measured it,
/// otherwise the highest sample inside the span's time range.
fn span_peaks(span: &Span, torch: &[TorchSample], cpu: &[CpuSample]) -> (Option<u64>, Option<u64>, Option<u64>) {
    let exit = span.exit.cloned().unwrap_or_default();
    let end = span.end_t_ns.unwrap_or(u64::MAX);
    let inside = |t: u64| t >= span.start_t_ns && t <= end;
    let mut alloc = opt_max(exit.peak_allocated_bytes, opt_max(exit.allocated_bytes, span.entry.allocated_bytes));
    let mut reserved = opt_max(exit.peak_reserved_bytes, opt_max(exit.reserved_bytes, span.entry.reserved_bytes));
    let mut rss = opt_max(exit.peak_rss_bytes, opt_max(exit.rss_bytes, span.entry.rss_bytes));
    // Samples are sorted by time: look up the span's range instead of scanning every sample per span.
    let range = |ts: &dyn Fn(usize) -> u64, len: usize| {
        let lo = partition(len, |i| ts(i) < span.start_t_ns);
        let hi = partition(len, |i| ts(i) <= end);
        lo..hi.max(lo)
    };
    if exit.peak_allocated_bytes.is_none() {
        let r = range(&|i| torch[i].t_ns, torch.len());
        for s in torch[r].iter().filter(|s| inside(s.t_ns)) {
            alloc = opt_max(alloc, Some(s.allocated_bytes));
            reserved = opt_max(reserved, Some(s.reserved_bytes));
        }
    }
    if exit.peak_rss_bytes.is_none() {
        let r = range(&|i| cpu[i].t_ns, cpu.len());
        for s in cpu[r].iter().filter(|s| inside(s.t_ns)) {
            rss = opt_max(rss, Some(s.rss_bytes));
        }
    }
    (alloc, reserved, rss)
}

/// The first index in 0..len for which `before` is false (`before` must be true then false along the range).
fn partition(len: usize, before: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, len);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if before(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

pub fn epoch_rows(spans: &[Span], kind: MarkerKind, torch: &[TorchSample], cpu: &[CpuSample]) -> Vec<EpochRow> {
    let mut rows: Vec<EpochRow> = Vec::new();
    for (n, s) in spans.iter().filter(|s| s.kind == kind).enumerate() {
        let (pa, pr, prss) = span_peaks(s, torch, cpu);
        let exit = s.exit.cloned();
        let allocated = exit.as_ref().and_then(|e| e.allocated_bytes);
        let rss = exit.as_ref().and_then(|e| e.rss_bytes);
        let prev = rows.last();
        let growth_allocated = match (allocated, prev.and_then(|p| p.allocated_bytes)) {
            (Some(a), Some(b)) => Some(a as i64 - b as i64),
            _ => None,
        };
        let growth_rss = match (rss, prev.and_then(|p| p.rss_bytes)) {
            (Some(a), Some(b)) => Some(a as i64 - b as i64),
            _ => None,
        };
        rows.push(EpochRow {
            index: s.index.unwrap_or(n as i64),
            duration_ns: s.duration_ns(),
            allocated_bytes: allocated,
            reserved_bytes: exit.as_ref().and_then(|e| e.reserved_bytes),
            peak_allocated_bytes: pa,
            peak_reserved_bytes: pr,
            rss_bytes: rss,
            peak_rss_bytes: prss,
            growth_allocated_bytes: growth_allocated,
            growth_rss_bytes: growth_rss,
        });
    }
    rows
}

pub fn phase_rows(spans: &[Span], torch: &[TorchSample], cpu: &[CpuSample]) -> Vec<PhaseRow> {
    let mut order: Vec<String> = Vec::new();
    let mut groups: BTreeMap<&str, Vec<&Span>> = BTreeMap::new();
    for s in spans.iter().filter(|s| s.kind == MarkerKind::Phase) {
        if !groups.contains_key(s.name) {
            order.push(s.name.to_string());
        }
        groups.entry(s.name).or_default().push(s);
    }
    order
        .into_iter()
        .map(|name| {
            let list = &groups[name.as_str()];
            let mean = |f: &dyn Fn(&Span) -> Option<i64>| {
                let v: Vec<i64> = list.iter().filter_map(|s| f(s)).collect();
                (!v.is_empty()).then(|| v.iter().sum::<i64>() / v.len() as i64)
            };
            let mut row = PhaseRow {
                name: name.clone(),
                count: list.len() as u64,
                total_ns: list.iter().filter_map(|s| s.duration_ns()).sum(),
                mean_delta_allocated_bytes: mean(&|s| s.delta_allocated()),
                max_peak_allocated_bytes: None,
                max_peak_reserved_bytes: None,
                mean_delta_rss_bytes: mean(&|s| s.delta_rss()),
                max_peak_rss_bytes: None,
            };
            for s in list {
                let (a, r, c) = span_peaks(s, torch, cpu);
                row.max_peak_allocated_bytes = opt_max(row.max_peak_allocated_bytes, a);
                row.max_peak_reserved_bytes = opt_max(row.max_peak_reserved_bytes, r);
                row.max_peak_rss_bytes = opt_max(row.max_peak_rss_bytes, c);
            }
            row
        })
        .collect()
}

/// Flags a series that rises at every step after the first transition, by at least `min_bytes` on average.
pub fn detect_growth(values: &[u64], min_bytes: i64) -> Option<i64> {
    if values.len() < 3 {
        return None;
    }
    let diffs: Vec<i64> = values.windows(2).map(|w| w[1] as i64 - w[0] as i64).collect();
    if diffs.iter().any(|d| *d <= 0) {
        return None;
    }
    let mean = diffs.iter().sum::<i64>() / diffs.len() as i64;
    (mean >= min_bytes).then_some(mean)
}

const GROWTH_MIN_BYTES: i64 = 1 << 20;

/// Growth warnings from epoch rows (GPU allocated first, CPU RSS otherwise).
pub fn growth_warnings(rows: &[EpochRow], unit: &str) -> Vec<Growth> {
    let mut out = Vec::new();
    let alloc: Vec<u64> = rows.iter().filter_map(|r| r.allocated_bytes).collect();
    let rss: Vec<u64> = rows.iter().filter_map(|r| r.rss_bytes).collect();
    let candidates: [(&str, &Vec<u64>); 2] = [("GPU allocated", &alloc), ("CPU RSS", &rss)];
    for (what, values) in candidates {
        if values.len() != rows.len() {
            continue;
        }
        // RSS grows in allocator-sized chunks (glibc arenas, torch's CPU caching) that scale with the process:
        // ask for at least 4 MiB and 1 % of the RSS per unit there; the GPU allocator's counters are exact.
        let min = if what == "CPU RSS" {
            (4 * GROWTH_MIN_BYTES).max(values.last().copied().unwrap_or(0) as i64 / 100)
        } else {
            GROWTH_MIN_BYTES
        };
        if let Some(per) = detect_growth(values, min) {
            out.push(Growth {
                unit: unit.into(),
                what: what.into(),
                per_unit_bytes: per,
                units: values.len(),
                message: format!(
                    "{what} grew every {unit} for {} {unit}s, by {} per {unit} on average: something keeps tensors alive across {unit}s (e.g. `total_loss += loss` instead of `loss.item()`, or a list of outputs)",
                    values.len(),
                    crate::units::format_delta(per)
                ),
            });
            break;
        }
    }
    out
}

/// The journey: named marks in order, the first forward/backward/optimizer phases, the peak, cache emptied.
pub fn journey(
    markers: &[Marker],
    capacity_bytes: Option<u64>,
    torch: &[TorchSample],
    cpu: &[CpuSample],
) -> Vec<JourneyStage> {
    journey_of_spans(markers, &spans(markers), capacity_bytes, torch, cpu)
}

/// `journey` with the markers' spans already paired (a long run's spans are worth computing once).
pub fn journey_of_spans(
    markers: &[Marker],
    all_spans: &[Span],
    capacity_bytes: Option<u64>,
    torch: &[TorchSample],
    cpu: &[CpuSample],
) -> Vec<JourneyStage> {
    let mut stages = Vec::new();
    let section_of = |name: &str| -> &'static str {
        let n = name.to_ascii_lowercase();
        if n.contains("cache") || n.contains("clean") || n.contains("end") {
            "Cleanup"
        } else if n.contains("device") || n.contains("model") || n.contains("init") || n.contains("start") {
            "Setup"
        } else {
            "Training"
        }
    };
    let stage = |name: String, mem: &MarkerMemory, peak: bool| JourneyStage {
        section: section_of(&name).to_string(),
        name,
        allocated_bytes: if peak { mem.peak_allocated_bytes.or(mem.allocated_bytes) } else { mem.allocated_bytes },
        reserved_bytes: if peak { mem.peak_reserved_bytes.or(mem.reserved_bytes) } else { mem.reserved_bytes },
        rss_bytes: if peak { mem.peak_rss_bytes.or(mem.rss_bytes) } else { mem.rss_bytes },
        capacity_bytes,
        measure: String::new(),
    };
    let mut phases_done: Vec<&str> = Vec::new();
    let mut peak_inserted = false;
    let mut items: Vec<(u64, JourneyStage)> = Vec::new();
    // A journey is a path, not a log: a mark repeated every epoch (e.g. "Cache emptied") appears once, first time.
    let mut marks_done: Vec<&str> = Vec::new();
    for m in markers.iter().filter(|m| m.kind == MarkerKind::Mark && m.edge == Edge::Point) {
        if marks_done.contains(&m.name.as_str()) {
            continue;
        }
        marks_done.push(&m.name);
        items.push((m.t_ns, stage(m.name.clone(), &m.memory, false)));
    }
    for s in all_spans.iter().filter(|s| s.kind == MarkerKind::Phase) {
        if phases_done.contains(&s.name) || s.exit.is_none() {
            continue;
        }
        phases_done.push(s.name);
        let mut exit = s.exit.cloned().unwrap_or_default();
        let (a, r, c) = span_peaks(s, torch, cpu);
        exit.peak_allocated_bytes = a;
        exit.peak_reserved_bytes = r;
        exit.peak_rss_bytes = c;
        let mut st = stage(s.name.to_string(), &exit, true);
        st.section = "Training".into();
        items.push((s.start_t_ns, st));
    }
    items.sort_by_key(|(t, _)| *t);
    // The peak goes before the first cleanup stage (or last).
    let peak_alloc = max_by(torch, |s| Some(s.peak_allocated_bytes.max(s.allocated_bytes)), |s| s.t_ns);
    let peak_reserved = torch.iter().map(|s| s.peak_reserved_bytes.max(s.reserved_bytes)).max();
    let peak_rss = max_by(cpu, |s| Some(s.rss_bytes), |s| s.t_ns);
    let marker_peak_alloc =
        markers.iter().filter_map(|m| m.memory.peak_allocated_bytes.or(m.memory.allocated_bytes)).max();
    let marker_peak_reserved =
        markers.iter().filter_map(|m| m.memory.peak_reserved_bytes.or(m.memory.reserved_bytes)).max();
    let marker_peak_rss = markers.iter().filter_map(|m| m.memory.peak_rss_bytes.or(m.memory.rss_bytes)).max();
    let peak_stage = JourneyStage {
        name: "Peak".into(),
        section: "Training".into(),
        allocated_bytes: opt_max(peak_alloc.map(|p| p.bytes), marker_peak_alloc),
        reserved_bytes: opt_max(peak_reserved, marker_peak_reserved),
        rss_bytes: opt_max(peak_rss.map(|p| p.bytes), marker_peak_rss),
        capacity_bytes,
        measure: String::new(),
    };
    for (_, st) in items {
        if !peak_inserted && st.section == "Cleanup" {
            stages.push(peak_stage.clone());
            peak_inserted = true;
        }
        stages.push(st);
    }
    if !peak_inserted && (peak_stage.used_bytes().is_some()) {
        stages.push(peak_stage);
    }
    // One yardstick for the whole journey: the GPU when the run used one, else the host's RAM.
    let gpu_run = stages.iter().any(|s| s.allocated_bytes.is_some() || s.reserved_bytes.is_some());
    for s in &mut stages {
        s.measure = if gpu_run { "gpu" } else { "cpu" }.into();
    }
    stages
}

impl Summary {
    pub fn from_profile(p: &Profile) -> Summary {
        let sp = spans(&p.markers);
        let epochs = epoch_rows(&sp, MarkerKind::Epoch, &p.torch, &p.cpu);
        let step_rows = epoch_rows(&sp, MarkerKind::Step, &p.torch, &p.cpu);
        let mut growth = growth_warnings(&epochs, "epoch");
        if growth.is_empty() && step_rows.len() >= 5 {
            growth = growth_warnings(&step_rows, "step");
        }
        // Peaks per GPU, by NVML index: the in-process sampler reports the allocator's numbers under the NVML
        // index of the device (matched by UUID), so CUDA_VISIBLE_DEVICES renumbering does not split a GPU.
        let mut devices: Vec<u32> = p.torch.iter().map(|s| s.device).chain(p.gpu.iter().map(|s| s.device)).collect();
        devices.sort_unstable();
        devices.dedup();
        let gpus = devices
            .into_iter()
            .map(|d| {
                let t: Vec<&TorchSample> = p.torch.iter().filter(|s| s.device == d).collect();
                let g: Vec<&GpuSample> = p.gpu.iter().filter(|s| s.device == d).collect();
                let marker_alloc = p.markers.iter().filter_map(|m| m.memory.peak_allocated_bytes).max();
                let marker_reserved = p.markers.iter().filter_map(|m| m.memory.peak_reserved_bytes).max();
                let torch_alloc = t.iter().map(|s| s.peak_allocated_bytes.max(s.allocated_bytes)).max();
                let torch_reserved = t.iter().map(|s| s.peak_reserved_bytes.max(s.reserved_bytes)).max();
                GpuPeak {
                    device: d,
                    name: p.meta.gpu_names.get(d as usize).cloned(),
                    total_bytes: p
                        .meta
                        .gpu_total_bytes
                        .get(d as usize)
                        .copied()
                        .or_else(|| g.first().map(|s| s.total_bytes)),
                    allocated_bytes: if t.is_empty() { None } else { opt_max(torch_alloc, marker_alloc) },
                    reserved_bytes: if t.is_empty() { None } else { opt_max(torch_reserved, marker_reserved) },
                    nvml_process_bytes: g.iter().filter_map(|s| s.process_bytes).max(),
                    nvml_used_bytes: g.iter().map(|s| s.used_bytes).max(),
                }
            })
            .collect::<Vec<_>>();
        let rss = max_by(&p.cpu, |s| Some(s.rss_bytes), |s| s.t_ns);
        let processes = p
            .processes
            .iter()
            .map(|info| {
                let samples: Vec<&ProcessSample> = p.process_samples.iter().filter(|s| s.pid == info.pid).collect();
                ProcessRow {
                    pid: info.pid,
                    ppid: info.ppid,
                    cmdline: info.cmdline.clone(),
                    peak_rss_bytes: samples.iter().map(|s| s.rss_bytes).max(),
                    peak_pss_bytes: samples.iter().filter_map(|s| s.pss_bytes).max(),
                    peak_uss_bytes: samples.iter().filter_map(|s| s.uss_bytes).max(),
                    peak_gpu_bytes: samples.iter().filter_map(|s| s.gpu_bytes).max(),
                    lifetime_ns: info.last_t_ns.saturating_sub(info.first_t_ns),
                }
            })
            .collect();
        let capacity = gpus
            .first()
            .and_then(|g| if g.allocated_bytes.is_some() { g.total_bytes } else { None })
            .or(p.meta.host_total_bytes);
        let journey = journey_of_spans(&p.markers, &sp, capacity, &p.torch, &p.cpu);
        Summary {
            command: p.meta.command.clone(),
            exit_code: p.meta.exit_code,
            duration_ns: p.meta.duration_ns.or_else(|| p.cpu.last().map(|s| s.t_ns)),
            samples: p.cpu.len(),
            torch_samples: p.torch.len(),
            gpu_samples: p.gpu.len(),
            peak: Peaks {
                cpu_rss_bytes: rss.map(|r| r.bytes),
                cpu_rss_t_ns: rss.map(|r| r.t_ns),
                cpu_pss_bytes: p.cpu.iter().filter_map(|s| s.pss_bytes).max(),
                cpu_uss_bytes: p.cpu.iter().filter_map(|s| s.uss_bytes).max(),
                gpus,
            },
            epochs,
            steps: step_rows.len(),
            phases: phase_rows(&sp, &p.torch, &p.cpu),
            processes,
            growth,
            journey,
        }
    }

    /// A summary of markers alone: what the in-process Monitor has (no sampler timeline).
    pub fn from_markers(markers: &[Marker], capacity_bytes: Option<u64>) -> Summary {
        let p = Profile {
            markers: markers.to_vec(),
            meta: RunMeta { host_total_bytes: capacity_bytes, ..Default::default() },
            ..Default::default()
        };
        // Without samples the journey's yardstick is `host_total_bytes`, i.e. `capacity_bytes`.
        Summary::from_profile(&p)
    }

    /// The Monitor's summary when it kept only some step and phase markers: `agg` covers every occurrence
    /// (phase rows, step count, the highest values seen), the kept markers give epochs, marks and the
    /// journey's first phases.
    pub fn from_markers_aggregated(markers: &[Marker], capacity_bytes: Option<u64>, agg: &MarkerAggregates) -> Summary {
        let mut s = Summary::from_markers(markers, capacity_bytes);
        s.steps = agg.steps;
        s.phases = agg.phases.clone();
        if let Some(peak) = s.journey.iter_mut().find(|st| st.name == "Peak") {
            peak.allocated_bytes = opt_max(peak.allocated_bytes, agg.peak_allocated_bytes);
            peak.reserved_bytes = opt_max(peak.reserved_bytes, agg.peak_reserved_bytes);
            peak.rss_bytes = opt_max(peak.rss_bytes, agg.peak_rss_bytes);
        }
        s
    }
}

/// What a long-running Monitor keeps instead of every step and phase marker (it keeps the markers of the
/// first occurrences only, so its memory does not grow with the number of steps): computed as
/// `phase_rows` and `Summary::steps` would compute them from all markers.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct MarkerAggregates {
    pub steps: usize,
    pub phases: Vec<PhaseRow>,
    /// The highest peak (else current) value of any marker, kept or not.
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn mk(t: u64, kind: MarkerKind, edge: Edge, name: &str, idx: Option<i64>, alloc: u64, peak: Option<u64>) -> Marker {
        Marker {
            t_ns: t,
            kind,
            edge,
            name: name.into(),
            index: idx,
            memory: MarkerMemory {
                allocated_bytes: Some(alloc),
                reserved_bytes: Some(alloc * 2),
                rss_bytes: Some(100 * MIB),
                peak_allocated_bytes: peak,
                ..Default::default()
            },
        }
    }

    fn leaky_run(epochs: i64, leak_per_epoch: u64) -> Vec<Marker> {
        let mut v = Vec::new();
        let mut t = 0;
        for e in 0..epochs {
            let base = 10 * MIB + e as u64 * leak_per_epoch;
            v.push(mk(t, MarkerKind::Epoch, Edge::Start, "epoch", Some(e), base, None));
            v.push(mk(t + 1, MarkerKind::Phase, Edge::Start, "forward", None, base, None));
            v.push(mk(t + 2, MarkerKind::Phase, Edge::End, "forward", None, base + 50 * MIB, Some(base + 60 * MIB)));
            v.push(mk(t + 3, MarkerKind::Phase, Edge::Start, "backward", None, base + 50 * MIB, None));
            v.push(mk(t + 4, MarkerKind::Phase, Edge::End, "backward", None, base, Some(base + 70 * MIB)));
            v.push(mk(
                t + 5,
                MarkerKind::Epoch,
                Edge::End,
                "epoch",
                Some(e),
                base + leak_per_epoch,
                Some(base + 70 * MIB),
            ));
            t += 10;
        }
        v
    }

    #[test]
    fn pairs_nested_spans_and_keeps_open_ones() {
        let mut m = leaky_run(1, 0);
        m.push(mk(100, MarkerKind::Phase, Edge::Start, "forward", None, 1, None));
        let sp = spans(&m);
        assert_eq!(sp.len(), 4);
        assert_eq!(sp[0].kind, MarkerKind::Epoch);
        assert_eq!(sp[0].end_t_ns, Some(5));
        assert_eq!(sp[1].delta_allocated(), Some(50 * MIB as i64));
        assert!(sp[3].end_t_ns.is_none());
    }

    #[test]
    fn aggregates_stand_in_for_markers_a_monitor_did_not_keep() {
        let all = leaky_run(4, 0);
        let full = Summary::from_markers(&all, None);
        // The Monitor kept the epochs only, and aggregated the phases itself.
        let epochs_only: Vec<Marker> = all.iter().filter(|m| m.kind == MarkerKind::Epoch).cloned().collect();
        let agg = MarkerAggregates {
            steps: 0,
            phases: full.phases.clone(),
            peak_allocated_bytes: Some(500 * MIB),
            ..Default::default()
        };
        let s = Summary::from_markers_aggregated(&epochs_only, None, &agg);
        assert_eq!(s.phases, full.phases);
        assert_eq!(s.epochs, full.epochs);
        let peak = s.journey.iter().find(|st| st.name == "Peak").expect("a peak stage");
        assert_eq!(peak.allocated_bytes, Some(500 * MIB), "the aggregate's peak counts though its marker is gone");
    }

    #[test]
    fn phase_and_epoch_tables() {
        let s = Summary::from_markers(&leaky_run(3, 0), None);
        assert_eq!(s.epochs.len(), 3);
        assert_eq!(s.phases.len(), 2);
        assert_eq!(s.phases[0].name, "forward");
        assert_eq!(s.phases[0].count, 3);
        assert_eq!(s.phases[0].max_peak_allocated_bytes, Some(70 * MIB));
        assert_eq!(s.phases[1].max_peak_allocated_bytes, Some(80 * MIB));
        assert_eq!(s.epochs[1].growth_allocated_bytes, Some(0));
        assert!(s.growth.is_empty());
    }

    #[test]
    fn span_peaks_fall_back_to_the_samples_inside_the_span() {
        let bare = |t, edge| Marker {
            t_ns: t,
            kind: MarkerKind::Phase,
            edge,
            name: "p".into(),
            index: None,
            memory: MarkerMemory::default(),
        };
        let markers = [bare(100, Edge::Start), bare(200, Edge::End)];
        let sp = &spans(&markers)[0];
        let cpu: Vec<CpuSample> = [(50, 9000), (100, 10), (150, 30), (200, 20), (250, 8000)]
            .iter()
            .map(|&(t, rss)| CpuSample { t_ns: t, rss_bytes: rss, pss_bytes: None, uss_bytes: None, process_count: 1 })
            .collect();
        let torch: Vec<TorchSample> = [(99, 500), (120, 7), (201, 600)]
            .iter()
            .map(|&(t, a)| TorchSample {
                t_ns: t,
                device: 0,
                allocated_bytes: a,
                reserved_bytes: a,
                peak_allocated_bytes: a,
                peak_reserved_bytes: a,
                active_bytes: a,
                inactive_split_bytes: 0,
            })
            .collect();
        assert_eq!(span_peaks(sp, &torch, &cpu), (Some(7), Some(7), Some(30)));
    }

    #[test]
    fn growth_is_flagged_with_its_rate() {
        let s = Summary::from_markers(&leaky_run(4, 8 * MIB), None);
        assert_eq!(s.growth.len(), 1, "{:?}", s.growth);
        assert_eq!(s.growth[0].per_unit_bytes, 8 * MIB as i64);
        assert!(s.growth[0].message.contains("+8.0 MiB per epoch"), "{}", s.growth[0].message);
        assert_eq!(detect_growth(&[1, 2], 0), None);
        assert_eq!(detect_growth(&[10, 20, 15, 30], 1), None);
    }

    #[test]
    fn journey_orders_marks_phases_peak_cleanup() {
        let mut m = vec![Marker {
            t_ns: 0,
            kind: MarkerKind::Mark,
            edge: Edge::Point,
            name: "Device checked".into(),
            index: None,
            memory: MarkerMemory { allocated_bytes: Some(0), reserved_bytes: Some(0), ..Default::default() },
        }];
        m.extend(leaky_run(2, 0));
        m.push(Marker {
            t_ns: 900,
            kind: MarkerKind::Mark,
            edge: Edge::Point,
            name: "Cache emptied".into(),
            index: None,
            memory: MarkerMemory::default(),
        });
        m.push(Marker {
            t_ns: 1000,
            kind: MarkerKind::Mark,
            edge: Edge::Point,
            name: "Cache emptied".into(),
            index: None,
            memory: MarkerMemory {
                allocated_bytes: Some(10 * MIB),
                reserved_bytes: Some(10 * MIB),
                ..Default::default()
            },
        });
        let j = journey(&m, Some(1000 * MIB), &[], &[]);
        let names: Vec<&str> = j.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["Device checked", "forward", "backward", "Peak", "Cache emptied"]);
        assert_eq!(j[3].allocated_bytes, Some(80 * MIB));
    }
}
