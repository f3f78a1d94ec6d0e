//! Allocation sites: groups the blocks alive at a moment (from `replay`) by the frame that names their
//! site (first user Python frame, else first Python frame, else first meaningful C++ frame), and the
//! `--top` rows and text. Levels are the requested bytes the trace records.

use std::collections::HashMap;

use serde::Serialize;

use crate::model::*;
use crate::replay::{end_blocks, index_at_time, live_at, DevicePeak, LiveBlock};

fn is_library(path: &str) -> bool {
    path.contains("/site-packages/")
        || path.contains("/dist-packages/")
        || path.contains("/lib/python3")
        || path.starts_with('<')
        || path.contains("/torch/")
}

/// The frame that names an allocation site, or `None` when the stack has nothing useful.
pub fn site_frame(snap: &Snapshot, stack: StackId) -> Option<u32> {
    let frames = snap.stack(stack);
    let py = |f: &u32| snap.str(snap.frames[*f as usize].filename).ends_with(".py");
    if let Some(f) = frames.iter().find(|f| py(f) && !is_library(snap.str(snap.frames[**f as usize].filename))) {
        return Some(*f);
    }
    if let Some(f) = frames.iter().find(|f| py(f)) {
        return Some(*f);
    }
    // C++-only stacks (e.g. backward on the autograd thread): the autograd node, else the ATen op,
    // else the first frame that is not the unwinder or the allocator.
    let name_of = |f: &u32| snap.str(snap.frames[*f as usize].name);
    if let Some(f) = frames.iter().find(|f| name_of(f).starts_with("torch::autograd::generated::")) {
        return Some(*f);
    }
    if let Some(f) = frames.iter().find(|f| name_of(f).starts_with("at::_ops::")) {
        return Some(*f);
    }
    frames
        .iter()
        .find(|f| {
            let name = name_of(f);
            !name.is_empty()
                && !name.contains("unwind")
                && !name.contains("CapturedTraceback")
                && !name.contains("gather_with_cpp")
                && !name.contains("CachingAllocator")
                && !name.starts_with("c10::")
                && !name.starts_with("at::detail::empty")
                && name != "??"
        })
        .copied()
}

/// A C++ function name without its parameter list (`ns::f(int, long)` → `ns::f`).
fn strip_params(name: &str) -> &str {
    if !name.ends_with(')') {
        return name;
    }
    let mut depth = 0i32;
    for (i, c) in name.char_indices().rev() {
        match c {
            ')' => depth += 1,
            '(' => {
                depth -= 1;
                if depth == 0 {
                    return &name[..i];
                }
            }
            _ => {}
        }
    }
    name
}

/// The label of a site frame: `file:line:function`.
pub fn site_label(snap: &Snapshot, stack: StackId) -> String {
    match site_frame(snap, stack) {
        Some(f) => {
            let fr = &snap.frames[f as usize];
            let file = snap.str(fr.filename);
            if file.ends_with(".py") {
                snap.frame_text(f)
            } else {
                format!("{} (C++)", strip_params(snap.str(fr.name)))
            }
        }
        None => "(no frames recorded)".to_string(),
    }
}

/// Python frames of a stack (innermost first), for showing next to a site; at most `n`.
pub fn python_frames(snap: &Snapshot, stack: StackId, n: usize) -> Vec<String> {
    let frames = snap.stack(stack);
    let mut out: Vec<String> = frames
        .iter()
        .filter(|f| snap.str(snap.frames[**f as usize].filename).ends_with(".py"))
        .take(n)
        .map(|f| snap.frame_text(*f))
        .collect();
    if out.is_empty() {
        out = frames.iter().take(n).map(|f| snap.frame_text(*f)).collect();
    }
    out
}

/// One row of `--top`.
#[derive(Debug, Clone, Serialize)]
pub struct SiteRow {
    pub site: String,
    pub bytes: u64,
    pub count: u64,
    /// Blocks counted here that were allocated before the recorded history.
    pub before_history_count: u64,
    /// Python frames of the largest block's stack, innermost first.
    pub example_stack: Vec<String>,
}

/// Groups live blocks by site, largest first.
pub fn group_sites(snap: &Snapshot, blocks: &[LiveBlock]) -> Vec<SiteRow> {
    let mut by_site: HashMap<String, (SiteRow, u64)> = HashMap::new();
    let mut label_cache: HashMap<StackId, String> = HashMap::new();
    for b in blocks {
        let label = label_cache.entry(b.stack).or_insert_with(|| site_label(snap, b.stack)).clone();
        let e = by_site.entry(label.clone()).or_insert_with(|| {
            (SiteRow { site: label, bytes: 0, count: 0, before_history_count: 0, example_stack: Vec::new() }, 0)
        });
        e.0.bytes += b.size_bytes;
        e.0.count += 1;
        if b.before_history {
            e.0.before_history_count += 1;
        }
        if b.size_bytes >= e.1 && e.0.example_stack.is_empty() || b.size_bytes > e.1 {
            e.1 = b.size_bytes;
            e.0.example_stack = python_frames(snap, b.stack, 6);
        }
    }
    let mut rows: Vec<SiteRow> = by_site.into_values().map(|(r, _)| r).collect();
    rows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.site.cmp(&b.site)));
    rows
}

/// Top sites of one device at a moment.
#[derive(Debug, Clone, Serialize)]
pub struct TopSites {
    pub device: usize,
    /// "peak", "time" or "end".
    pub moment: String,
    pub time_us: Option<i64>,
    /// The device trace's first `time_us` (text shows times since it); not in the JSON.
    #[serde(skip)]
    pub trace_start_us: Option<i64>,
    pub total_bytes: u64,
    pub rows: Vec<SiteRow>,
}

/// Reads `--at`: a time since the trace start (the earliest first entry of any device), in ms, or with a
/// unit (`250us`, `12.5ms`, `1.5s`); returns the trace's `time_us` for it. A moment outside the trace is
/// an error naming its range.
pub fn resolve_at(snap: &Snapshot, text: &str) -> Result<i64, String> {
    let t = text.trim();
    let (num, scale_us) = if let Some(n) = t.strip_suffix("us") {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix("ms") {
        (n, 1e3)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1e6)
    } else {
        (t, 1e3)
    };
    let v: f64 = num.trim().parse().map_err(|_| {
        format!("--at {text:?} is not a time: give the time since the trace start in ms (12.5), or with a unit (250us, 12.5ms, 1.5s)")
    })?;
    if !v.is_finite() {
        return Err(format!("--at {text:?} is not a finite time"));
    }
    let ranges: Vec<(i64, i64)> =
        (0..snap.device_traces.len()).filter_map(|d| crate::replay::time_range_us(snap, d)).collect();
    let (Some(start), Some(end)) = (ranges.iter().map(|r| r.0).min(), ranges.iter().map(|r| r.1).max()) else {
        return Err(
            "--at needs a trace, and this snapshot has none (record with _record_memory_history(enabled='all'))".into(),
        );
    };
    let at_us = start as f64 + v * scale_us;
    let span = crate::fmt::duration_us(end - start);
    if at_us < start as f64 - 0.5 || at_us > end as f64 + 0.5 {
        let side = if at_us < start as f64 { "before the trace start" } else { "after the trace end" };
        return Err(format!(
            "--at {text} is {side}: the trace spans 0 to {span} (time_us {start} to {end}); give a time in that range"
        ));
    }
    Ok(at_us.round() as i64)
}

/// Top `n` sites for every device in `peaks` (`Summary::peaks`), at its traced peak or at `at_time_us`
/// (devices without a trace: the end state from the segments).
pub fn top_sites(snap: &Snapshot, peaks: &[DevicePeak], n: usize, at_time_us: Option<i64>) -> Vec<TopSites> {
    let mut out = Vec::new();
    for d in peaks {
        let device = d.device;
        let has_trace = snap.device_traces.get(device).is_some_and(|t| !t.is_empty());
        let (upto, moment, time_us) = match (at_time_us, has_trace) {
            (Some(t), true) => (index_at_time(snap, device, t), "time", Some(t)),
            (None, true) => (d.index, "peak", d.time_us),
            (_, false) => {
                // No trace: the end state from the segments.
                let blocks: Vec<LiveBlock> = end_blocks(snap, device)
                    .map(|b| LiveBlock {
                        addr: b.address,
                        size_bytes: b.size_bytes,
                        stack: b.stack,
                        before_history: false,
                    })
                    .collect();
                let total = blocks.iter().map(|b| b.size_bytes).sum();
                let mut rows = group_sites(snap, &blocks);
                rows.truncate(n);
                out.push(TopSites {
                    device,
                    moment: "end".into(),
                    time_us: None,
                    trace_start_us: None,
                    total_bytes: total,
                    rows,
                });
                continue;
            }
        };
        let blocks = live_at(snap, device, upto);
        let total = blocks.iter().map(|b| b.size_bytes).sum();
        let mut rows = group_sites(snap, &blocks);
        rows.truncate(n);
        let trace_start_us = crate::replay::time_range_us(snap, device).map(|r| r.0);
        out.push(TopSites { device, moment: moment.into(), time_us, trace_start_us, total_bytes: total, rows });
    }
    out
}

/// Renders `--top` as text.
pub fn render_top_text(tops: &[TopSites]) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    for t in tops {
        let since = |us: i64| crate::fmt::since_start(us, t.trace_start_us.unwrap_or(us));
        let when = match (t.moment.as_str(), t.time_us) {
            ("peak", Some(us)) => format!("at the traced peak ({} into the trace)", since(us)),
            ("peak", None) => "at the start of the trace (the peak)".to_string(),
            ("time", Some(us)) => format!("at {} into the trace", since(us)),
            _ => "at the end (no trace recorded)".to_string(),
        };
        let _ =
            writeln!(o, "Device {}: top allocation sites {when}; {} alive", t.device, crate::fmt::bytes(t.total_bytes));
        let _ = writeln!(o, "  {:>12} {:>8}  site", "bytes", "blocks");
        for r in &t.rows {
            let note = if r.before_history_count > 0 {
                format!("  ({} allocated before the recorded history)", r.before_history_count)
            } else {
                String::new()
            };
            let _ = writeln!(o, "  {:>12} {:>8}  {}{note}", crate::fmt::bytes(r.bytes), r.count, r.site);
            // The frames between the site and the allocation, site side first.
            let inner: Vec<&String> = if r.site.ends_with("(C++)") {
                Vec::new()
            } else {
                r.example_stack.iter().take_while(|f| !r.site.starts_with(f.as_str())).collect()
            };
            for f in inner.iter().rev().take(3) {
                let _ = writeln!(o, "  {:>12} {:>8}    via {f}", "", "");
            }
        }
        o.push('\n');
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mlp() -> Snapshot {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/snapshots/snapshot_mlp_adam_pystacks.pickle");
        crate::read_path(&p).unwrap()
    }

    #[test]
    fn at_is_time_since_the_trace_start_and_must_fall_in_the_trace() {
        let s = mlp();
        let (start, end) = crate::replay::time_range_us(&s, 0).unwrap();
        assert_eq!(resolve_at(&s, "0"), Ok(start));
        assert_eq!(resolve_at(&s, "1.5"), Ok(start + 1500));
        assert_eq!(resolve_at(&s, "250us"), Ok(start + 250));
        assert_eq!(resolve_at(&s, "2ms"), Ok(start + 2000));
        let span_s = (end - start) as f64 / 1e6;
        assert_eq!(resolve_at(&s, &format!("{span_s}s")), Ok(end));
        let e = resolve_at(&s, "-5").unwrap_err();
        assert!(e.contains("before the trace start") && e.contains(&format!("time_us {start} to {end}")), "{e}");
        let e = resolve_at(&s, &format!("{}ms", (end - start) / 1000 + 10)).unwrap_err();
        assert!(e.contains("after the trace end"), "{e}");
        assert!(resolve_at(&s, "soon").unwrap_err().contains("is not a time"));
        let empty = Snapshot::default();
        assert!(resolve_at(&empty, "0").unwrap_err().contains("has none"));
    }

    #[test]
    fn top_text_shows_times_since_the_trace_start() {
        let s = mlp();
        let sum = crate::summary::summarize(&s);
        let start = crate::replay::time_range_us(&s, 0).unwrap().0;
        let tops = top_sites(&s, &sum.peaks(), 3, Some(start + 2500));
        let text = render_top_text(&tops);
        assert!(text.contains("at +2.500 ms into the trace"), "{text}");
        assert!(!text.contains(&start.to_string()), "no absolute time_us in the text: {text}");
    }
}
