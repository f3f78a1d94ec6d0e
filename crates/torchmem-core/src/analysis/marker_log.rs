//! The in-process Monitor's record of a run: the markers it keeps and exact aggregates of the ones it does
//! not. Markers arrive one by one (the Python hooks push each as it is made); the keep-or-fold rule is the
//! recorder's (`fold::SpanFolder`: the first `keep_spans` occurrences of each step and phase keep their
//! markers, later ones fold into `SpanAggregate` rows), so a Monitor's tables are computed as a profile's
//! are (`Summary::build` over kept markers plus aggregates) and its memory stays flat however long the run.

use crate::breakdown::BreakdownAggregate;
use crate::fold::SpanFolder;
use crate::model::{Edge, Marker, MarkerKind};

use super::Summary;

/// Kept markers, in arrival order, and the folder holding the rest.
#[derive(Clone)]
pub struct MarkerLog {
    folder: SpanFolder,
    markers: Vec<Marker>,
    steps_started: u64,
}

impl MarkerLog {
    /// `keep_spans`: how many occurrences of each step and phase name keep their markers (None: all).
    pub fn new(keep_spans: Option<u64>) -> MarkerLog {
        MarkerLog { folder: SpanFolder::new(keep_spans.unwrap_or(u64::MAX)), markers: Vec::new(), steps_started: 0 }
    }

    /// Takes one marker; true when it is kept as a marker (else its span is folded into an aggregate).
    pub fn push(&mut self, m: Marker) -> bool {
        if m.kind == MarkerKind::Step && m.edge == Edge::Start {
            self.steps_started += 1;
        }
        match self.folder.push(m) {
            Some(kept) => {
                self.markers.push(kept);
                true
            }
            None => false,
        }
    }

    pub fn markers(&self) -> &[Marker] {
        &self.markers
    }

    /// Steps started so far (finished or not, kept or folded).
    pub fn steps_started(&self) -> u64 {
        self.steps_started
    }

    /// The summary over every marker pushed: epochs, steps, phases, breakdown, growth, journey.
    pub fn summary(&self, capacity_bytes: Option<u64>) -> Summary {
        let aggregates = self.folder.aggregates_so_far();
        let breakdowns: Vec<BreakdownAggregate> = self.folder.breakdown_aggregates();
        Summary::from_folded_markers(&self.markers, capacity_bytes, &aggregates, &breakdowns)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::MIB;
    use super::*;

    fn mk(t: u64, kind: MarkerKind, edge: Edge, name: &str, alloc: u64, peak: Option<u64>) -> Marker {
        super::super::tests::mk(t, kind, edge, name, None, alloc, peak)
    }

    /// Two epochs of `steps` steps, each with a forward and a backward phase; step 7 of epoch 1 peaks high.
    fn run(steps: u64) -> Vec<Marker> {
        let mut v = vec![mk(0, MarkerKind::Mark, Edge::Point, "Device checked", 0, None)];
        let mut t = 1;
        for e in 0..2 {
            v.push(Marker { index: Some(e), ..mk(t, MarkerKind::Epoch, Edge::Start, "epoch", 10 * MIB, None) });
            for s in 0..steps {
                let high = if e == 1 && s == 7 { 900 * MIB } else { 60 * MIB };
                v.push(mk(t + 1, MarkerKind::Step, Edge::Start, "step", 10 * MIB, None));
                v.push(mk(t + 2, MarkerKind::Phase, Edge::Start, "forward", 10 * MIB, None));
                v.push(mk(t + 5, MarkerKind::Phase, Edge::End, "forward", 50 * MIB, Some(high)));
                v.push(mk(t + 6, MarkerKind::Phase, Edge::Start, "backward", 50 * MIB, None));
                v.push(mk(t + 9, MarkerKind::Phase, Edge::End, "backward", 10 * MIB, Some(70 * MIB)));
                v.push(mk(t + 10, MarkerKind::Step, Edge::End, "step", 10 * MIB, Some(high.max(70 * MIB))));
                t += 10;
            }
            v.push(Marker { index: Some(e), ..mk(t + 1, MarkerKind::Epoch, Edge::End, "epoch", 10 * MIB, None) });
            t += 2;
        }
        v.push(mk(t + 1, MarkerKind::Mark, Edge::Point, "Cache emptied", 10 * MIB, None));
        v.push(mk(t + 2, MarkerKind::Mark, Edge::Point, "Device checked", 10 * MIB, None));
        v.push(mk(t + 3, MarkerKind::Mark, Edge::Point, "Cache emptied", 5 * MIB, None));
        v
    }

    #[test]
    fn a_log_that_folds_gives_the_tables_of_one_that_keeps_everything() {
        let mut all = MarkerLog::new(None);
        let mut few = MarkerLog::new(Some(3));
        for m in run(20) {
            all.push(m.clone());
            few.push(m);
        }
        assert!(few.markers().len() < all.markers().len() / 4, "the folding log stays small");
        let (a, f) = (all.summary(None), few.summary(None));
        assert_eq!(f.phases, a.phases);
        assert_eq!(f.steps, 40);
        assert_eq!(f.steps, a.steps);
        assert_eq!(f.epochs, a.epochs, "epoch rows, with their step counts, are exact too");
        assert_eq!(f.epochs[1].steps, Some(20));
        assert_eq!(few.steps_started(), 40);
        let peak = |s: &Summary| s.journey.iter().find(|st| st.name == "Peak").and_then(|st| st.allocated_bytes);
        assert_eq!(peak(&f), Some(900 * MIB), "a folded step's peak still raises the journey's peak");
        assert_eq!(peak(&f), peak(&a));
    }

    #[test]
    fn open_spans_count_with_their_entry_values() {
        let mut few = MarkerLog::new(Some(1));
        for m in run(3) {
            few.push(m);
        }
        few.push(mk(1000, MarkerKind::Step, Edge::Start, "step", 10 * MIB, None));
        few.push(mk(1001, MarkerKind::Phase, Edge::Start, "forward", 950 * MIB, None));
        let s = few.summary(None);
        assert_eq!(s.steps, 7);
        assert_eq!(s.phases[0].count, 7);
        assert_eq!(s.phases[0].max_peak_allocated_bytes, Some(950 * MIB));
        // Asking does not close them: the step and phase end later as usual.
        few.push(mk(1002, MarkerKind::Phase, Edge::End, "forward", 20 * MIB, Some(960 * MIB)));
        assert_eq!(few.summary(None).phases[0].max_peak_allocated_bytes, Some(960 * MIB));
    }

    #[test]
    fn the_journey_takes_each_point_once() {
        let mut log = MarkerLog::new(None);
        for m in run(2) {
            log.push(m);
        }
        let points: Vec<(String, Option<u64>)> = log
            .summary(None)
            .journey
            .iter()
            .filter(|st| st.name != "Peak" && !["forward", "backward"].contains(&st.name.as_str()))
            .map(|st| (st.name.clone(), st.allocated_bytes.map(|b| b / MIB)))
            .collect();
        // "Device checked" its first time (0), "Cache emptied" its last (5 MiB).
        assert_eq!(points, [("Device checked".to_string(), Some(0)), ("Cache emptied".to_string(), Some(5))]);
    }
}
