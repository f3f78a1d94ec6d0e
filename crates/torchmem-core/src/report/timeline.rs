//! The memory timeline prepared for drawing (`torchmem plot`): every series (CPU RSS; per GPU PyTorch
//! allocated, reserved and NVML) downsampled into one bucket per pixel column keeping each bucket's minimum
//! and maximum, so a peak is never lost however long the run; and epochs and phases as bands, one label per
//! bucket (the one that covers most of it), so a run with 100 000 steps still draws a few hundred rectangles.

use crate::analysis::{spans, Span};
use crate::model::MarkerKind;
use crate::model::Profile;
use crate::report::csv::devices;

/// Minimum and maximum of a series per time bucket (`None` where the bucket holds no sample).
#[derive(Debug, Clone, PartialEq)]
pub struct Buckets {
    pub min: Vec<Option<u64>>,
    pub max: Vec<Option<u64>>,
    /// Whether the bucket's maximum came before its minimum (the order a line visits them).
    pub max_first: Vec<bool>,
    /// The bucket's last value: what memory holds until the next sample (the timeline is a step function,
    /// and the recorder stores an unchanged reading only now and then).
    pub last: Vec<Option<u64>>,
}

/// One line of the chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub color: &'static str,
    /// SVG dash pattern (GPUs after the first are dashed), None for solid.
    pub dash: Option<&'static str>,
    pub buckets: Buckets,
    /// Samples before downsampling.
    pub samples: usize,
}

/// A time range with a label: an epoch, or a run of buckets dominated by one phase.
#[derive(Debug, Clone, PartialEq)]
pub struct Band {
    pub start_ns: u64,
    pub end_ns: u64,
    pub label: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// The time axis runs from 0 to `t_end_ns`, cut into `n` equal buckets.
    pub t_end_ns: u64,
    pub n: usize,
    pub series: Vec<Series>,
    pub epochs: Vec<Band>,
    pub phases: Vec<Band>,
    /// The phase lane as drawn: per run of pixel columns, each phase's share of the time.
    pub phase_mix: Vec<MixBand>,
    /// Phase names in order of first appearance (their colour is their position here).
    pub phase_names: Vec<String>,
    /// Which CPU line to trust, when the tree had several processes and PSS was sampled.
    pub cpu_note: Option<String>,
}

pub const CPU_RSS_COLOR: &str = "#1f77b4";
pub const CPU_PSS_COLOR: &str = "#c51b7d";
pub const ALLOCATED_COLOR: &str = "#d62728";
pub const RESERVED_COLOR: &str = "#ff7f0e";
pub const NVML_COLOR: &str = "#2ca02c";
/// Phase lane colours, distinct from the series colours.
pub const PHASE_COLORS: [&str; 8] =
    ["#9467bd", "#17becf", "#e377c2", "#bcbd22", "#8c564b", "#7f7f7f", "#393b79", "#637939"];
const DEVICE_DASHES: [Option<&str>; 4] = [None, Some("6 3"), Some("2 2"), Some("8 3 2 3")];

/// Which of `n` equal buckets of [0, t_end_ns] the time `t_ns` falls in (the last one holds t_end_ns).
pub fn bucket_of(t_ns: u64, t_end_ns: u64, n: usize) -> usize {
    if t_end_ns == 0 || n == 0 {
        return 0;
    }
    ((t_ns as u128 * n as u128 / t_end_ns as u128) as usize).min(n - 1)
}

/// Start time of bucket `k`.
pub fn bucket_start_ns(k: usize, t_end_ns: u64, n: usize) -> u64 {
    if n == 0 {
        return 0;
    }
    (k as u128 * t_end_ns as u128 / n as u128) as u64
}

/// Min/max per bucket of time-ordered `(t_ns, bytes)` points.
pub fn downsample(points: impl Iterator<Item = (u64, u64)>, t_end_ns: u64, n: usize) -> Buckets {
    let mut b = Buckets { min: vec![None; n], max: vec![None; n], max_first: vec![false; n], last: vec![None; n] };
    let mut min_seq = vec![0usize; n];
    let mut max_seq = vec![0usize; n];
    for (seq, (t, v)) in points.enumerate() {
        let k = bucket_of(t, t_end_ns, n);
        b.last[k] = Some(v);
        if b.min[k].is_none_or(|m| v < m) {
            b.min[k] = Some(v);
            min_seq[k] = seq;
        }
        if b.max[k].is_none_or(|m| v > m) {
            b.max[k] = Some(v);
            max_seq[k] = seq;
        }
    }
    for k in 0..n {
        b.max_first[k] = max_seq[k] < min_seq[k];
    }
    b
}

/// How long each span covers each bucket (the innermost span where spans nest): per bucket, (span, ns).
fn coverage(list: &[&Span], t_end_ns: u64, n: usize) -> Vec<Vec<(usize, u64)>> {
    let mut cover: Vec<Vec<(usize, u64)>> = vec![Vec::new(); n];
    if list.is_empty() || n == 0 || t_end_ns == 0 {
        return cover;
    }
    // Events (time, is_start, span): at equal times ends come first.
    let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(list.len() * 2);
    for (i, s) in list.iter().enumerate() {
        let end = s.end_t_ns.unwrap_or(t_end_ns).max(s.start_t_ns);
        events.push((s.start_t_ns, true, i));
        events.push((end, false, i));
    }
    events.sort_by_key(|&(t, start, i)| (t, start, i));
    let mut stack: Vec<usize> = Vec::new();
    let mut prev_t = 0u64;
    let mut add = |a: u64, b: u64, span: usize| {
        let a = a.min(t_end_ns);
        let b = b.min(t_end_ns);
        if b <= a {
            // A zero-length span still marks its bucket, with the smallest weight.
            if b == a {
                let k = bucket_of(a, t_end_ns, n);
                if cover[k].is_empty() {
                    cover[k].push((span, 0));
                }
            }
            return;
        }
        for (k, slot) in
            cover.iter_mut().enumerate().take(bucket_of(b - 1, t_end_ns, n) + 1).skip(bucket_of(a, t_end_ns, n))
        {
            let lo = bucket_start_ns(k, t_end_ns, n).max(a);
            let hi = bucket_start_ns(k + 1, t_end_ns, n).min(b);
            let ns = hi.saturating_sub(lo);
            match slot.iter_mut().find(|(s, _)| *s == span) {
                Some(e) => e.1 += ns,
                None => slot.push((span, ns)),
            }
        }
    };
    for (t, is_start, i) in events {
        if let Some(&top) = stack.last() {
            add(prev_t, t, top);
        }
        prev_t = t;
        if is_start {
            stack.push(i);
        } else if let Some(pos) = stack.iter().rposition(|&s| s == i) {
            stack.remove(pos);
            if t == list[i].start_t_ns {
                add(t, t, i);
            }
        }
    }
    cover
}

/// One bucket's coverage summed per key: (key, ns, first span with that key), in first-seen order.
fn by_key(slot: &[(usize, u64)], key: &impl Fn(usize) -> String) -> Vec<(String, u64, usize)> {
    let mut out: Vec<(String, u64, usize)> = Vec::new();
    for &(span, ns) in slot {
        let kk = key(span);
        match out.iter_mut().find(|(x, _, _)| *x == kk) {
            Some(e) => e.1 += ns,
            None => out.push((kk, ns, span)),
        }
    }
    out
}

/// Labels each bucket with the span that covers most of it (the innermost one where spans nest), then merges
/// runs of buckets with the same key into bands. `key` says which spans count as the same band.
fn lane(
    list: &[&Span],
    t_end_ns: u64,
    n: usize,
    key: impl Fn(usize) -> String,
    label: impl Fn(usize) -> String,
) -> Vec<Band> {
    let cover = coverage(list, t_end_ns, n);
    let mut bands: Vec<(String, Band)> = Vec::new();
    for (k, slot) in cover.iter().enumerate() {
        let Some((kk, _, span)) = by_key(slot, &key).into_iter().max_by_key(|(_, ns, _)| *ns) else {
            continue;
        };
        let start = bucket_start_ns(k, t_end_ns, n);
        let end = bucket_start_ns(k + 1, t_end_ns, n);
        match bands.last_mut() {
            Some((last_key, b)) if *last_key == kk && b.end_ns == start => b.end_ns = end,
            _ => bands.push((kk, Band { start_ns: start, end_ns: end, label: label(span) })),
        }
    }
    bands.into_iter().map(|(_, b)| b).collect()
}

/// How many steps the phase lane's height is cut into: each phase's share of a pixel column is drawn
/// as a stack of this many steps (2 px each on the standard chart).
pub const MIX_LEVELS: u32 = 7;

/// A run of pixel columns where phases share the time in the same proportions (in `MIX_LEVELS` steps).
#[derive(Debug, Clone, PartialEq)]
pub struct MixBand {
    pub start_ns: u64,
    pub end_ns: u64,
    /// (phase, steps of `MIX_LEVELS`, percent of the columns' time), innermost phases, in the order they
    /// first appear in the run.
    /// A phase present at all gets at least one step, so a short optimizer step stays visible.
    pub parts: Vec<(String, u32, u32)>,
}

/// Each bucket's phase mix, quantized to `MIX_LEVELS` steps, merged over runs of equal mixes.
fn mix_lane(list: &[&Span], t_end_ns: u64, n: usize) -> Vec<MixBand> {
    let cover = coverage(list, t_end_ns, n);
    let key = |i: usize| list[i].name.to_string();
    // Stack order: the order in which phases first appear in the run, the same in every column.
    let mut order: Vec<&str> = Vec::new();
    for sp in list {
        if !order.contains(&sp.name) {
            order.push(sp.name);
        }
    }
    let rank = |name: &str| order.iter().position(|o| *o == name).unwrap_or(usize::MAX);
    let mut out: Vec<MixBand> = Vec::new();
    for (k, slot) in cover.iter().enumerate() {
        let start = bucket_start_ns(k, t_end_ns, n);
        let end = bucket_start_ns(k + 1, t_end_ns, n);
        let width = end.saturating_sub(start).max(1);
        let mut shares = by_key(slot, &key);
        shares.sort_by_key(|sh| rank(&sh.0));
        if shares.is_empty() {
            continue;
        }
        let total: u64 = shares.iter().map(|s| s.1).sum();
        // Steps for the covered part of the column; every phase present gets at least one.
        let covered_levels = if total == 0 {
            1
        } else {
            ((total as f64 / width as f64 * MIX_LEVELS as f64).round() as u32).clamp(1, MIX_LEVELS)
        };
        let mut parts: Vec<(String, u32, u32)> = shares
            .iter()
            .map(|(name, ns, _)| {
                let frac = if total == 0 { 1.0 / shares.len() as f64 } else { *ns as f64 / total as f64 };
                let pct = (*ns as f64 * 100.0 / width as f64).round() as u32;
                (name.clone(), ((frac * covered_levels as f64).floor() as u32).max(1), pct)
            })
            .collect();
        // Rounding: give or take steps at the largest phase so the stack is `covered_levels` high (or
        // higher only where each phase present needs its one step).
        let sum: u32 = parts.iter().map(|p| p.1).sum();
        if let Some(big) = parts.iter_mut().max_by_key(|p| p.1) {
            if sum < covered_levels {
                big.1 += covered_levels - sum;
            } else if sum > covered_levels && big.1 > 1 {
                big.1 -= (sum - covered_levels).min(big.1 - 1);
            }
        }
        let same = |b: &MixBand| {
            b.end_ns == start
                && b.parts.len() == parts.len()
                && b.parts.iter().zip(&parts).all(|(a, p)| a.0 == p.0 && a.1 == p.1)
        };
        match out.last_mut() {
            Some(b) if same(b) => {
                // Percentages of a merged band: the time-weighted mean over its columns.
                let w_old = (b.end_ns - b.start_ns) as f64;
                let w_new = (end - start) as f64;
                for (a, p) in b.parts.iter_mut().zip(&parts) {
                    a.2 = ((a.2 as f64 * w_old + p.2 as f64 * w_new) / (w_old + w_new)).round() as u32;
                }
                b.end_ns = end;
            }
            _ => out.push(MixBand { start_ns: start, end_ns: end, parts }),
        }
    }
    out
}

/// The end of the time axis: the run's duration, or the last thing recorded.
pub fn time_end_ns(profile: &Profile) -> u64 {
    let last = [
        profile.cpu.last().map(|s| s.t_ns),
        profile.torch.last().map(|s| s.t_ns),
        profile.gpu.last().map(|s| s.t_ns),
        profile.markers.iter().map(|m| m.t_ns).max(),
        profile.meta.duration_ns,
    ];
    last.into_iter().flatten().max().unwrap_or(0).max(1)
}

impl Timeline {
    /// Builds the timeline of a profile with `n` buckets (one per pixel column of the chart).
    pub fn build(profile: &Profile, n: usize) -> Timeline {
        let n = n.max(1);
        let t_end = time_end_ns(profile);
        let mut series = Vec::new();
        if !profile.cpu.is_empty() {
            series.push(Series {
                label: "CPU RSS".into(),
                color: CPU_RSS_COLOR,
                dash: None,
                buckets: downsample(profile.cpu.iter().map(|s| (s.t_ns, s.rss_bytes)), t_end, n),
                samples: profile.cpu.len(),
            });
        }
        // Forked processes (DataLoader workers) share the parent's pages, and RSS counts a shared page once
        // per process: the tree's RSS can be several times its real memory. PSS splits shared pages.
        let pss: Vec<(u64, u64)> = profile.cpu.iter().filter_map(|s| Some((s.t_ns, s.pss_bytes?))).collect();
        let max_processes = profile.cpu.iter().map(|s| s.process_count).max().unwrap_or(0);
        let mut cpu_note = None;
        if max_processes > 1 && !pss.is_empty() {
            series.push(Series {
                label: "CPU PSS".into(),
                color: CPU_PSS_COLOR,
                dash: None,
                buckets: downsample(pss.iter().copied(), t_end, n),
                samples: pss.len(),
            });
            cpu_note = Some(format!(
                "CPU: up to {max_processes} processes. RSS counts a page they share (e.g. forked DataLoader workers) once per process; PSS splits it: trust PSS ({} samples).",
                pss.len()
            ));
        }
        let devs = devices(profile);
        for (i, &d) in devs.iter().enumerate() {
            let prefix = if devs.len() == 1 { "GPU".to_string() } else { format!("GPU{d}") };
            let dash = DEVICE_DASHES[i % DEVICE_DASHES.len()];
            let torch: Vec<(u64, u64, u64)> = profile
                .torch
                .iter()
                .filter(|s| s.device == d)
                .map(|s| (s.t_ns, s.allocated_bytes, s.reserved_bytes))
                .collect();
            if !torch.is_empty() {
                series.push(Series {
                    label: format!("{prefix} allocated"),
                    color: ALLOCATED_COLOR,
                    dash,
                    buckets: downsample(torch.iter().map(|s| (s.0, s.1)), t_end, n),
                    samples: torch.len(),
                });
                series.push(Series {
                    label: format!("{prefix} reserved"),
                    color: RESERVED_COLOR,
                    dash,
                    buckets: downsample(torch.iter().map(|s| (s.0, s.2)), t_end, n),
                    samples: torch.len(),
                });
            }
            let nvml: Vec<_> = profile.gpu.iter().filter(|s| s.device == d).collect();
            let per_process: Vec<(u64, u64)> = nvml.iter().filter_map(|s| Some((s.t_ns, s.process_bytes?))).collect();
            if !per_process.is_empty() {
                series.push(Series {
                    label: format!("{prefix} NVML (profiled processes)"),
                    color: NVML_COLOR,
                    dash,
                    buckets: downsample(per_process.iter().copied(), t_end, n),
                    samples: per_process.len(),
                });
            } else if !nvml.is_empty() {
                series.push(Series {
                    label: format!("{prefix} NVML (whole device)"),
                    color: NVML_COLOR,
                    dash,
                    buckets: downsample(nvml.iter().map(|s| (s.t_ns, s.used_bytes)), t_end, n),
                    samples: nvml.len(),
                });
            }
        }
        let all = spans(&profile.markers);
        let epochs: Vec<&Span> = all.iter().filter(|s| s.kind == MarkerKind::Epoch).collect();
        let phases: Vec<&Span> = all.iter().filter(|s| s.kind == MarkerKind::Phase).collect();
        let mut phase_names: Vec<String> = Vec::new();
        for p in &phases {
            if !phase_names.iter().any(|n| n == p.name) {
                phase_names.push(p.name.to_string());
            }
        }
        let epoch_label = |i: usize| match epochs[i].index {
            Some(x) => format!("epoch {x}"),
            None => format!("epoch {i}"),
        };
        let mut epoch_bands = lane(&epochs, t_end, n, |i| i.to_string(), epoch_label);
        // Each epoch band carries its peak: PyTorch's allocated memory on a GPU run, else the tree's RSS.
        let peak_series = series
            .iter()
            .find(|s| s.label.ends_with("allocated"))
            .or_else(|| series.iter().find(|s| s.label == "CPU RSS"));
        if let Some(se) = peak_series {
            for b in &mut epoch_bands {
                let k0 = bucket_of(b.start_ns, t_end, n);
                let k1 = bucket_of(b.end_ns.saturating_sub(1).max(b.start_ns), t_end, n).max(k0);
                if let Some(m) = se.buckets.max[k0..=k1].iter().flatten().max() {
                    b.label = format!("{} (peak {} {})", b.label, se.label, crate::units::format_bytes(*m));
                }
            }
        }
        Timeline {
            t_end_ns: t_end,
            n,
            series,
            epochs: epoch_bands,
            phases: lane(&phases, t_end, n, |i| phases[i].name.to_string(), |i| phases[i].name.to_string()),
            phase_mix: mix_lane(&phases, t_end, n),
            phase_names,
            cpu_note,
        }
    }

    /// The highest value of any series.
    pub fn max_bytes(&self) -> u64 {
        self.series.iter().flat_map(|s| s.buckets.max.iter().flatten()).copied().max().unwrap_or(0)
    }

    /// A phase's lane colour.
    pub fn phase_color(&self, name: &str) -> &'static str {
        let i = self.phase_names.iter().position(|p| p == name).unwrap_or(0);
        PHASE_COLORS[i % PHASE_COLORS.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    #[test]
    fn downsampling_keeps_every_peak() {
        // 1 hour at 100 Hz with one 1-sample spike: it must survive into 1000 buckets.
        let n_samples = 360_000u64;
        let t_end = n_samples * 10_000_000;
        let points = (0..n_samples).map(|i| (i * 10_000_000, if i == 123_457 { 9_000 } else { 100 + i % 7 }));
        let b = downsample(points, t_end, 1000);
        assert_eq!(b.max.iter().flatten().copied().max(), Some(9_000));
        assert_eq!(b.min.iter().flatten().copied().min(), Some(100));
        let k = bucket_of(123_457 * 10_000_000, t_end, 1000);
        assert_eq!(b.max[k], Some(9_000));
        assert_eq!(b.last[999], Some(100 + (n_samples - 1) % 7));
        assert!(b.max.iter().all(|m| m.is_some()));
    }

    #[test]
    fn bucket_edges() {
        assert_eq!(bucket_of(0, 100, 10), 0);
        assert_eq!(bucket_of(99, 100, 10), 9);
        assert_eq!(bucket_of(100, 100, 10), 9);
        assert_eq!(bucket_of(250, 100, 10), 9);
        assert_eq!(bucket_start_ns(3, 100, 10), 30);
    }

    fn marker(t: u64, kind: MarkerKind, edge: Edge, name: &str, index: Option<i64>) -> Marker {
        Marker { index, ..Marker::new(t, kind, edge, name) }
    }

    #[test]
    fn many_phases_become_a_bounded_lane_and_nesting_shows_the_inner_one() {
        let mut p = Profile::default();
        // 10 000 steps of forward (6 ms) + backward (4 ms) inside one "train" phase.
        p.markers.push(marker(0, MarkerKind::Phase, Edge::Start, "train", None));
        for s in 0..10_000u64 {
            let t = 1_000 + s * 10_000_000;
            p.markers.push(marker(t, MarkerKind::Phase, Edge::Start, "forward", None));
            p.markers.push(marker(t + 6_000_000, MarkerKind::Phase, Edge::End, "forward", None));
            p.markers.push(marker(t + 6_000_000, MarkerKind::Phase, Edge::Start, "backward", None));
            p.markers.push(marker(t + 9_999_000, MarkerKind::Phase, Edge::End, "backward", None));
        }
        p.markers.push(marker(100_000_000_000, MarkerKind::Phase, Edge::End, "train", None));
        p.cpu.push(CpuSample {
            t_ns: 100_000_000_000,
            rss_bytes: 1,
            pss_bytes: None,
            uss_bytes: None,
            process_count: 1,
        });
        let tl = Timeline::build(&p, 500);
        assert!(tl.phases.len() <= 500, "{}", tl.phases.len());
        // each 200 ms bucket holds 20 steps: forward covers 60 %, so it dominates every bucket
        assert!(tl.phases.iter().all(|b| b.label == "forward"), "{:?}", &tl.phases[..3]);
        assert_eq!(tl.phase_names, ["train", "forward", "backward"]);

        // a coarse run: one bucket per 1 ms, so forward and backward alternate
        let tl = Timeline::build(&Profile { markers: p.markers[..9].to_vec(), ..Default::default() }, 20);
        let labels: Vec<&str> = tl.phases.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(labels, ["forward", "backward", "forward", "backward"], "{:?}", tl.phases);
    }

    #[test]
    fn the_phase_lane_draws_each_phase_share_not_a_majority_vote() {
        // 1000 steps of forward 40 %, backward 45 %, optimizer 15 % (10 ms each): every 100 ms column holds
        // 10 steps; a majority vote would draw only backward.
        let mut p = Profile::default();
        for s in 0..1000u64 {
            let t = s * 10_000_000;
            for (name, a, b) in
                [("forward", 0, 4_000_000), ("backward", 4_000_000, 8_500_000), ("optimizer", 8_500_000, 10_000_000)]
            {
                p.markers.push(marker(t + a, MarkerKind::Phase, Edge::Start, name, None));
                p.markers.push(marker(t + b, MarkerKind::Phase, Edge::End, name, None));
            }
        }
        let tl = Timeline::build(&p, 100);
        assert!(tl.phases.iter().all(|b| b.label == "backward"), "the majority lane hides the others");
        assert_eq!(tl.phase_mix.len(), 1, "a steady mix merges into one band: {:?}", &tl.phase_mix[..2]);
        let parts = &tl.phase_mix[0].parts;
        let names: Vec<&str> = parts.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(names, ["forward", "backward", "optimizer"]);
        assert_eq!(parts.iter().map(|p| p.1).sum::<u32>(), MIX_LEVELS);
        let pct: Vec<u32> = parts.iter().map(|p| p.2).collect();
        assert_eq!(pct, [40, 45, 15]);
        assert!(parts.iter().all(|p| p.1 >= 1));
    }

    #[test]
    fn epoch_bands_carry_their_peak() {
        let mut p = Profile::default();
        for i in 0..100u64 {
            p.cpu.push(CpuSample {
                t_ns: i * 10,
                rss_bytes: if i == 70 { 5 << 20 } else { 1 << 20 },
                pss_bytes: None,
                uss_bytes: None,
                process_count: 1,
            });
        }
        for e in 0..2u64 {
            p.markers.push(marker(e * 500, MarkerKind::Epoch, Edge::Start, "epoch", Some(e as i64)));
            p.markers.push(marker(e * 500 + 499, MarkerKind::Epoch, Edge::End, "epoch", Some(e as i64)));
        }
        let tl = Timeline::build(&p, 100);
        let labels: Vec<&str> = tl.epochs.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(labels, ["epoch 0 (peak CPU RSS 1.0 MiB)", "epoch 1 (peak CPU RSS 5.0 MiB)"]);
    }

    #[test]
    fn epochs_become_bands_with_their_index() {
        let mut p = Profile::default();
        for e in 0..3u64 {
            p.markers.push(marker(e * 1_000, MarkerKind::Epoch, Edge::Start, "epoch", Some(e as i64)));
            p.markers.push(marker(e * 1_000 + 900, MarkerKind::Epoch, Edge::End, "epoch", Some(e as i64)));
        }
        let tl = Timeline::build(&p, 100);
        let labels: Vec<&str> = tl.epochs.iter().map(|b| b.label.as_str()).collect();
        assert_eq!(labels, ["epoch 0", "epoch 1", "epoch 2"]);
        // band edges fall on bucket edges: within one bucket (29 ns here) of the epoch's start
        assert!(tl.epochs[1].start_ns.abs_diff(1_000) <= 29, "{:?}", tl.epochs[1]);
        assert!(tl.series.is_empty());
    }

    #[test]
    fn pss_is_drawn_next_to_rss_when_the_tree_has_several_processes() {
        let mut p = Profile::default();
        for i in 0..10u64 {
            let workers = (3..8).contains(&i);
            p.cpu.push(CpuSample {
                t_ns: i * 1_000_000,
                rss_bytes: if workers { 2_500 } else { 1_000 },
                pss_bytes: (i % 2 == 0).then_some(1_050),
                uss_bytes: None,
                process_count: if workers { 3 } else { 1 },
            });
        }
        let tl = Timeline::build(&p, 10);
        let labels: Vec<&str> = tl.series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["CPU RSS", "CPU PSS"]);
        assert_eq!(tl.series[1].samples, 5);
        assert!(tl.cpu_note.as_deref().unwrap().contains("trust PSS"));
        // one process: RSS is right, no PSS line
        for s in &mut p.cpu {
            s.process_count = 1;
        }
        let tl = Timeline::build(&p, 10);
        assert_eq!(tl.series.len(), 1);
        assert!(tl.cpu_note.is_none());
    }

    #[test]
    fn series_per_gpu_and_cpu() {
        let mut p = Profile::default();
        p.cpu.push(CpuSample { t_ns: 5, rss_bytes: 10, pss_bytes: None, uss_bytes: None, process_count: 1 });
        p.torch.push(TorchSample {
            t_ns: 5,
            device: 0,
            allocated_bytes: 1,
            reserved_bytes: 2,
            peak_allocated_bytes: 1,
            peak_reserved_bytes: 2,
            active_bytes: 1,
            inactive_split_bytes: 0,
            origin: Default::default(),
        });
        p.gpu.push(GpuSample { t_ns: 5, device: 0, used_bytes: 50, total_bytes: 100, process_bytes: None });
        let tl = Timeline::build(&p, 10);
        let labels: Vec<&str> = tl.series.iter().map(|s| s.label.as_str()).collect();
        assert_eq!(labels, ["CPU RSS", "GPU allocated", "GPU reserved", "GPU NVML (whole device)"]);
        assert_eq!(tl.max_bytes(), 50);
    }
}
