//! The memory journey of a run: named marks in order, the first forward/backward/optimizer phases, the peak,
//! the cleanup stages.

use super::peaks::max_by;
use super::spans::{span_peaks, spans, Span};
use crate::journey::{JourneySection, JourneyStage, PressureOn};
use crate::model::*;

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
    let section_of = |name: &str| -> JourneySection {
        let n = name.to_ascii_lowercase();
        if n.contains("cache") || n.contains("clean") || n.contains("end") {
            JourneySection::Cleanup
        } else if n.contains("device") || n.contains("model") || n.contains("init") || n.contains("start") {
            JourneySection::Setup
        } else {
            JourneySection::Training
        }
    };
    let stage = |name: String, mem: &MarkerMemory, peak: bool| JourneyStage {
        section: section_of(&name),
        name,
        allocated_bytes: if peak { mem.peak_allocated_bytes.or(mem.allocated_bytes) } else { mem.allocated_bytes },
        reserved_bytes: if peak { mem.peak_reserved_bytes.or(mem.reserved_bytes) } else { mem.reserved_bytes },
        rss_bytes: if peak { mem.peak_rss_bytes.or(mem.rss_bytes) } else { mem.rss_bytes },
        capacity_bytes,
        measure: PressureOn::Any,
    };
    let mut phases_done: Vec<&str> = Vec::new();
    let mut peak_inserted = false;
    let mut items: Vec<(u64, JourneyStage)> = Vec::new();
    // A journey is a path, not a log: a mark repeated every epoch appears once, the first time, except a cache
    // mark ("Cache emptied"), which shows its last time: the state the run was left in.
    let mut marks_done: Vec<(&str, usize)> = Vec::new();
    for m in markers.iter().filter(|m| m.kind == MarkerKind::Mark && m.edge == Edge::Point) {
        let item = (m.t_ns, stage(m.name.clone(), &m.memory, false));
        match marks_done.iter().find(|(name, _)| *name == m.name) {
            None => {
                marks_done.push((&m.name, items.len()));
                items.push(item);
            }
            Some(&(_, at)) if m.name.to_ascii_lowercase().contains("cache") => items[at] = item,
            Some(_) => {}
        }
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
        st.section = JourneySection::Training;
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
        section: JourneySection::Training,
        allocated_bytes: opt_max(peak_alloc.map(|p| p.bytes), marker_peak_alloc),
        reserved_bytes: opt_max(peak_reserved, marker_peak_reserved),
        rss_bytes: opt_max(peak_rss.map(|p| p.bytes), marker_peak_rss),
        capacity_bytes,
        measure: PressureOn::Any,
    };
    for (_, st) in items {
        if !peak_inserted && st.section == JourneySection::Cleanup {
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
        s.measure = if gpu_run { PressureOn::Gpu } else { PressureOn::Cpu };
    }
    stages
}
