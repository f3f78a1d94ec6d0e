//! The one rule that keeps a long, fast run small: of each (pid, rank, kind, name) step or phase, the
//! markers of the first `keep_spans` occurrences are kept; every later occurrence is folded into an exact
//! `SpanAggregate` (count, durations, deltas, peaks) per epoch and device. Epoch and mark markers are
//! always kept. The recorder applies it as markers arrive (so the file stays small), and the loader applies
//! it again while streaming the markers out of SQLite (so a v1 file of millions of markers loads in bounded
//! memory); on a file that is already folded it changes nothing. The in-process Monitor keeps the same
//! rule (`keep_markers`: the first N occurrences of each step and phase name keep their markers).

use std::collections::{HashMap, HashSet};

use crate::breakdown::{boundary_of, BreakdownAggregate, BreakdownKey};
use crate::model::{opt_max, AggregateKey, Edge, Marker, MarkerKind, MarkerMemory, Origin, SpanAggregate, SpanTotals};

/// How many occurrences of each step and phase keep their markers unless told otherwise.
pub const DEFAULT_KEEP_SPANS: u64 = 100;
/// The most occurrences the reader keeps as markers, whatever the recorder kept (`--keep-spans` above this
/// keeps more in the file, for SQL): reading stays bounded however long the run.
pub const MAX_KEEP_SPANS_READ: u64 = 1000;

type Stream = (Option<u32>, Option<u32>);

/// Which epoch is open in each process: a span belongs to the epoch open (in its own process) when it
/// starts. An epoch start without an index gets the number of epochs that process started before it.
#[derive(Debug, Clone, Default)]
pub struct EpochTracker {
    streams: HashMap<Stream, (Option<i64>, i64)>,
}

impl EpochTracker {
    /// Follows one marker (only epoch markers change anything).
    pub fn observe(&mut self, m: &Marker) {
        if m.kind != MarkerKind::Epoch {
            return;
        }
        let st = self.streams.entry(m.origin.stream()).or_insert((None, 0));
        match m.edge {
            Edge::Start => {
                st.0 = Some(m.index.unwrap_or(st.1));
                st.1 += 1;
            }
            Edge::End => st.0 = None,
            Edge::Point => {}
        }
    }

    /// The epoch open now in process `origin`, if any.
    pub fn current(&self, origin: &Origin) -> Option<i64> {
        self.streams.get(&origin.stream()).and_then(|s| s.0)
    }
}

#[derive(Clone)]
struct OpenSpan {
    kept: bool,
    t_ns: u64,
    entry: MarkerMemory,
    epoch: Option<i64>,
    device: Option<u32>,
    origin: Origin,
}

#[derive(Clone, Default)]
struct SpanStream {
    started: u64,
    open: Vec<OpenSpan>,
}

/// Applies the keep-or-fold rule to a stream of markers in time order.
#[derive(Clone)]
pub struct SpanFolder {
    keep_spans: u64,
    streams: HashMap<(Option<u32>, Option<u32>, MarkerKind, String), SpanStream>,
    epochs: EpochTracker,
    aggregates: HashMap<AggregateKey, SpanAggregate>,
    dirty: HashSet<AggregateKey>,
    /// The breakdowns (`Marker::breakdown`) of the folded markers, per (pid, rank, boundary, device).
    breakdowns: HashMap<BreakdownKey, BreakdownAggregate>,
    dirty_breakdowns: HashSet<BreakdownKey>,
}

impl SpanFolder {
    pub fn new(keep_spans: u64) -> Self {
        SpanFolder {
            keep_spans,
            streams: HashMap::new(),
            epochs: EpochTracker::default(),
            aggregates: HashMap::new(),
            dirty: HashSet::new(),
            breakdowns: HashMap::new(),
            dirty_breakdowns: HashSet::new(),
        }
    }

    /// Takes one marker: gives it back when it is kept, folds it (None) otherwise. A span is kept or folded
    /// whole: its end goes where its start went. An end without a start is kept (analysis ignores it).
    pub fn push(&mut self, m: Marker) -> Option<Marker> {
        match (m.kind, m.edge) {
            (MarkerKind::Epoch, _) => {
                self.epochs.observe(&m);
                return Some(m);
            }
            (MarkerKind::Mark, _) | (_, Edge::Point) => return Some(m),
            _ => {}
        }
        let key = (m.origin.pid, m.origin.rank, m.kind, m.name.clone());
        if m.edge == Edge::Start {
            let epoch = self.epochs.current(&m.origin);
            let stream = self.streams.entry(key).or_default();
            let kept = stream.started < self.keep_spans;
            stream.started += 1;
            stream.open.push(OpenSpan {
                kept,
                t_ns: m.t_ns,
                entry: if kept { MarkerMemory::default() } else { m.memory.clone() },
                epoch,
                device: m.device,
                origin: m.origin,
            });
            if !kept {
                self.fold_breakdown(&m);
            }
            return kept.then_some(m);
        }
        let open = self.streams.get_mut(&key).and_then(|s| s.open.pop());
        match open {
            None => Some(m),
            Some(o) if o.kept => Some(m),
            Some(o) => {
                self.fold_breakdown(&m);
                self.fold(m.kind, m.name, o, Some((m.t_ns, &m.memory)));
                None
            }
        }
    }

    /// A folded marker's breakdown joins its boundary's exact aggregate (the marker itself is dropped).
    fn fold_breakdown(&mut self, m: &Marker) {
        let Some(entries) = &m.breakdown else { return };
        let boundary = boundary_of(m);
        for b in entries {
            let key: BreakdownKey = (m.origin.pid, m.origin.rank, boundary.clone(), b.device.clone());
            self.breakdowns
                .entry(key.clone())
                .or_insert_with(|| BreakdownAggregate::new(m.origin, boundary.clone(), b.device.clone()))
                .add(b);
            self.dirty_breakdowns.insert(key);
        }
    }

    /// The breakdown rows changed since the last call, with their totals so far (like `take_dirty`).
    pub fn take_dirty_breakdowns(&mut self) -> Vec<BreakdownAggregate> {
        let mut rows: Vec<BreakdownAggregate> =
            self.dirty_breakdowns.drain().filter_map(|k| self.breakdowns.get(&k).cloned()).collect();
        rows.sort_by_key(BreakdownAggregate::key);
        rows
    }

    /// Every breakdown row, in key order.
    pub fn breakdown_aggregates(&self) -> Vec<BreakdownAggregate> {
        let mut rows: Vec<BreakdownAggregate> = self.breakdowns.values().cloned().collect();
        rows.sort_by_key(BreakdownAggregate::key);
        rows
    }

    fn fold(&mut self, kind: MarkerKind, name: String, o: OpenSpan, end: Option<(u64, &MarkerMemory)>) {
        let key: AggregateKey = (o.origin.pid, o.origin.rank, kind, name, o.epoch, o.device);
        let a = self.aggregates.entry(key.clone()).or_insert_with(|| SpanAggregate {
            origin: o.origin,
            kind,
            name: key.3.clone(),
            epoch: o.epoch,
            device: o.device,
            totals: SpanTotals::default(),
            open_count: 0,
            first_start_t_ns: o.t_ns,
            last_end_t_ns: None,
        });
        a.totals.count += 1;
        a.first_start_t_ns = a.first_start_t_ns.min(o.t_ns);
        let entry = &o.entry;
        match end {
            Some((end_t_ns, exit)) => {
                let d = end_t_ns.saturating_sub(o.t_ns);
                a.totals.total_ns += d;
                a.totals.min_ns = Some(a.totals.min_ns.map_or(d, |m| m.min(d)));
                a.totals.max_ns = Some(a.totals.max_ns.map_or(d, |m| m.max(d)));
                a.last_end_t_ns = opt_max(a.last_end_t_ns, Some(end_t_ns));
                if let (Some(x), Some(n)) = (exit.allocated_bytes, entry.allocated_bytes) {
                    a.totals.delta_allocated_sum_bytes += x as i64 - n as i64;
                    a.totals.delta_allocated_count += 1;
                }
                if let (Some(x), Some(n)) = (exit.rss_bytes, entry.rss_bytes) {
                    a.totals.delta_rss_sum_bytes += x as i64 - n as i64;
                    a.totals.delta_rss_count += 1;
                }
                // As `analysis::span_peaks` reads a span from its markers: the exit's peak, else the exit's or
                // the entry's value.
                let peak = |p: Option<u64>, x: Option<u64>, n: Option<u64>| opt_max(p, opt_max(x, n));
                a.totals.peak_allocated_bytes = opt_max(
                    a.totals.peak_allocated_bytes,
                    peak(exit.peak_allocated_bytes, exit.allocated_bytes, entry.allocated_bytes),
                );
                a.totals.peak_reserved_bytes = opt_max(
                    a.totals.peak_reserved_bytes,
                    peak(exit.peak_reserved_bytes, exit.reserved_bytes, entry.reserved_bytes),
                );
                a.totals.peak_rss_bytes =
                    opt_max(a.totals.peak_rss_bytes, peak(exit.peak_rss_bytes, exit.rss_bytes, entry.rss_bytes));
            }
            None => {
                a.open_count += 1;
                a.totals.peak_allocated_bytes = opt_max(a.totals.peak_allocated_bytes, entry.allocated_bytes);
                a.totals.peak_reserved_bytes = opt_max(a.totals.peak_reserved_bytes, entry.reserved_bytes);
                a.totals.peak_rss_bytes = opt_max(a.totals.peak_rss_bytes, entry.rss_bytes);
            }
        }
        self.dirty.insert(key);
    }

    /// The rows changed since the last call, with their totals so far (the recorder writes them with each
    /// commit, replacing the row's previous totals).
    pub fn take_dirty(&mut self) -> Vec<SpanAggregate> {
        let mut rows: Vec<SpanAggregate> =
            self.dirty.drain().filter_map(|k| self.aggregates.get(&k).cloned()).collect();
        rows.sort_by_key(SpanAggregate::key);
        rows
    }

    /// The recording ended: folded spans still open count (entry values only); kept ones stay open markers.
    pub fn finish(&mut self) {
        let mut open: Vec<(MarkerKind, String, OpenSpan)> = Vec::new();
        for ((_, _, kind, name), s) in self.streams.iter_mut() {
            open.extend(s.open.drain(..).filter(|o| !o.kept).map(|o| (*kind, name.clone(), o)));
        }
        for (kind, name, o) in open {
            self.fold(kind, name, o, None);
        }
    }

    /// Every aggregate row so far, in key order, with the folded spans still open counted as `finish` would
    /// count them (the folder itself goes on: the in-process Monitor asks for tables mid-run).
    pub fn aggregates_so_far(&self) -> Vec<SpanAggregate> {
        let mut done = self.clone();
        done.finish();
        done.into_aggregates()
    }

    /// Every aggregate row, in key order.
    pub fn into_aggregates(self) -> Vec<SpanAggregate> {
        let mut rows: Vec<SpanAggregate> = self.aggregates.into_values().collect();
        rows.sort_by_key(SpanAggregate::key);
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mk(t: u64, pid: u32, kind: MarkerKind, edge: Edge, name: &str, idx: Option<i64>, rss: u64) -> Marker {
        Marker {
            index: idx,
            memory: MarkerMemory { rss_bytes: Some(rss), ..Default::default() },
            origin: Origin { pid: Some(pid), ..Default::default() },
            ..Marker::new(t, kind, edge, name)
        }
    }

    #[test]
    fn keeps_the_first_spans_of_each_process_and_folds_the_rest_per_epoch() {
        let mut f = SpanFolder::new(2);
        let mut kept = Vec::new();
        let mut t = 0;
        for pid in [1, 2] {
            for e in 0..2 {
                kept.extend(f.push(mk(t, pid, MarkerKind::Epoch, Edge::Start, "epoch", Some(e), 0)));
                for _ in 0..5 {
                    kept.extend(f.push(mk(t + 1, pid, MarkerKind::Phase, Edge::Start, "forward", None, 100)));
                    kept.extend(f.push(mk(t + 4, pid, MarkerKind::Phase, Edge::End, "forward", None, 110)));
                    t += 10;
                }
                kept.extend(f.push(mk(t, pid, MarkerKind::Epoch, Edge::End, "epoch", Some(e), 0)));
            }
        }
        kept.extend(f.push(mk(t, 1, MarkerKind::Phase, Edge::Start, "forward", None, 200)));
        f.finish();
        // Per process: 4 epoch markers + the first 2 forwards (4 markers).
        assert_eq!(kept.len(), 2 * (4 + 4));
        let rows = f.into_aggregates();
        let of = |pid: u32, e: Option<i64>| rows.iter().find(|r| r.origin.pid == Some(pid) && r.epoch == e);
        assert_eq!(of(1, Some(0)).unwrap().totals.count, 3);
        assert_eq!(of(1, Some(1)).unwrap().totals.count, 5);
        assert_eq!(of(2, Some(1)).unwrap().totals.total_ns, 15);
        assert_eq!(of(2, Some(1)).unwrap().totals.delta_rss_sum_bytes, 50);
        let open = of(1, None).unwrap();
        assert_eq!((open.totals.count, open.open_count, open.totals.peak_rss_bytes), (1, 1, Some(200)));
    }
}
