//! Exact totals over spans that are partly kept as markers and partly folded into `SpanAggregate` rows:
//! `SpanTotals` adds both kinds into one sum (counts, durations, delta sums, peaks), so a table computed
//! from kept spans plus aggregates equals the table computed from every marker (the recorder's, the
//! loader's and the in-process Monitor's `MarkerLog` folding alike).

use super::spans::{span_peaks, Span};
use super::tables::PhaseRow;
use crate::model::*;

/// Running totals of some spans.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpanTotals {
    pub count: u64,
    pub total_ns: u64,
    pub min_ns: Option<u64>,
    pub max_ns: Option<u64>,
    pub delta_allocated_sum_bytes: i64,
    pub delta_allocated_count: u64,
    pub delta_rss_sum_bytes: i64,
    pub delta_rss_count: u64,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub peak_rss_bytes: Option<u64>,
}

fn opt_min(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

impl SpanTotals {
    /// Adds one kept span (its peaks as `span_peaks` reads them).
    pub fn add_span(&mut self, s: &Span, torch: &[TorchSample], cpu: &[CpuSample]) {
        self.count += 1;
        if let Some(d) = s.duration_ns() {
            self.total_ns += d;
            self.min_ns = opt_min(self.min_ns, Some(d));
            self.max_ns = opt_max(self.max_ns, Some(d));
        }
        if let Some(d) = s.delta_allocated() {
            self.delta_allocated_sum_bytes += d;
            self.delta_allocated_count += 1;
        }
        if let Some(d) = s.delta_rss() {
            self.delta_rss_sum_bytes += d;
            self.delta_rss_count += 1;
        }
        let (a, r, c) = span_peaks(s, torch, cpu);
        self.peak_allocated_bytes = opt_max(self.peak_allocated_bytes, a);
        self.peak_reserved_bytes = opt_max(self.peak_reserved_bytes, r);
        self.peak_rss_bytes = opt_max(self.peak_rss_bytes, c);
    }

    /// Adds one row of folded spans.
    pub fn add_aggregate(&mut self, a: &SpanAggregate) {
        self.count += a.count;
        self.total_ns += a.total_ns;
        self.min_ns = opt_min(self.min_ns, a.min_ns);
        self.max_ns = opt_max(self.max_ns, a.max_ns);
        self.delta_allocated_sum_bytes += a.delta_allocated_sum_bytes;
        self.delta_allocated_count += a.delta_allocated_count;
        self.delta_rss_sum_bytes += a.delta_rss_sum_bytes;
        self.delta_rss_count += a.delta_rss_count;
        self.peak_allocated_bytes = opt_max(self.peak_allocated_bytes, a.peak_allocated_bytes);
        self.peak_reserved_bytes = opt_max(self.peak_reserved_bytes, a.peak_reserved_bytes);
        self.peak_rss_bytes = opt_max(self.peak_rss_bytes, a.peak_rss_bytes);
    }

    /// The phase-table row (means rounded toward zero, as integer division of the sums).
    pub fn phase_row(&self, name: &str) -> PhaseRow {
        let mean = |sum: i64, n: u64| (n > 0).then(|| sum / n as i64);
        PhaseRow {
            name: name.to_string(),
            count: self.count,
            total_ns: self.total_ns,
            mean_delta_allocated_bytes: mean(self.delta_allocated_sum_bytes, self.delta_allocated_count),
            max_peak_allocated_bytes: self.peak_allocated_bytes,
            max_peak_reserved_bytes: self.peak_reserved_bytes,
            mean_delta_rss_bytes: mean(self.delta_rss_sum_bytes, self.delta_rss_count),
            max_peak_rss_bytes: self.peak_rss_bytes,
        }
    }
}
