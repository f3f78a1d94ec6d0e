//! Spans: start and end markers paired into epochs, steps and phases, per process (pid, rank), and the
//! highest memory inside one span.

use serde::Serialize;

use crate::fold::EpochTracker;
use crate::model::*;

/// One epoch, step or phase: a matched start and end marker, borrowed from the markers (a long run has many
/// spans: they must not copy what the markers hold).
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
    /// The process that marked it (the start's).
    pub origin: Origin,
    /// The GPU the start marker read (NVML index), None for CPU only.
    pub device: Option<u32>,
    /// The epoch open in that process when the span started (an epoch span: its own index).
    pub epoch: Option<i64>,
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

/// Pairs start and end markers into spans: an end closes the latest open start of the same process (pid,
/// rank), kind and name, so two processes marking "forward" at the same time never pair with each other.
/// Nesting is allowed; a start without end stays open.
pub fn spans(markers: &[Marker]) -> Vec<Span<'_>> {
    let mut out: Vec<Span<'_>> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    let mut epochs = EpochTracker::default();
    for m in markers {
        epochs.observe(m);
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
                    origin: m.origin,
                    device: m.device,
                    epoch: epochs.current(&m.origin),
                });
                open.push(out.len() - 1);
            }
            Edge::End => {
                let stream = m.origin.stream();
                if let Some(pos) = open.iter().rposition(|&i| {
                    out[i].kind == m.kind && out[i].name == m.name.as_str() && out[i].origin.stream() == stream
                }) {
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

/// Highest allocated/reserved/RSS inside a span: the exit marker's exact peak where the API measured it,
/// otherwise the highest sample inside the span's time range (the allocator samples of the span's own GPU
/// and process only).
pub fn span_peaks(span: &Span, torch: &[TorchSample], cpu: &[CpuSample]) -> (Option<u64>, Option<u64>, Option<u64>) {
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
    let same_source = |s: &TorchSample| {
        span.device.is_none_or(|d| d == s.device)
            && (span.origin.pid.is_none() || s.origin.pid.is_none() || span.origin.pid == s.origin.pid)
    };
    if exit.peak_allocated_bytes.is_none() {
        let r = range(&|i| torch[i].t_ns, torch.len());
        for s in torch[r].iter().filter(|s| inside(s.t_ns) && same_source(s)) {
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
