//! Turns a loaded profile (or a list of markers from the in-process Monitor) into the facts the reports
//! show: peaks (`peaks`), spans paired per process (`spans`), per-epoch, per-phase and per-process tables
//! (`tables`) over kept spans plus folded aggregates (`aggregate`), growth ("leak") warnings (`growth`) and
//! the memory journey (`journey`). It reads `model` types only: the profile's storage is not its business.

mod aggregate;
pub mod breakdown;
mod growth;
mod journey;
pub mod leaks;
mod marker_log;
mod peaks;
pub mod ranks;
mod spans;
mod tables;

use std::collections::HashMap;

use serde::Serialize;

pub use crate::model::SpanTotals;
pub use breakdown::{breakdown_summary, BreakdownSummary};
pub use growth::{detect_growth, growth_by_process, growth_warnings, Growth, GrowthSeries, GrowthUnit};
pub use journey::{journey, journey_of_spans};
pub use leaks::{leak_findings, leaks_of_blobs, Leak, LeakReport, StepGrowth, StepGrowthDetector};
pub use marker_log::MarkerLog;
pub use peaks::{devices, gpu_peaks, GpuPeak, PeakAt, Peaks};
pub use spans::{span_peaks, spans, Span};
pub use tables::{epoch_rows, epoch_totals, phase_rows, process_rows, EpochRow, EpochTotalRow, PhaseRow, ProcessRow};

use crate::journey::JourneyStage;
use crate::model::*;

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
    /// Per process and epoch: the steps and each phase (count, total and extreme durations).
    pub epoch_totals: Vec<EpochTotalRow>,
    pub processes: Vec<ProcessRow>,
    pub growth: Vec<Growth>,
    /// What the memory is (parameters, gradients, optimizer state, activations, …): `breakdown`.
    pub breakdown: BreakdownSummary,
    /// Lines that keep memory alive step after step (`leaks::Leak`): a profile's `leaks` blobs, or what a
    /// Monitor's probe found.
    pub leaks: Vec<Leak>,
    pub journey: Vec<JourneyStage>,
}

/// One epoch of one process: (pid, rank, epoch index).
type EpochOf = (Option<u32>, Option<u32>, Option<i64>);

/// What a summary is computed from, borrowed (a Monitor's markers need no copied profile around them).
struct Inputs<'a> {
    meta: &'a RunMeta,
    cpu: &'a [CpuSample],
    processes: &'a [ProcessInfo],
    process_samples: &'a [ProcessSample],
    gpu: &'a [GpuSample],
    torch: &'a [TorchSample],
    markers: &'a [Marker],
    aggregates: &'a [SpanAggregate],
    breakdown_aggregates: &'a [BreakdownAggregate],
}

/// Raises the journey's "Peak" stage to values the kept markers may not show.
fn raise_peak_stage(journey: &mut [JourneyStage], alloc: Option<u64>, reserved: Option<u64>, rss: Option<u64>) {
    if let Some(peak) = journey.iter_mut().find(|st| st.name == "Peak") {
        peak.allocated_bytes = opt_max(peak.allocated_bytes, alloc);
        peak.reserved_bytes = opt_max(peak.reserved_bytes, reserved);
        peak.rss_bytes = opt_max(peak.rss_bytes, rss);
    }
}

impl Summary {
    pub fn from_profile(p: &Profile) -> Summary {
        let mut s = Summary::build(&Inputs {
            meta: &p.meta,
            cpu: &p.cpu,
            processes: &p.processes,
            process_samples: &p.process_samples,
            gpu: &p.gpu,
            torch: &p.torch,
            markers: &p.markers,
            aggregates: &p.aggregates,
            breakdown_aggregates: &p.breakdown_aggregates,
        });
        s.leaks = leaks_of_blobs(&p.blobs);
        s
    }

    fn build(p: &Inputs) -> Summary {
        let sp = spans(p.markers);
        let totals = epoch_totals(&sp, p.aggregates);
        let mut epochs = epoch_rows(&sp, MarkerKind::Epoch, p.torch, p.cpu, p.markers);
        // (pid, rank, epoch) -> steps started in it
        let mut steps_in: HashMap<EpochOf, u64> = HashMap::new();
        for t in totals.iter().filter(|t| t.kind == MarkerKind::Step) {
            *steps_in.entry((t.pid, t.rank, t.epoch)).or_default() += t.count;
        }
        for row in &mut epochs {
            row.steps = Some(steps_in.get(&(row.pid, row.rank, Some(row.index))).copied().unwrap_or(0));
        }
        let step_rows = epoch_rows(&sp, MarkerKind::Step, p.torch, p.cpu, &[]);
        let steps = step_rows.len() as u64
            + p.aggregates.iter().filter(|a| a.kind == MarkerKind::Step).map(|a| a.totals.count).sum::<u64>();
        let mut growth = growth_by_process(&epochs, GrowthUnit::Epoch);
        if growth.is_empty() && step_rows.len() >= 5 {
            growth = growth_by_process(&step_rows, GrowthUnit::Step);
        }
        let gpus = gpu_peaks(p.meta, p.torch, p.gpu, p.markers, p.aggregates);
        let rss = peaks::max_by(p.cpu, |s| Some(s.rss_bytes), |s| s.t_ns);
        let capacity = gpus
            .first()
            .and_then(|g| if g.allocated_bytes.is_some() { g.total_bytes } else { None })
            .or(p.meta.host_total_bytes);
        let mut journey = journey_of_spans(p.markers, &sp, capacity, p.torch, p.cpu);
        let agg_peak = |f: fn(&SpanAggregate) -> Option<u64>| p.aggregates.iter().filter_map(f).max();
        raise_peak_stage(
            &mut journey,
            agg_peak(|a| a.totals.peak_allocated_bytes),
            agg_peak(|a| a.totals.peak_reserved_bytes),
            agg_peak(|a| a.totals.peak_rss_bytes),
        );
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
            steps: steps as usize,
            phases: phase_rows(&sp, p.aggregates, p.torch, p.cpu),
            epoch_totals: totals,
            processes: process_rows(p.processes, p.process_samples),
            growth,
            breakdown: breakdown_summary(p.markers, p.breakdown_aggregates, p.gpu, p.torch),
            leaks: Vec::new(),
            journey,
        }
    }

    /// A summary of markers alone: what the in-process Monitor has (no sampler timeline).
    pub fn from_markers(markers: &[Marker], capacity_bytes: Option<u64>) -> Summary {
        Summary::from_folded_markers(markers, capacity_bytes, &[], &[])
    }

    /// A summary of kept markers and the aggregates of folded ones, without samples (`MarkerLog`'s).
    pub fn from_folded_markers(
        markers: &[Marker],
        capacity_bytes: Option<u64>,
        aggregates: &[SpanAggregate],
        breakdown_aggregates: &[BreakdownAggregate],
    ) -> Summary {
        // Without samples the journey's yardstick is `host_total_bytes`, i.e. `capacity_bytes`.
        let meta = RunMeta { host_total_bytes: capacity_bytes, ..Default::default() };
        Summary::build(&Inputs {
            meta: &meta,
            cpu: &[],
            processes: &[],
            process_samples: &[],
            gpu: &[],
            torch: &[],
            markers,
            aggregates,
            breakdown_aggregates,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const MIB: u64 = 1 << 20;

    /// A marker with allocated `alloc`, reserved twice that and 100 MiB RSS (also `marker_log`'s tests).
    pub(super) fn mk(
        t: u64,
        kind: MarkerKind,
        edge: Edge,
        name: &str,
        idx: Option<i64>,
        alloc: u64,
        peak: Option<u64>,
    ) -> Marker {
        Marker {
            index: idx,
            memory: MarkerMemory {
                allocated_bytes: Some(alloc),
                reserved_bytes: Some(alloc * 2),
                rss_bytes: Some(100 * MIB),
                peak_allocated_bytes: peak,
                ..Default::default()
            },
            ..Marker::new(t, kind, edge, name)
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
        let bare = |t, edge| Marker::new(t, MarkerKind::Phase, edge, "p");
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
                origin: Default::default(),
            })
            .collect();
        assert_eq!(span_peaks(sp, &torch, &cpu), (Some(7), Some(7), Some(30)));
    }

    #[test]
    fn growth_is_flagged_with_its_rate() {
        let s = Summary::from_markers(&leaky_run(4, 8 * MIB), None);
        assert_eq!(s.growth.len(), 1, "{:?}", s.growth);
        assert_eq!(s.growth[0].per_unit_bytes, 8 * MIB as i64);
        let message = crate::report::findings::growth_message(&s.growth[0]);
        assert!(message.contains("+8.0 MiB per epoch"), "{message}");
        assert_eq!(detect_growth(&[1, 2], 0), None);
        assert_eq!(detect_growth(&[10, 20, 15, 30], 1), None);
    }

    /// A CPU run of `epochs` epochs, each ending at `end_rss[e]` MiB (RSS and RSS less malloc's free bytes as
    /// `held[e]`), followed by `torchmem.empty_cache()`'s mark at `emptied[e]` MiB where given.
    fn cpu_epochs(end_rss: &[u64], held: &[u64], emptied: &[u64]) -> Vec<Marker> {
        let cpu = |t, kind, edge, name: &str, idx, rss: u64, held: Option<u64>| Marker {
            index: idx,
            memory: MarkerMemory {
                rss_bytes: Some(rss * MIB),
                held_rss_bytes: held.map(|h| h * MIB),
                ..Default::default()
            },
            ..Marker::new(t, kind, edge, name)
        };
        let mut v = Vec::new();
        for (e, (&rss, &h)) in end_rss.iter().zip(held).enumerate() {
            let t = 10 * e as u64;
            v.push(cpu(t, MarkerKind::Epoch, Edge::Start, "epoch", Some(e as i64), rss - 40, None));
            v.push(cpu(t + 5, MarkerKind::Epoch, Edge::End, "epoch", Some(e as i64), rss, Some(h)));
            if let Some(&after) = emptied.get(e) {
                v.push(cpu(t + 6, MarkerKind::Mark, Edge::Point, CACHE_EMPTIED_MARK, None, after, None));
            }
        }
        v
    }

    #[test]
    fn growth_judges_the_rss_left_after_each_epochs_empty_cache() {
        // Measured, examples/train.py --leak on the CPU (empty_cache() after each epoch): the epoch ends' RSS less
        // malloc's free bytes rose by as little as 7 MiB in an epoch (the trims leave pages malloc counts free out
        // of RSS), while the RSS right after each trim rose 50-51 MiB every epoch.
        let leak = cpu_epochs(&[804, 840, 896, 951], &[762, 796, 835, 864], &[762, 813, 863, 914]);
        let s = Summary::from_markers(&leak, None);
        assert_eq!(s.growth.len(), 1, "{:?}", s.growth);
        let g = &s.growth[0];
        assert_eq!((g.what, g.units), (GrowthSeries::CpuRssAfterEmptyCache, 4));
        assert_eq!(g.per_unit_bytes, (914 - 762) * MIB as i64 / 3);
        assert!(crate::report::findings::growth_message(g).starts_with("CPU RSS after empty_cache() grew every epoch"));
        // The Monitor judges at an epoch's end, before that epoch's empty_cache(): the marks so far count.
        let live = cpu_epochs(&[804, 840, 896, 951], &[762, 796, 835, 864], &[762, 813, 863]);
        assert_eq!(Summary::from_markers(&live, None).growth[0].what, GrowthSeries::CpuRssAfterEmptyCache);
        // Healthy (measured: the same script without --leak): after each trim RSS is flat to 1 MiB, whatever the
        // epoch ends did. A series with fewer than 3 marks, or a gap, leaves the epoch ends' series to judge.
        let healthy = cpu_epochs(&[741, 761, 781, 801], &[712, 732, 752, 772], &[712, 712, 713, 712]);
        assert!(Summary::from_markers(&healthy, None).growth.is_empty());
        let gap = cpu_epochs(&[741, 766, 792, 818], &[712, 737, 763, 789], &[712, 712]);
        assert_eq!(Summary::from_markers(&gap, None).growth[0].what, GrowthSeries::CpuRss, "held RSS rose every epoch");
    }

    #[test]
    fn journey_orders_marks_phases_peak_cleanup() {
        let mut m = vec![Marker {
            memory: MarkerMemory { allocated_bytes: Some(0), reserved_bytes: Some(0), ..Default::default() },
            ..Marker::new(0, MarkerKind::Mark, Edge::Point, "Device checked")
        }];
        m.extend(leaky_run(2, 0));
        m.push(Marker::new(900, MarkerKind::Mark, Edge::Point, "Cache emptied"));
        m.push(Marker {
            memory: MarkerMemory {
                allocated_bytes: Some(10 * MIB),
                reserved_bytes: Some(10 * MIB),
                ..Default::default()
            },
            ..Marker::new(1000, MarkerKind::Mark, Edge::Point, "Cache emptied")
        });
        let j = journey(&m, Some(1000 * MIB), &[], &[]);
        let names: Vec<&str> = j.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["Device checked", "forward", "backward", "Peak", "Cache emptied"]);
        assert_eq!(j[3].allocated_bytes, Some(80 * MIB));
    }

    fn of(pid: u32, mut m: Marker) -> Marker {
        m.origin = Origin { pid: Some(pid), rank: Some(pid - 1), ..Default::default() };
        m
    }

    #[test]
    fn two_processes_marking_the_same_phase_at_once_never_cross_pair() {
        // Process 1's forward runs 0..50, process 2's 10..100: by (kind, name) alone process 1's end (at 50)
        // would close the latest start, process 2's.
        let m = vec![
            of(1, mk(0, MarkerKind::Phase, Edge::Start, "forward", None, 0, None)),
            of(2, mk(10, MarkerKind::Phase, Edge::Start, "forward", None, 0, None)),
            of(1, mk(50, MarkerKind::Phase, Edge::End, "forward", None, 0, None)),
            of(2, mk(100, MarkerKind::Phase, Edge::End, "forward", None, 0, None)),
        ];
        let sp = spans(&m);
        let by_pid = |pid| sp.iter().find(|s| s.origin.pid == Some(pid)).unwrap();
        assert_eq!((by_pid(1).start_t_ns, by_pid(1).end_t_ns), (0, Some(50)));
        assert_eq!((by_pid(2).start_t_ns, by_pid(2).end_t_ns), (10, Some(100)));
        let s = Summary::from_markers(&m, None);
        let per_pid: Vec<(Option<u32>, u64, Option<u64>)> =
            s.epoch_totals.iter().map(|t| (t.pid, t.total_ns, t.max_ns)).collect();
        assert_eq!(per_pid, [(Some(1), 50, Some(50)), (Some(2), 90, Some(90))]);
    }

    #[test]
    fn a_marker_counts_for_the_gpu_it_read_only() {
        let torch = |device: u32, t: u64| TorchSample {
            t_ns: t,
            device,
            allocated_bytes: MIB,
            reserved_bytes: 2 * MIB,
            peak_allocated_bytes: MIB,
            peak_reserved_bytes: 2 * MIB,
            active_bytes: MIB,
            inactive_split_bytes: 0,
            origin: Origin::default(),
        };
        let mut end = mk(20, MarkerKind::Phase, Edge::End, "forward", None, 500 * MIB, Some(900 * MIB));
        end.device = Some(1);
        end.memory.peak_reserved_bytes = Some(1000 * MIB);
        let mut start = mk(10, MarkerKind::Phase, Edge::Start, "forward", None, 400 * MIB, None);
        start.device = Some(1);
        let p = Profile { torch: vec![torch(0, 5), torch(1, 5)], markers: vec![start, end], ..Default::default() };
        let s = Summary::from_profile(&p);
        let gpu = |d: u32| s.peak.gpus.iter().find(|g| g.device == d).unwrap();
        assert_eq!((gpu(0).allocated_bytes, gpu(0).reserved_bytes), (Some(MIB), Some(2 * MIB)));
        assert_eq!((gpu(1).allocated_bytes, gpu(1).reserved_bytes), (Some(900 * MIB), Some(1000 * MIB)));
    }

    /// Two processes, 3 epochs of 40 steps with forward and backward each, some memory movement.
    fn long_run() -> Vec<Marker> {
        let mut v = Vec::new();
        let mut t = 0u64;
        for e in 0..3i64 {
            for pid in [7u32, 8] {
                v.push(of(pid, mk(t, MarkerKind::Epoch, Edge::Start, "epoch", Some(e), 0, None)));
            }
            for step in 0..40u64 {
                for pid in [7u32, 8] {
                    let a = (step * 3 + pid as u64) * MIB;
                    let d = step % 7 + pid as u64;
                    v.push(of(pid, mk(t + 1, MarkerKind::Step, Edge::Start, "step", Some(step as i64), a, None)));
                    v.push(of(pid, mk(t + 2, MarkerKind::Phase, Edge::Start, "forward", None, a, None)));
                    v.push(of(pid, mk(t + 3 + d, MarkerKind::Phase, Edge::End, "forward", None, a + d, Some(a + 9))));
                    v.push(of(pid, mk(t + 20, MarkerKind::Phase, Edge::Start, "backward", None, a + d, None)));
                    v.push(of(pid, mk(t + 21 + d * 2, MarkerKind::Phase, Edge::End, "backward", None, a, Some(a + 5))));
                    v.push(of(pid, mk(t + 50, MarkerKind::Step, Edge::End, "step", Some(step as i64), a, Some(a + 9))));
                }
                t += 60;
            }
            for pid in [7u32, 8] {
                v.push(of(pid, mk(t, MarkerKind::Epoch, Edge::End, "epoch", Some(e), 0, None)));
            }
            t += 5;
        }
        // A step still running when the run ended.
        v.push(of(7, mk(t + 1, MarkerKind::Step, Edge::Start, "step", None, 0, None)));
        v
    }

    #[test]
    fn kept_markers_plus_folded_rows_give_the_totals_of_all_markers() {
        let all = long_run();
        let full = Summary::from_markers(&all, None);
        let mut folder = crate::fold::SpanFolder::new(3);
        let kept: Vec<Marker> = all.iter().cloned().filter_map(|m| folder.push(m)).collect();
        folder.finish();
        let aggregates = folder.into_aggregates();
        assert!(kept.len() < all.len() / 5, "{} of {}", kept.len(), all.len());
        let p = Profile { markers: kept, aggregates, ..Default::default() };
        let folded = Summary::from_profile(&p);
        assert_eq!(folded.phases, full.phases);
        assert_eq!(folded.epoch_totals, full.epoch_totals);
        assert_eq!(folded.epochs, full.epochs);
        assert_eq!(folded.steps, full.steps);
        assert_eq!(full.steps, 2 * 3 * 40 + 1);
        assert_eq!(full.epochs.iter().map(|e| e.steps).collect::<Vec<_>>(), [Some(40); 6]);
        // Per process: epochs are their own series.
        assert_eq!(full.epochs.iter().filter(|e| e.pid == Some(8)).count(), 3);
    }
}
