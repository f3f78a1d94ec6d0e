//! The report's tables: per-epoch (or per-step) rows, per-phase rows, per-epoch totals of every step and
//! phase, and per-process peaks. Phase and epoch totals merge kept spans with folded `SpanAggregate` rows, so
//! they are exact however many markers the recorder folded.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use super::spans::{span_peaks, Span};
use crate::model::*;

/// One row of the per-epoch (or per-step) table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochRow {
    pub index: i64,
    /// The process (and rank) whose epoch it is: each process of a distributed run has its own epochs.
    pub pid: Option<u32>,
    pub rank: Option<u32>,
    pub duration_ns: Option<u64>,
    /// Steps that started inside this epoch (kept and folded); None where not counted (the per-step table,
    /// and the in-process Monitor's summary, whose aggregates are not per epoch).
    pub steps: Option<u64>,
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub rss_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
    /// End-of-epoch RSS less malloc's free bytes (`MarkerMemory::held_rss_bytes`): the series the growth
    /// warning judges on the CPU when every epoch has it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub held_rss_bytes: Option<u64>,
    /// RSS at the first "Cache emptied" mark (`torchmem.empty_cache()`, read after `malloc_trim`) of the same
    /// process after this span's end and before its next span of the kind starts: the series the growth
    /// warning judges on the CPU when the program empties the cache after every epoch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rss_after_emptied_cache_bytes: Option<u64>,
    /// End-of-epoch allocated (GPU) minus the same process's previous epoch's; RSS on CPU-only runs.
    pub growth_allocated_bytes: Option<i64>,
    pub growth_rss_bytes: Option<i64>,
}

/// Per-phase aggregate over all its occurrences (e.g. every "forward"), in every process.
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

/// The steps or one phase of one epoch of one process: how many, and how long in total.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochTotalRow {
    pub pid: Option<u32>,
    pub rank: Option<u32>,
    /// None: outside any epoch.
    pub epoch: Option<i64>,
    pub kind: MarkerKind,
    pub name: String,
    pub count: u64,
    pub total_ns: u64,
    pub min_ns: Option<u64>,
    pub max_ns: Option<u64>,
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

/// One row per span of `kind`, in start order; growth is against the same process's previous row. `markers`:
/// where the "Cache emptied" marks are looked up (`EpochRow::rss_after_emptied_cache_bytes`).
pub fn epoch_rows(
    spans: &[Span],
    kind: MarkerKind,
    torch: &[TorchSample],
    cpu: &[CpuSample],
    markers: &[Marker],
) -> Vec<EpochRow> {
    let emptied: Vec<&Marker> =
        markers.iter().filter(|m| m.kind == MarkerKind::Mark && m.name == CACHE_EMPTIED_MARK).collect();
    let of_kind: Vec<&Span> = spans.iter().filter(|s| s.kind == kind).collect();
    let rss_after_emptied = |i: usize| -> Option<u64> {
        let s = of_kind[i];
        let (end, stream) = (s.end_t_ns?, s.origin.stream());
        let next_start = of_kind[i + 1..].iter().find(|n| n.origin.stream() == stream).map(|n| n.start_t_ns);
        emptied
            .iter()
            .find(|m| m.t_ns >= end && next_start.is_none_or(|n| m.t_ns <= n) && m.origin.stream() == stream)
            .and_then(|m| m.memory.rss_bytes)
    };
    let mut rows: Vec<EpochRow> = Vec::new();
    let mut last_of: HashMap<(Option<u32>, Option<u32>), (usize, usize)> = HashMap::new();
    for (i, s) in of_kind.iter().enumerate() {
        let stream = s.origin.stream();
        let (n, prev) = match last_of.get(&stream) {
            Some(&(n, i)) => (n, Some(&rows[i])),
            None => (0, None),
        };
        let (pa, pr, prss) = span_peaks(s, torch, cpu);
        let exit = s.exit;
        let allocated = exit.and_then(|e| e.allocated_bytes);
        let rss = exit.and_then(|e| e.rss_bytes);
        let growth = |now: Option<u64>, before: Option<u64>| Some(now? as i64 - before? as i64);
        let row = EpochRow {
            index: s.index.unwrap_or(n as i64),
            pid: s.origin.pid,
            rank: s.origin.rank,
            duration_ns: s.duration_ns(),
            steps: None,
            allocated_bytes: allocated,
            reserved_bytes: exit.and_then(|e| e.reserved_bytes),
            peak_allocated_bytes: pa,
            peak_reserved_bytes: pr,
            rss_bytes: rss,
            peak_rss_bytes: prss,
            held_rss_bytes: exit.and_then(|e| e.held_rss_bytes),
            rss_after_emptied_cache_bytes: if emptied.is_empty() { None } else { rss_after_emptied(i) },
            growth_allocated_bytes: growth(allocated, prev.and_then(|p| p.allocated_bytes)),
            growth_rss_bytes: growth(rss, prev.and_then(|p| p.rss_bytes)),
        };
        rows.push(row);
        last_of.insert(stream, (n + 1, rows.len() - 1));
    }
    rows
}

/// One row per phase name, over kept spans and folded rows, in order of the name's first start.
pub fn phase_rows(
    spans: &[Span],
    aggregates: &[SpanAggregate],
    torch: &[TorchSample],
    cpu: &[CpuSample],
) -> Vec<PhaseRow> {
    let mut first: Vec<(u64, &str)> = Vec::new();
    let mut totals: HashMap<&str, SpanTotals> = HashMap::new();
    for s in spans.iter().filter(|s| s.kind == MarkerKind::Phase) {
        let t = totals.entry(s.name).or_insert_with(|| {
            first.push((s.start_t_ns, s.name));
            SpanTotals::default()
        });
        t.add_span(s, torch, cpu);
    }
    for a in aggregates.iter().filter(|a| a.kind == MarkerKind::Phase) {
        let t = totals.entry(a.name.as_str()).or_insert_with(|| {
            first.push((a.first_start_t_ns, a.name.as_str()));
            SpanTotals::default()
        });
        t.add_aggregate(a);
    }
    first.sort();
    first.into_iter().map(|(_, name)| totals[name].phase_row(name)).collect()
}

/// Per process and epoch, the steps and each phase: count and durations over kept spans and folded rows.
pub fn epoch_totals(spans: &[Span], aggregates: &[SpanAggregate]) -> Vec<EpochTotalRow> {
    type Key = (Option<u32>, Option<u32>, Option<i64>, MarkerKind, String);
    let mut totals: BTreeMap<Key, (u64, SpanTotals)> = BTreeMap::new();
    let wanted = |k: MarkerKind| k == MarkerKind::Step || k == MarkerKind::Phase;
    for s in spans.iter().filter(|s| wanted(s.kind)) {
        let key = (s.origin.pid, s.origin.rank, s.epoch, s.kind, s.name.to_string());
        let e = totals.entry(key).or_insert((s.start_t_ns, SpanTotals::default()));
        e.0 = e.0.min(s.start_t_ns);
        e.1.count += 1;
        if let Some(d) = s.duration_ns() {
            e.1.total_ns += d;
            e.1.min_ns = Some(e.1.min_ns.map_or(d, |m| m.min(d)));
            e.1.max_ns = opt_max(e.1.max_ns, Some(d));
        }
    }
    for a in aggregates.iter().filter(|a| wanted(a.kind)) {
        let key = (a.origin.pid, a.origin.rank, a.epoch, a.kind, a.name.clone());
        let e = totals.entry(key).or_insert((a.first_start_t_ns, SpanTotals::default()));
        e.0 = e.0.min(a.first_start_t_ns);
        e.1.count += a.totals.count;
        e.1.total_ns += a.totals.total_ns;
        e.1.min_ns = match (e.1.min_ns, a.totals.min_ns) {
            (Some(x), Some(y)) => Some(x.min(y)),
            (x, y) => x.or(y),
        };
        e.1.max_ns = opt_max(e.1.max_ns, a.totals.max_ns);
    }
    let mut rows: Vec<(u64, EpochTotalRow)> = totals
        .into_iter()
        .map(|((pid, rank, epoch, kind, name), (first_t_ns, t))| {
            let row = EpochTotalRow {
                pid,
                rank,
                epoch,
                kind,
                name,
                count: t.count,
                total_ns: t.total_ns,
                min_ns: t.min_ns,
                max_ns: t.max_ns,
            };
            (first_t_ns, row)
        })
        .collect();
    // Grouped by process and epoch, names in the order they first ran.
    rows.sort_by_key(|(t, r)| (r.pid, r.rank, r.epoch, *t));
    rows.into_iter().map(|(_, r)| r).collect()
}

/// Per-process peaks from the slower per-process samples.
pub fn process_rows(processes: &[ProcessInfo], samples: &[ProcessSample]) -> Vec<ProcessRow> {
    let mut by_pid: HashMap<u32, Vec<&ProcessSample>> = HashMap::new();
    for s in samples {
        by_pid.entry(s.pid).or_default().push(s);
    }
    processes
        .iter()
        .map(|info| {
            let samples = by_pid.get(&info.pid).map(Vec::as_slice).unwrap_or(&[]);
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
        .collect()
}
