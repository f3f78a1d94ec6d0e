//! Growth ("leak") warnings: memory that rises at the end of every epoch (or step) of one process.

use serde::{Deserialize, Serialize};

use super::tables::EpochRow;

/// What a growth is counted per.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GrowthUnit {
    Epoch,
    Step,
}

impl GrowthUnit {
    pub fn as_str(self) -> &'static str {
        match self {
            GrowthUnit::Epoch => "epoch",
            GrowthUnit::Step => "step",
        }
    }
}

/// The series that grew.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GrowthSeries {
    /// PyTorch's allocated bytes.
    #[serde(rename = "GPU allocated")]
    GpuAllocated,
    /// The process's RSS (less malloc's free bytes where every row has them).
    #[serde(rename = "CPU RSS")]
    CpuRss,
    /// The process's RSS right after each epoch's `torchmem.empty_cache()` (its "Cache emptied" mark, read
    /// after `malloc_trim` gave the free heap back): what is still held once the cache is emptied.
    #[serde(rename = "CPU RSS after empty_cache()")]
    CpuRssAfterEmptyCache,
}

impl GrowthSeries {
    pub fn as_str(self) -> &'static str {
        match self {
            GrowthSeries::GpuAllocated => "GPU allocated",
            GrowthSeries::CpuRss => "CPU RSS",
            GrowthSeries::CpuRssAfterEmptyCache => "CPU RSS after empty_cache()",
        }
    }
}

/// Memory that grows every epoch (or step): the classic `total_loss += loss` leak. Its sentence is the
/// report's (`report::findings::growth_message`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Growth {
    pub unit: GrowthUnit,
    pub what: GrowthSeries,
    pub per_unit_bytes: i64,
    pub units: usize,
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

/// Growth warnings from the epoch rows of one process (GPU allocated first, CPU RSS otherwise). On the CPU:
/// - where the program empties the cache after every epoch (`torchmem.empty_cache()`; the last epoch may have
///   no such mark yet, as when the Monitor judges at that epoch's end), the RSS right after each
///   (`EpochRow::rss_after_emptied_cache_bytes`): with glibc's free heap given back it is what is held, and
///   it is the cleanest series there is (measured, `examples/train.py` on the CPU: flat to 1 MiB over 6
///   healthy epochs; +50-51 MiB every epoch with `--leak`, whose epoch-end RSS rose 29-67 MiB and RSS less
///   malloc's free bytes 7-39 MiB, since the trims leave pages malloc counts free out of RSS);
/// - else RSS less malloc's free bytes (`EpochRow::held_rss_bytes`) where every row has it, as the step leak
///   detector judges: glibc's freed memory makes RSS creep in a healthy loop (`malloc_trim` gives it back),
///   and a healthy CNN's RSS rose at 3 epoch ends in a row 2 runs in 10;
/// - raw RSS otherwise (epochs not marked by the Monitor, a profile of schema v3 or older).
pub fn growth_warnings(rows: &[EpochRow], unit: GrowthUnit) -> Vec<Growth> {
    let mut out = Vec::new();
    let alloc: Vec<u64> = rows.iter().filter_map(|r| r.allocated_bytes).collect();
    let emptied: Vec<u64> = rows.iter().map_while(|r| r.rss_after_emptied_cache_bytes).collect();
    let complete = |v: Vec<u64>| (v.len() == rows.len()).then_some(v);
    let cpu = if emptied.len() >= 3 && emptied.len() + 1 >= rows.len() {
        Some((GrowthSeries::CpuRssAfterEmptyCache, emptied))
    } else {
        let held: Vec<u64> = rows.iter().filter_map(|r| r.held_rss_bytes).collect();
        let rss = match complete(held) {
            Some(held) if !held.is_empty() => held,
            _ => rows.iter().filter_map(|r| r.rss_bytes).collect(),
        };
        complete(rss).map(|v| (GrowthSeries::CpuRss, v))
    };
    let gpu = complete(alloc).map(|v| (GrowthSeries::GpuAllocated, v));
    for (what, values) in [gpu, cpu].into_iter().flatten() {
        // RSS grows in allocator-sized chunks (glibc arenas, torch's CPU caching) that scale with the process:
        // ask for at least 4 MiB and 1 % of the RSS per unit there; the GPU allocator's counters are exact.
        let min = if what == GrowthSeries::GpuAllocated {
            GROWTH_MIN_BYTES
        } else {
            (4 * GROWTH_MIN_BYTES).max(values.last().copied().unwrap_or(0) as i64 / 100)
        };
        if let Some(per) = detect_growth(&values, min) {
            out.push(Growth { unit, what, per_unit_bytes: per, units: values.len() });
            break;
        }
    }
    out
}

/// `growth_warnings` for each process's own rows (two ranks' epochs interleaved are not one series).
pub fn growth_by_process(rows: &[EpochRow], unit: GrowthUnit) -> Vec<Growth> {
    let mut order: Vec<(Option<u32>, Option<u32>)> = Vec::new();
    for r in rows {
        if !order.contains(&(r.pid, r.rank)) {
            order.push((r.pid, r.rank));
        }
    }
    order
        .into_iter()
        .flat_map(|stream| {
            let own: Vec<EpochRow> = rows.iter().filter(|r| (r.pid, r.rank) == stream).cloned().collect();
            growth_warnings(&own, unit)
        })
        .collect()
}
