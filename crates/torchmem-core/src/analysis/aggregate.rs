//! Exact totals over spans that are partly kept as markers and partly folded into `SpanAggregate` rows:
//! `SpanTotals` adds both kinds into one sum (counts, durations, delta sums, peaks), so a table computed
//! from kept spans plus aggregates equals the table computed from every marker (the recorder's, the
//! loader's and the in-process Monitor's `MarkerLog` folding alike).

use super::spans::{span_peaks, Span};
use super::tables::PhaseRow;
use crate::model::*;

impl SpanTotals {
    /// Adds one kept span (its peaks as `span_peaks` reads them).
    pub fn add_span(&mut self, s: &Span, torch: &[TorchSample], cpu: &[CpuSample]) {
        self.count += 1;
        if let Some(d) = s.duration_ns() {
            self.total_ns += d;
            self.min_ns = Some(self.min_ns.map_or(d, |m| m.min(d)));
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
        self.merge(&a.totals);
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
