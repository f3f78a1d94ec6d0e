//! What-if searches: the smallest per-process memory limit under which a trace runs without running out of
//! memory (bisection over limits; reserved memory moves in 2 MiB steps, so the answer is exact to the byte
//! at 2 MiB granularity), and a table of the common settings side by side.

use serde::Serialize;

use crate::config::AllocConf;
use crate::replay::{DeviceResult, Prepared, SimOptions};

/// Reserved memory only changes by multiples of this (segments and pages are multiples of 2 MiB).
pub const LIMIT_STEP_BYTES: u64 = 2 << 20;

/// The smallest memory limit (a multiple of 2 MiB) under which the replay has no OOM, or None when even
/// the unlimited replay fails (a device that is too small). `runs` counts the replays.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MinMemory {
    pub settings: String,
    pub min_memory_bytes: Option<u64>,
    /// Peak reserved without a limit (the upper end of the search).
    pub unlimited_peak_reserved_bytes: u64,
    pub runs: usize,
}

/// The smallest limit under the settings asked for (or the recorded ones), then, where those do not use
/// expandable segments, with them on: the rows of `simulate --min-memory` and `torchmem.simulate(min_memory=True)`.
pub fn min_memory_settings(p: &Prepared<'_>, base: &SimOptions) -> Vec<MinMemory> {
    let mut rows = vec![min_memory(p, base)];
    let mut conf = base.conf.clone().unwrap_or_else(|| p.recorded_conf.clone());
    if !conf.expandable_segments {
        conf.expandable_segments = true;
        rows.push(min_memory(p, &SimOptions { conf: Some(conf), ..base.clone() }));
    }
    rows
}

pub fn min_memory(p: &Prepared<'_>, base: &SimOptions) -> MinMemory {
    let mut opts = base.clone();
    opts.detailed = false;
    opts.memory_limit_bytes = None;
    opts.memory_fraction = None;
    let unlimited = p.run(&opts);
    let settings = unlimited.settings.clone();
    let mut runs = 1;
    if unlimited.oom.is_some() {
        return MinMemory {
            settings,
            min_memory_bytes: None,
            unlimited_peak_reserved_bytes: unlimited.peak_reserved_bytes,
            runs,
        };
    }
    // hi passes (the unlimited peak: no allocation ever exceeds it); find the lowest passing step. A trace
    // that starts with memory reserved (history switched on late) holds that from its first entry: a limit
    // below it fails.
    let mut hi = unlimited.peak_reserved_bytes.div_ceil(LIMIT_STEP_BYTES);
    let mut lo = p.start.reserved_bytes().div_ceil(LIMIT_STEP_BYTES).saturating_sub(1).min(hi.saturating_sub(1)); // fails (or is the floor)
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        opts.memory_limit_bytes = Some(mid * LIMIT_STEP_BYTES);
        runs += 1;
        if p.run(&opts).oom.is_none() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    MinMemory {
        settings,
        min_memory_bytes: Some(hi * LIMIT_STEP_BYTES),
        unlimited_peak_reserved_bytes: unlimited.peak_reserved_bytes,
        runs,
    }
}

/// The settings `--compare` puts side by side.
pub fn common_settings() -> Vec<(&'static str, AllocConf)> {
    [
        ("default", ""),
        ("expandable_segments:True", "expandable_segments:True"),
        ("max_split_size_mb:64", "max_split_size_mb:64"),
        ("max_split_size_mb:512", "max_split_size_mb:512"),
        ("roundup_power2_divisions:4", "roundup_power2_divisions:4"),
        ("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"),
        // Inert without a memory limit (--memory-limit); with one it frees old cached blocks first.
        ("garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6"),
    ]
    .into_iter()
    .map(|(n, s)| (n, AllocConf::parse(s).expect("built-in settings parse")))
    .collect()
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompareRow {
    pub settings: String,
    pub result: DeviceResult,
    pub min_memory_bytes: Option<u64>,
}

/// One row per setting: the replay under the caller's limits, and its minimum memory.
pub fn compare(p: &Prepared<'_>, base: &SimOptions, with_min_memory: bool) -> Vec<CompareRow> {
    common_settings()
        .into_iter()
        .map(|(name, conf)| {
            let mut o = base.clone();
            o.conf = Some(conf);
            let result = p.run(&o);
            let min_memory_bytes = if with_min_memory { min_memory(p, &o).min_memory_bytes } else { None };
            CompareRow { settings: name.to_string(), result, min_memory_bytes }
        })
        .collect()
}
