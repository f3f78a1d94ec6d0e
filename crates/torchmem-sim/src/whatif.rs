//! The what-if panel of the snapshot page and of `torchmem.on_oom`'s report: per device, the trace replayed
//! under the common settings of `--compare` (the same rows, from `search`), with a one-sentence answer
//! ("with expandable segments this run would have peaked at X reserved (-Y)"); for a snapshot that ends in an
//! out-of-memory error, whether each setting avoids it at the memory the allocator could have had there, and
//! the smallest memory that runs the trace (`--min-memory`). Where the trace cannot be simulated (no trace,
//! a CUDA-graph pool, expandable segments mapped before the trace) one line says why. The rows are the
//! snapshot crate's plain `html::WhatIf` data: the page renderer draws them without depending on this crate.

use std::fmt::Write;

use torchmem_snapshot::fmt::{bytes, signed_bytes};
use torchmem_snapshot::html::{WhatIf, WhatIfRow};
use torchmem_snapshot::model::{Action, Snapshot};

use crate::replay::{self, DeviceResult, Prepared, SimOptions};
use crate::search;

/// Traces longer than this get no minimum-memory search in the panel (it replays each setting ~14 times;
/// `torchmem simulate --min-memory` still answers).
pub const MIN_MEMORY_MAX_ENTRIES: usize = 2_000_000;

/// What the panel knows beyond the snapshot.
#[derive(Debug, Clone, Default)]
pub struct WhatIfOptions {
    /// The per-process cap the run had (`set_per_process_memory_fraction`); a snapshot does not record it,
    /// `torchmem.on_oom` does (the OOM observer gets the allowed maximum).
    pub memory_limit_bytes: Option<u64>,
    /// The device's `totalGlobalMem` (sizes expandable segments' reservation); default an H200's.
    pub device_total_bytes: Option<u64>,
}

/// The panel for every device of a snapshot.
pub fn whatif(snap: &Snapshot, opts: &WhatIfOptions) -> Vec<WhatIf> {
    replay::devices(snap).into_iter().map(|d| device_whatif(snap, d, opts)).collect()
}

fn unavailable(device: i64, why: String) -> WhatIf {
    let why = why.split_whitespace().collect::<Vec<_>>().join(" ");
    WhatIf {
        device,
        unavailable: Some(why.clone()),
        headline: why,
        recorded_oom: false,
        conditions: String::new(),
        rows: Vec::new(),
        notes: Vec::new(),
    }
}

const EXPANDABLE: &str = "expandable_segments:True";

/// The panel of one device.
pub fn device_whatif(snap: &Snapshot, device: i64, opts: &WhatIfOptions) -> WhatIf {
    let p = match Prepared::new(snap, device) {
        Ok(p) => p,
        Err(reason) => return unavailable(device, reason),
    };
    if p.entries.is_empty() {
        return unavailable(
            device,
            format!(
                "device {device} has segments but no allocator history (trace) to replay; record one with \
                 torchmem.on_oom(dir) or torchmem.capture(path), which switch history on"
            ),
        );
    }
    let oom_entry = p.entries.iter().position(|e| e.action == Action::Oom).map(|k| k as u32);
    let recorded_oom = oom_entry.is_some();
    // Rows: the trace under each setting; an OOM snapshot at the memory the allocator could have had there.
    let base = SimOptions {
        memory_limit_bytes: opts.memory_limit_bytes,
        device_total_bytes: opts.device_total_bytes,
        device_memory_from_oom: recorded_oom,
        limits_as_recorded: opts.memory_limit_bytes.is_some(),
        detailed: true,
        ..Default::default()
    };
    // The minimum memory: unlimited device, no cap (search::min_memory drops the cap itself).
    let unbounded = SimOptions { device_total_bytes: opts.device_total_bytes, ..Default::default() };
    let with_min = p.entries.len() <= MIN_MEMORY_MAX_ENTRIES;
    let recorded_conf = p.recorded_conf.clone();
    let mut settings = search::common_settings();
    if !settings.iter().any(|(_, c)| *c == recorded_conf) {
        settings.insert(0, ("recorded", recorded_conf.clone()));
    }
    let baseline = p.run(&SimOptions { conf: Some(recorded_conf.clone()), ..base.clone() });
    let oom_reproduced = oom_entry.is_some_and(|k| baseline.oom.as_ref().is_some_and(|o| o.entry == k));
    let mut rows = Vec::new();
    for (name, conf) in settings {
        let is_recorded = conf == recorded_conf;
        let r = if is_recorded {
            baseline.clone()
        } else {
            p.run(&SimOptions { conf: Some(conf.clone()), ..base.clone() })
        };
        let min_memory_bytes = if with_min {
            search::min_memory(&p, &SimOptions { conf: Some(conf), ..unbounded.clone() }).min_memory_bytes
        } else {
            None
        };
        let avoids = match oom_entry {
            Some(k) if oom_reproduced => Some(r.recorded_ooms_avoided.contains(&k)),
            _ => None,
        };
        rows.push(row(
            if name == "recorded" { r.settings.clone() } else { name.to_string() },
            is_recorded,
            &r,
            &baseline,
            avoids,
            min_memory_bytes,
            with_min,
        ));
    }
    let rec_min = rows.iter().find(|r| r.recorded).and_then(|r| r.min_memory_bytes);
    for r in rows.iter_mut() {
        r.min_memory_change_bytes = match (r.min_memory_bytes, rec_min) {
            (Some(m), Some(b)) => Some(m as i64 - b as i64),
            _ => None,
        };
    }
    let mut notes = Vec::new();
    if let Some(n) = baseline.notes.iter().find(|n| n.contains("does not start from an empty allocator")) {
        notes.push(n.clone());
    }
    if baseline.comparison.as_ref().is_some_and(|c| !c.matches) {
        notes.push(
            "the replay under the recorded settings differs from the recording (torchmem simulate FILE shows \
             where): the numbers are the model's, not exact"
                .into(),
        );
    }
    if let Some(n) = crate::version_note(snap) {
        notes.push(n);
    }
    if !with_min {
        notes.push(format!(
            "{} trace entries: the minimum memory was not searched here (torchmem simulate FILE --min-memory)",
            p.entries.len()
        ));
    }
    let capacity = p.recorded_oom_capacity_bytes;
    let limit_text =
        opts.memory_limit_bytes.map(|l| format!(" under the run's memory limit of {}", bytes(l))).unwrap_or_default();
    let conditions = match (recorded_oom, capacity) {
        (true, Some(c)) => format!(
            "each row replays the {} trace entries (the allocation that failed included){limit_text}, with the {} \
             the allocator could have had there (held + free on the device); \"needs at least\" is the smallest \
             memory limit that runs the trace (2 MiB steps); what the program did after the error is not in the trace",
            p.entries.len(),
            bytes(c)
        ),
        _ => format!(
            "each row replays the {} trace entries under that setting{}; \"needs at least\" is the smallest \
             memory limit that runs the trace (2 MiB steps)",
            p.entries.len(),
            if limit_text.is_empty() { " without a memory limit" } else { &limit_text }
        ),
    };
    if recorded_oom && !oom_reproduced {
        notes.push(match opts.memory_limit_bytes {
            None => "the replay under the recorded settings does not run out of memory where the recording did: the \
                     run probably had a memory cap (set_per_process_memory_fraction) that the snapshot does not \
                     record; torchmem.on_oom's report knows it, or give it with --memory-limit SIZE (torchmem \
                     snapshot FILE --html OUT --memory-limit SIZE)"
                .to_string(),
            Some(_) => "the replay under the recorded settings does not run out of memory where the recording did, \
                        so whether a setting avoids it is not known"
                .to_string(),
        });
    }
    let headline = headline(&rows, recorded_oom, oom_reproduced, capacity, opts.memory_limit_bytes);
    WhatIf { device, unavailable: None, headline, recorded_oom, conditions, rows, notes }
}

#[allow(clippy::too_many_arguments)]
fn row(
    settings: String,
    recorded: bool,
    r: &DeviceResult,
    baseline: &DeviceResult,
    avoids: Option<bool>,
    min_memory_bytes: Option<u64>,
    min_memory_searched: bool,
) -> WhatIfRow {
    WhatIfRow {
        settings,
        recorded,
        peak_allocated_bytes: r.peak_allocated_bytes,
        peak_reserved_bytes: r.peak_reserved_bytes,
        reserved_change_bytes: r.peak_reserved_bytes as i64 - baseline.peak_reserved_bytes as i64,
        num_alloc_retries: r.num_alloc_retries,
        oom: r.oom.is_some(),
        avoids_recorded_oom: avoids,
        min_memory_bytes,
        min_memory_searched,
        min_memory_change_bytes: None,
    }
}

fn needs(r: &WhatIfRow) -> String {
    match (r.min_memory_bytes, r.min_memory_searched) {
        (Some(m), _) => format!("it needs at least {}", bytes(m)),
        (None, true) => "no memory limit runs it (an allocation larger than the settings can ever place)".into(),
        (None, false) => "its minimum memory was not searched".into(),
    }
}

fn had(limit: Option<u64>, capacity: Option<u64>) -> String {
    match (limit, capacity) {
        (Some(l), _) => format!(" (the run's memory limit was {})", bytes(l)),
        (None, Some(c)) => format!(" (the allocator could have had {})", bytes(c)),
        _ => String::new(),
    }
}

/// The one-sentence answer.
fn headline(
    rows: &[WhatIfRow],
    recorded_oom: bool,
    oom_reproduced: bool,
    capacity: Option<u64>,
    limit: Option<u64>,
) -> String {
    let rec = rows.iter().find(|r| r.recorded);
    let exp = rows.iter().find(|r| r.settings == EXPANDABLE);
    let (Some(rec), Some(exp)) = (rec, exp) else { return String::new() };
    if recorded_oom && oom_reproduced {
        let mut s = if rec.settings == EXPANDABLE {
            format!(
                "this run used expandable segments and still ran out of memory: {}{}",
                needs(rec),
                had(limit, capacity)
            )
        } else if exp.avoids_recorded_oom == Some(true) {
            format!(
                "with expandable segments this OOM would have been avoided: the allocation that failed fits{}, \
                 peaking at {} reserved; {} (the recorded settings: {})",
                limit.map(|l| format!(" under the {} limit", bytes(l))).unwrap_or_default(),
                bytes(exp.peak_reserved_bytes),
                needs(exp),
                needs(rec).trim_start_matches("it needs ")
            )
        } else {
            format!(
                "expandable segments would not have avoided this OOM: with them {}{}; with the recorded settings {}",
                needs(exp),
                had(limit, capacity),
                needs(rec).trim_start_matches("it needs ")
            )
        };
        let avoiding: Vec<&str> =
            rows.iter().filter(|r| r.avoids_recorded_oom == Some(true)).map(|r| r.settings.as_str()).collect();
        if avoiding.is_empty() {
            s.push_str("; none of these settings avoids it");
        } else if !(avoiding.len() == 1 && avoiding[0] == EXPANDABLE) {
            let _ = write!(s, "; settings that avoid it: {}", avoiding.join(", "));
        }
        return s;
    }
    if rec.settings == EXPANDABLE {
        let def = rows.iter().find(|r| r.settings == "default").unwrap_or(exp);
        return format!(
            "this run used expandable segments and peaked at {} reserved; with the default settings it would have \
             peaked at {} reserved ({})",
            bytes(rec.peak_reserved_bytes),
            bytes(def.peak_reserved_bytes),
            signed_bytes(def.reserved_change_bytes)
        );
    }
    format!(
        "with expandable segments this run would have peaked at {} reserved ({}; recorded settings: {})",
        bytes(exp.peak_reserved_bytes),
        signed_bytes(exp.reserved_change_bytes),
        bytes(rec.peak_reserved_bytes)
    )
}

/// The panel as text (on_oom's report).
pub fn text(panels: &[WhatIf]) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "What if (the trace replayed by torchmem's allocator simulator, {} rules):", crate::RULES);
    if panels.is_empty() {
        let _ = writeln!(o, "  no what-if: the snapshot has no device with a trace or segments");
    }
    for p in panels {
        let dev = if panels.len() > 1 { format!("device {}: ", p.device) } else { String::new() };
        if let Some(why) = &p.unavailable {
            let _ = writeln!(o, "  {dev}no what-if: {why}");
            continue;
        }
        let _ = writeln!(o, "  {dev}{}", p.headline);
        let _ = writeln!(
            o,
            "    {:<50} {:>11} {:>11} {:>12} {:>7} {:>9} {:>14}",
            "settings",
            "peak alloc",
            "peak resv",
            if p.recorded_oom { "change(need)" } else { "change" },
            "retries",
            if p.recorded_oom { "avoids" } else { "OOM" },
            "needs at least"
        );
        for r in &p.rows {
            let verdict = if p.recorded_oom {
                match r.avoids_recorded_oom {
                    Some(true) => "yes",
                    Some(false) => "no",
                    None => "?",
                }
            } else if r.oom {
                "yes"
            } else {
                "no"
            };
            let name = if r.recorded { format!("{} (recorded)", r.settings) } else { r.settings.clone() };
            let change = match (r.recorded, p.recorded_oom, r.min_memory_change_bytes) {
                (true, _, _) | (false, true, None) => "-".to_string(),
                (false, true, Some(c)) => signed_bytes(c),
                (false, false, _) => signed_bytes(r.reserved_change_bytes),
            };
            let _ = writeln!(
                o,
                "    {:<50} {:>11} {:>11} {:>12} {:>7} {:>9} {:>14}",
                name,
                bytes(r.peak_allocated_bytes),
                bytes(r.peak_reserved_bytes),
                change,
                r.num_alloc_retries,
                verdict,
                torchmem_snapshot::html::min_memory_cell(r)
            );
        }
        let _ = writeln!(o, "    ({})", p.conditions);
        for n in &p.notes {
            let _ = writeln!(o, "    note: {n}");
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures").join(name)
    }

    fn truth() -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(fixture("sim-h200/truth.json")).unwrap()).unwrap()
    }

    fn panel_of(name: &str, opts: &WhatIfOptions) -> WhatIf {
        let snap = crate::read_snapshot(&fixture(name)).unwrap();
        let mut v = whatif(&snap, opts);
        assert_eq!(v.len(), 1, "{name}: one device");
        v.remove(0)
    }

    #[test]
    fn rows_equal_compare_and_the_measured_what_if_runs() {
        let w = "resnet50_adamw_foreach_fp32";
        let name = format!("sim-h200/{w}__recorded.pickle.gz");
        let p = panel_of(&name, &WhatIfOptions::default());
        assert!(p.unavailable.is_none() && !p.recorded_oom);
        // The same numbers as `torchmem simulate --compare`.
        let snap = crate::read_snapshot(&fixture(&name)).unwrap();
        let prep = Prepared::new(&snap, 0).unwrap();
        let cmp = search::compare(&prep, &SimOptions { detailed: true, ..Default::default() }, true);
        assert_eq!(p.rows.len(), cmp.len());
        for (r, c) in p.rows.iter().zip(&cmp) {
            assert_eq!(r.settings, c.settings);
            assert_eq!(r.peak_reserved_bytes, c.result.peak_reserved_bytes, "{}", r.settings);
            assert_eq!(r.peak_allocated_bytes, c.result.peak_allocated_bytes, "{}", r.settings);
            assert_eq!(r.num_alloc_retries, c.result.num_alloc_retries, "{}", r.settings);
            assert_eq!(r.min_memory_bytes, c.min_memory_bytes, "{}", r.settings);
        }
        // And the real runs of truth.json (the same training under expandable segments / max_split_size_mb:64).
        let t = truth();
        let rec = &t["workloads"][w]["recorded"]["stats"];
        let row = |s: &str| p.rows.iter().find(|r| r.settings == s).unwrap();
        let def = row("default");
        assert!(def.recorded && def.reserved_change_bytes == 0);
        assert_eq!(def.peak_reserved_bytes, rec["reserved_bytes.all.peak"].as_u64().unwrap());
        for (setting, key) in [(EXPANDABLE, "expandable"), ("max_split_size_mb:64", "max_split_64")] {
            let real = &t["workloads"][w]["real"][key]["stats"];
            let r = row(setting);
            assert_eq!(r.peak_reserved_bytes, real["reserved_bytes.all.peak"].as_u64().unwrap(), "{setting}");
            assert_eq!(r.peak_allocated_bytes, real["allocated_bytes.all.peak"].as_u64().unwrap(), "{setting}");
        }
        let exp = row(EXPANDABLE);
        assert!(exp.reserved_change_bytes < 0);
        assert_eq!(
            p.headline,
            format!(
                "with expandable segments this run would have peaked at {} reserved ({}; recorded settings: {})",
                bytes(exp.peak_reserved_bytes),
                signed_bytes(exp.reserved_change_bytes),
                bytes(def.peak_reserved_bytes)
            )
        );
        let t = text(std::slice::from_ref(&p));
        assert!(t.contains(&p.headline) && t.contains("max_split_size_mb:512"), "{t}");
    }

    #[test]
    fn an_oom_snapshot_says_which_settings_avoid_it_and_the_memory_that_runs_it() {
        // A real OOM under set_per_process_memory_fraction (the cap between peak allocated and reserved).
        let w = "gpt2_adamw_fused_bf16";
        let t = truth();
        let run = &t["workloads"][w]["replay"]["cap_retry"];
        let limit = (run["memory_fraction"].as_f64().unwrap() * t["device_total_bytes"].as_f64().unwrap()) as u64;
        let opts =
            WhatIfOptions { memory_limit_bytes: Some(limit), device_total_bytes: t["device_total_bytes"].as_u64() };
        let p = panel_of(&format!("sim-h200/{w}__replay__cap_retry.pickle.gz"), &opts);
        assert!(p.recorded_oom && p.unavailable.is_none(), "{p:?}");
        let rec = p.rows.iter().find(|r| r.recorded).unwrap();
        assert_eq!(rec.avoids_recorded_oom, Some(false), "the recorded settings fail where the recording failed");
        assert!(rec.oom);
        // The smallest memory that runs it is above the cap it failed under, and runs without OOM; 2 MiB less fails.
        let snap = crate::read_snapshot(&fixture(&format!("sim-h200/{w}__replay__cap_retry.pickle.gz"))).unwrap();
        let prep = Prepared::new(&snap, 0).unwrap();
        for r in &p.rows {
            let m = r.min_memory_bytes.expect("searched");
            let conf = crate::AllocConf::parse(if r.settings == "default" { "" } else { &r.settings }).unwrap();
            let o = |l: u64| SimOptions {
                conf: Some(conf.clone()),
                memory_limit_bytes: Some(l),
                device_total_bytes: opts.device_total_bytes,
                ..Default::default()
            };
            assert!(prep.run(&o(m)).oom.is_none(), "{}", r.settings);
            assert!(prep.run(&o(m - search::LIMIT_STEP_BYTES)).oom.is_some(), "{}", r.settings);
        }
        assert!(rec.min_memory_bytes.unwrap() > limit);
        // Expandable segments under the same cap: the real allocator's replay of the same program
        // (truth: expandable_cap_retry) got past the allocation that failed, or not.
        let exp_truth = &t["workloads"][w]["replay"]["expandable_cap_retry"];
        assert_eq!(exp_truth["memory_fraction"], run["memory_fraction"]);
        let failed_at = run["oom"]["entry"].as_u64().unwrap();
        let got_past = exp_truth["oom"].is_null() || exp_truth["oom"]["entry"].as_u64().unwrap() > failed_at;
        let exp = p.rows.iter().find(|r| r.settings == EXPANDABLE).unwrap();
        assert_eq!(exp.avoids_recorded_oom, Some(got_past), "{exp_truth}");
        assert!(p.headline.contains("expandable segments"), "{}", p.headline);
        let txt = text(std::slice::from_ref(&p));
        assert!(txt.contains("avoids") && txt.contains("needs at least"), "{txt}");
    }

    #[test]
    fn a_trace_starting_with_expandable_pages_mapped_replays_exactly() {
        // H200 recordings under expandable segments with their first entries cut off (history switched on
        // late): the reservations' mapped ranges at the cut come from the dump and the maps after it. The
        // replay under the recorded settings reproduces every later map and the recording's peak reserved.
        for name in [
            "gpt2_adamw_amp__real__expandable",
            "resnet50_adamw_foreach_fp32__real__expandable",
            "bert_base_adamw_fp32__real__expandable",
        ] {
            let path = fixture(&format!("sim-h200/{name}.pickle.gz"));
            let n = crate::read_snapshot(&path).unwrap().device_traces[0].len();
            for cut in [3, n / 3, 2 * n / 3] {
                let mut snap = crate::read_snapshot(&path).unwrap();
                snap.device_traces[0].drain(..cut);
                let p = Prepared::new(&snap, 0).unwrap();
                assert!(!p.start.reservations.is_empty(), "{name} at {cut}: pages mapped at the start");
                let conf = p.recorded_conf.clone();
                let r = p.run(&SimOptions { conf: Some(conf), detailed: true, ..Default::default() });
                let c = r.comparison.as_ref().expect("recorded settings: compared");
                assert!(c.matches && r.oom.is_none(), "{name} at {cut}: {:?}", c.divergence);
                assert_eq!(r.peak_reserved_bytes, c.recorded_peak_reserved_bytes, "{name} at {cut}");
                let panel = device_whatif(&snap, 0, &WhatIfOptions::default());
                assert!(panel.unavailable.is_none() && !panel.rows.is_empty(), "{name}: {:?}", panel.unavailable);
                let exp = panel.rows.iter().find(|r| r.settings == EXPANDABLE).unwrap();
                assert!(exp.min_memory_bytes.unwrap() >= p.start.reserved_bytes(), "holds the start's pages");
            }
        }
    }

    #[test]
    fn no_trace_and_graph_pool_get_one_line() {
        let read = || crate::read_snapshot(&fixture("sim-h200/mlp_sgd_fp32__recorded.pickle.gz")).unwrap();
        let mut snap = read();
        let full = whatif(&snap, &WhatIfOptions::default());
        assert!(full[0].unavailable.is_none());
        // History off: segments, no trace.
        let mut no_trace = read();
        for t in no_trace.device_traces.iter_mut() {
            t.clear();
        }
        let p = &whatif(&no_trace, &WhatIfOptions::default())[0];
        let why = p.unavailable.as_deref().unwrap();
        assert!(why.contains("no allocator history") && !why.contains('\n'), "{why}");
        assert!(text(std::slice::from_ref(p)).contains("no what-if: device 0 has segments but no allocator history"));
        // A CUDA-graph private pool.
        snap.segments[0].pool_id = (1, 2);
        let p = &whatif(&snap, &WhatIfOptions::default())[0];
        let why = p.unavailable.as_deref().unwrap();
        assert!(why.contains("private pool") && !why.contains('\n') && p.rows.is_empty(), "{why}");
        // No device at all.
        let empty = whatif(&Snapshot::default(), &WhatIfOptions::default());
        assert!(empty.is_empty() && text(&empty).contains("no device with a trace"));
    }
}
