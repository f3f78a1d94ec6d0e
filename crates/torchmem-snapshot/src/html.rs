//! The offline, self-contained HTML report of a snapshot: memory over time stacked by allocation
//! site, the peak's composition as an icicle chart of Python stacks, and a map of segments. Only
//! aggregates are embedded (≤ 1000 time buckets, pruned stack tree, capped segment runs), so a
//! 1 GB snapshot gives a page of a few hundred KB. No network resources: the CSS and JS (`assets/`, kept
//! as real files) are inlined into the page by a single-pass template. The what-if panel (the trace
//! replayed under other allocator settings) is drawn from plain rows ([`WhatIf`]) that the caller computes
//! (torchmem-sim, through the CLI or the Python binding): this crate does not depend on the simulator.

use std::collections::HashMap;

use serde::Serialize;
use serde_json::{json, Value as J};

use crate::fmt::{bytes, html_escape, signed_bytes};
use crate::model::*;
use crate::replay::{device_trace, live_at, Change, LiveBlock, LiveSet};
use crate::sites::{self, site_label};
use crate::summary::Summary;

const MAX_SERIES: usize = 12;
const MAX_BUCKETS: usize = 1000;
const MAX_SEGMENTS: usize = 300;
const MAX_RUNS_PER_SEGMENT: usize = 200;

/// Memory over time for one device, stacked by site: `series` names, `t_us` per bucket, `levels[s][b]`.
fn timeline(snap: &Snapshot, device: usize, peak_index: Option<usize>) -> J {
    let idxs = device_trace(snap, device);
    if idxs.is_empty() {
        return J::Null;
    }
    // Series: the largest sites at the peak, then "other".
    let at_peak = live_at(snap, device, peak_index);
    let rows = sites::group_sites(snap, &at_peak);
    let mut names: Vec<String> = rows.iter().take(MAX_SERIES).map(|r| r.site.clone()).collect();
    let other = names.len();
    names.push("other sites".into());
    let index_of: HashMap<&str, usize> = names.iter().enumerate().take(other).map(|(i, n)| (n.as_str(), i)).collect();
    let mut stack_series: HashMap<StackId, usize> = HashMap::new();
    let mut series_of = |stack: StackId| -> usize {
        *stack_series
            .entry(stack)
            .or_insert_with(|| index_of.get(site_label(snap, stack).as_str()).copied().unwrap_or(other))
    };
    // Initial levels: blocks alive before the first event.
    let mut level = vec![0i128; names.len()];
    let mut live = LiveSet::new();
    for b in live_at(snap, device, None) {
        level[series_of(b.stack)] += b.size_bytes as i128;
        live.seed(b);
    }
    let n = idxs.len();
    let buckets = n.min(MAX_BUCKETS);
    let mut out_levels = vec![vec![0u64; buckets]; names.len()];
    let mut out_t = vec![0i64; buckets];
    let mut best_total: Vec<i128> = vec![i128::MIN; buckets];
    let mut total: i128 = level.iter().sum();
    for (i, e) in idxs.iter().enumerate() {
        match live.apply(e) {
            Change::Alloc { size_bytes, stack, .. } => {
                level[series_of(stack)] += size_bytes as i128;
                total += size_bytes as i128;
            }
            Change::Free { block } => {
                level[series_of(block.stack)] -= block.size_bytes as i128;
                total -= block.size_bytes as i128;
            }
            Change::FreeWithoutAlloc { .. } | Change::None => {}
        }
        let b = i * buckets / n;
        if total > best_total[b] {
            best_total[b] = total;
            out_t[b] = e.time_us;
            for (s, l) in level.iter().enumerate() {
                out_levels[s][b] = (*l).max(0) as u64;
            }
        }
    }
    let start_us = idxs.first().map(|e| e.time_us).unwrap_or(0);
    json!({ "series": names, "start_us": start_us, "t_us": out_t, "levels": out_levels })
}

/// Icicle tree of Python frames (outermost first) of the blocks alive at the peak.
fn icicle(snap: &Snapshot, blocks: &[LiveBlock]) -> J {
    struct Node {
        name: String,
        bytes: u64,
        children: HashMap<String, usize>,
    }
    let mut nodes = vec![Node { name: "all live blocks".into(), bytes: 0, children: HashMap::new() }];
    let mut path_cache: HashMap<StackId, Vec<String>> = HashMap::new();
    for b in blocks {
        let path = path_cache.entry(b.stack).or_insert_with(|| {
            let mut p: Vec<String> = sites::python_frames(snap, b.stack, 24);
            p.reverse();
            if p.is_empty() {
                p.push("(no frames recorded)".into());
            }
            p
        });
        nodes[0].bytes += b.size_bytes;
        let mut cur = 0usize;
        for name in path.iter() {
            let next = match nodes[cur].children.get(name) {
                Some(&c) => c,
                None => {
                    let id = nodes.len();
                    nodes.push(Node { name: name.clone(), bytes: 0, children: HashMap::new() });
                    nodes[cur].children.insert(name.clone(), id);
                    id
                }
            };
            nodes[next].bytes += b.size_bytes;
            cur = next;
        }
    }
    let total = nodes[0].bytes.max(1);
    // Emit iteratively-bounded JSON (depth ≤ 25 by construction), pruning nodes < 0.2 % of total.
    fn emit(nodes: &[Node], i: usize, total: u64) -> J {
        let mut kids: Vec<usize> =
            nodes[i].children.values().copied().filter(|&c| nodes[c].bytes * 500 >= total).collect();
        kids.sort_by(|a, b| nodes[*b].bytes.cmp(&nodes[*a].bytes).then_with(|| nodes[*a].name.cmp(&nodes[*b].name)));
        kids.truncate(40);
        json!({ "n": nodes[i].name, "v": nodes[i].bytes, "c": kids.iter().map(|&c| emit(nodes, c, total)).collect::<Vec<_>>() })
    }
    emit(&nodes, 0, total)
}

/// Segments as runs of block states, largest segments first.
fn segment_map(snap: &Snapshot) -> J {
    let mut segs: Vec<&Segment> = snap.segments.iter().collect();
    segs.sort_by(|a, b| b.total_bytes.cmp(&a.total_bytes).then(a.address.cmp(&b.address)));
    let shown = segs.len().min(MAX_SEGMENTS);
    let mut out = Vec::with_capacity(shown);
    for s in segs.iter().take(shown) {
        let mut runs: Vec<(u8, u64)> = Vec::new();
        for b in &s.blocks {
            let st = match b.state {
                BlockState::ActiveAllocated => 0u8,
                BlockState::ActivePendingFree => 1,
                BlockState::Inactive => 2,
            };
            match runs.last_mut() {
                Some((ls, lb)) if *ls == st => *lb += b.size_bytes,
                _ => runs.push((st, b.size_bytes)),
            }
        }
        if runs.len() > MAX_RUNS_PER_SEGMENT {
            // Merge the smallest neighbours into "mixed" (3) runs so the bar stays drawable.
            let chunk = runs.len().div_ceil(MAX_RUNS_PER_SEGMENT);
            runs = runs
                .chunks(chunk)
                .map(|c| {
                    let sz: u64 = c.iter().map(|r| r.1).sum();
                    let st = if c.iter().all(|r| r.0 == c[0].0) { c[0].0 } else { 3 };
                    (st, sz)
                })
                .collect();
        }
        out.push(json!({
            "addr": format!("{:#x}", s.address),
            "device": s.device,
            "type": s.segment_type,
            "total": s.total_bytes,
            "runs": runs.iter().map(|(s, b)| json!([s, b])).collect::<Vec<_>>(),
        }));
    }
    json!({ "segments": out, "hidden": segs.len() - shown })
}

/// One row of the what-if panel: the trace replayed under one allocator setting (computed by the caller).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WhatIfRow {
    /// The setting, as a `PYTORCH_CUDA_ALLOC_CONF` string ("default" for none).
    pub settings: String,
    /// These are the settings the recording ran with.
    pub recorded: bool,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// `peak_reserved_bytes` minus that of the replay under the recorded settings.
    pub reserved_change_bytes: i64,
    pub num_alloc_retries: u64,
    /// The replay ran out of memory (for an OOM snapshot: with the memory the allocator could have had).
    pub oom: bool,
    /// For an OOM snapshot: the allocation that failed in the recording succeeds under this setting.
    pub avoids_recorded_oom: Option<bool>,
    /// The smallest memory limit (2 MiB steps) under which the trace runs without OOM; None when not
    /// computed, or (`min_memory_searched`) when no memory runs it.
    pub min_memory_bytes: Option<u64>,
    /// The minimum memory was searched: a `None` above then means no memory limit runs the trace (an
    /// allocation larger than an expandable segment's whole address space).
    pub min_memory_searched: bool,
    /// `min_memory_bytes` minus that of the recorded settings (the change an OOM panel shows: there the
    /// recorded settings' peak is only the peak up to the failure).
    pub min_memory_change_bytes: Option<i64>,
}

/// A row's "needs at least" cell: the memory, "never" when no memory runs the trace, "-" when not searched.
pub fn min_memory_cell(r: &WhatIfRow) -> String {
    match (r.min_memory_bytes, r.min_memory_searched) {
        (Some(m), _) => bytes(m),
        (None, true) => "never".into(),
        (None, false) => "-".into(),
    }
}

/// The what-if panel of one device: a one-sentence answer and the rows, or one line saying why the trace
/// cannot be simulated (no trace, a CUDA-graph pool, ...).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WhatIf {
    pub device: i64,
    /// Why there are no numbers (then `rows` is empty and `headline` repeats it).
    pub unavailable: Option<String>,
    /// "with expandable segments this run would have peaked at X reserved (-Y)", or the OOM verdict.
    pub headline: String,
    /// The snapshot holds an out-of-memory error (an `oom` trace entry).
    pub recorded_oom: bool,
    /// What every row was replayed under (memory, limit).
    pub conditions: String,
    pub rows: Vec<WhatIfRow>,
    pub notes: Vec<String>,
}

/// The panel's HTML (rows carry their exact numbers as data attributes).
pub fn whatif_html(panels: &[WhatIf]) -> String {
    let mut o = String::from("<section id=whatif><h2>What if: this trace under other allocator settings</h2>");
    if panels.is_empty() {
        o.push_str("<p class=\"whatif-none\">no what-if: the snapshot has no device with a trace or segments</p>");
    }
    for p in panels {
        o.push_str(&format!("<div class=whatif-device data-device={}>", p.device));
        if panels.len() > 1 {
            o.push_str(&format!("<h3>Device {}</h3>", p.device));
        }
        if let Some(why) = &p.unavailable {
            o.push_str(&format!("<p class=\"whatif-none\">no what-if: {}</p></div>", html_escape(why)));
            continue;
        }
        o.push_str(&format!("<p class=whatif-headline>{}</p>", html_escape(&p.headline)));
        o.push_str(&format!("<p class=note>{}</p>", html_escape(&p.conditions)));
        let change_head = if p.recorded_oom { "change (needs at least)" } else { "change (peak reserved)" };
        o.push_str(&format!(
            "<table class=whatif><tr><th>settings</th><th>peak allocated</th><th>peak reserved</th><th>{change_head}</th>\
             <th>retries</th>"
        ));
        if p.recorded_oom {
            o.push_str("<th>avoids the OOM</th>");
        } else {
            o.push_str("<th>OOM</th>");
        }
        o.push_str("<th>needs at least</th></tr>");
        for r in &p.rows {
            let verdict = match (p.recorded_oom, r.avoids_recorded_oom) {
                (true, Some(true)) => "yes",
                (true, Some(false)) => "no",
                (true, None) => "?",
                (false, _) if r.oom => "yes",
                (false, _) => "no",
            };
            let change = match (r.recorded, p.recorded_oom, r.min_memory_change_bytes) {
                (true, _, _) => "(recorded)".to_string(),
                (false, true, Some(c)) => signed_bytes(c),
                (false, true, None) => "-".to_string(),
                (false, false, _) => signed_bytes(r.reserved_change_bytes),
            };
            o.push_str(&format!(
                "<tr class=whatif-row data-settings=\"{}\" data-peak-reserved={} data-peak-allocated={} \
                 data-change={} data-retries={} data-oom={} data-avoids={} data-min-memory={}><td>{}{}</td><td>{}</td>\
                 <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                html_escape(&r.settings),
                r.peak_reserved_bytes,
                r.peak_allocated_bytes,
                r.reserved_change_bytes,
                r.num_alloc_retries,
                r.oom,
                r.avoids_recorded_oom.map(|b| b.to_string()).unwrap_or_else(|| "unknown".into()),
                r.min_memory_bytes
                    .map(|b| b.to_string())
                    .unwrap_or_else(|| { if r.min_memory_searched { "never" } else { "none" }.into() }),
                html_escape(&r.settings),
                if r.recorded { " (recorded)" } else { "" },
                bytes(r.peak_allocated_bytes),
                bytes(r.peak_reserved_bytes),
                change,
                r.num_alloc_retries,
                verdict,
                min_memory_cell(r),
            ));
        }
        o.push_str("</table>");
        for n in &p.notes {
            o.push_str(&format!("<p class=note>note: {}</p>", html_escape(n)));
        }
        o.push_str("</div>");
    }
    o.push_str("</section>");
    o
}

/// Renders the whole page (without the what-if panel).
pub fn render(snap: &Snapshot, summary: &Summary, name: &str) -> String {
    render_with_whatif(snap, summary, name, None)
}

/// Renders the whole page; `whatif`: the panel's rows per device, computed by the caller.
pub fn render_with_whatif(snap: &Snapshot, summary: &Summary, name: &str, whatif: Option<&[WhatIf]>) -> String {
    let dev = summary.devices.iter().find(|d| d.trace_entries > 0).or(summary.devices.first());
    let (device, peak_index) = dev.map(|d| (d.device, d.peak_index)).unwrap_or((0, None));
    let has_trace = dev.is_some_and(|d| d.trace_entries > 0);
    let peak_blocks: Vec<LiveBlock> = if has_trace {
        live_at(snap, device, peak_index)
    } else {
        snap.segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state != BlockState::Inactive)
            .map(|b| LiveBlock { addr: b.address, size_bytes: b.size_bytes, stack: b.stack, before_history: false })
            .collect()
    };
    let data = json!({
        "name": name,
        "device": device,
        "timeline": if has_trace { timeline(snap, device, peak_index) } else { J::Null },
        "icicle": icicle(snap, &peak_blocks),
        "segments": segment_map(snap),
    });
    let data_text = script_json(&data);
    let mut cards = String::new();
    for d in &summary.devices {
        cards.push_str(&format!(
            "<div class=card><h3>Device {}</h3><table>\
             <tr><td>reserved</td><td>{}</td></tr><tr><td>allocated</td><td>{}</td></tr>\
             <tr><td>reserved but unallocated</td><td>{}</td></tr><tr><td>inactive split</td><td>{}</td></tr>\
             <tr><td>largest free block</td><td>{}</td></tr><tr><td>traced peak (requested)</td><td>{}</td></tr>\
             <tr><td>trace entries</td><td>{}</td></tr></table><p class=note>{}</p></div>",
            d.device,
            bytes(d.reserved_bytes),
            bytes(d.allocated_bytes),
            bytes(d.reserved_unallocated_bytes),
            bytes(d.inactive_split_bytes),
            bytes(d.largest_free_block_bytes),
            bytes(d.peak_requested_bytes),
            d.trace_entries,
            html_escape(&d.history.note)
        ));
    }
    let actions: String = summary
        .action_counts
        .iter()
        .map(|(a, n)| format!("<tr><td>{}</td><td>{n}</td></tr>", html_escape(a)))
        .collect();
    fill(
        TEMPLATE,
        &[
            ("TITLE", &html_escape(name)),
            ("CARDS", &cards),
            ("ACTIONS", &actions),
            ("WHATIF", &whatif.map(whatif_html).unwrap_or_default()),
            ("DATA", &data_text),
            ("CSS", CSS),
            ("JS", JS),
        ],
    )
}

/// The page, its style and its drawing code (offline: all of it is inlined into the one file).
const TEMPLATE: &str = include_str!("assets/snapshot.html");
const CSS: &str = include_str!("assets/snapshot.css");
const JS: &str = include_str!("assets/snapshot.js");

/// Fills `{{NAME}}` placeholders in one pass: a value is never scanned again, so a snapshot named
/// `{{DATA}}.pickle` stays a title. Values must already be escaped for where they go. An unknown
/// placeholder is kept as it is.
pub fn fill(template: &str, values: &[(&str, &str)]) -> String {
    let extra: usize = values.iter().map(|(_, v)| v.len()).sum();
    let mut out = String::with_capacity(template.len() + extra);
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find("}}") {
            Some(end) => {
                let key = &after[..end];
                match values.iter().find(|(k, _)| *k == key) {
                    Some((_, v)) => out.push_str(v),
                    None => {
                        out.push_str("{{");
                        out.push_str(key);
                        out.push_str("}}");
                    }
                }
                rest = &after[end + 2..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// JSON text safe inside `<script type="application/json">`: no `</` (closes the element) and no `<!--`.
pub fn script_json(v: &J) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| "{}".into()).replace("</", "<\\/").replace("<!--", "<\\u0021--")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_is_single_pass() {
        let t = "<title>{{TITLE}}</title><script>{{DATA}}</script>{{NOPE}}";
        let got = fill(t, &[("TITLE", "{{DATA}}.pickle"), ("DATA", "{\"a\":1}")]);
        assert_eq!(got, "<title>{{DATA}}.pickle</title><script>{\"a\":1}</script>{{NOPE}}");
        assert_eq!(fill("{{", &[]), "{{");
    }

    #[test]
    fn script_json_cannot_close_the_element() {
        let j = serde_json::json!({"name": "</script><script>alert(1)</script><!--"});
        let s = script_json(&j);
        assert!(!s.contains("</") && !s.contains("<!--"), "{s}");
        let back: J = serde_json::from_str(&s).unwrap();
        assert_eq!(back, j);
    }

    #[test]
    fn a_snapshot_named_like_a_placeholder_gets_its_name_as_title() {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/snapshots/snapshot_mlp_adam_pystacks.pickle");
        let snap = crate::read_path(&p).unwrap();
        let sum = crate::summary::summarize(&snap);
        let page = render(&snap, &sum, "/tmp/{{DATA}}<b>.pickle");
        assert!(page.contains("<title>torchmem snapshot: /tmp/{{DATA}}&lt;b&gt;.pickle</title>"), "title");
        assert!(page.contains("<h1>Allocator snapshot: /tmp/{{DATA}}&lt;b&gt;.pickle</h1>"), "heading");
        assert_eq!(page.matches("<script id=data").count(), 1);
        assert_eq!(page.matches("\"timeline\":").count(), 1, "the data is embedded once");
        assert!(page.contains(JS.trim_end()) && page.contains(CSS.trim_end()));
    }

    fn row(settings: &str, recorded: bool, reserved: u64, change: i64, avoids: Option<bool>) -> WhatIfRow {
        WhatIfRow {
            settings: settings.into(),
            recorded,
            peak_allocated_bytes: 1 << 30,
            peak_reserved_bytes: reserved,
            reserved_change_bytes: change,
            num_alloc_retries: 1,
            oom: avoids == Some(false),
            avoids_recorded_oom: avoids,
            min_memory_bytes: Some(reserved + (2 << 20)),
            min_memory_searched: true,
            min_memory_change_bytes: Some(change),
        }
    }

    #[test]
    fn the_whatif_panel_carries_the_rows_and_the_reasons() {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/snapshots/snapshot_mlp_adam_pystacks.pickle");
        let snap = crate::read_path(&p).unwrap();
        let sum = crate::summary::summarize(&snap);
        let panels = vec![
            WhatIf {
                device: 0,
                unavailable: None,
                headline: "with expandable segments this OOM would have been avoided <b>".into(),
                recorded_oom: true,
                conditions: "replayed at the recorded capacity".into(),
                rows: vec![
                    row("default", true, 3 << 30, 0, Some(false)),
                    row("roundup_power2_divisions:[256:1,>:8]", false, 2 << 30, -(1 << 30), Some(true)),
                ],
                notes: vec!["a note".into()],
            },
            WhatIf {
                device: 1,
                unavailable: Some("segment at 0x1 belongs to private pool (1, 2)".into()),
                headline: String::new(),
                recorded_oom: false,
                conditions: String::new(),
                rows: Vec::new(),
                notes: Vec::new(),
            },
        ];
        let page = render_with_whatif(&snap, &sum, "x.pickle", Some(&panels));
        assert_eq!(page.matches("<section id=whatif>").count(), 1);
        assert!(page.contains("this OOM would have been avoided &lt;b&gt;"), "escaped headline");
        assert!(page.contains("<th>avoids the OOM</th>"));
        assert!(page.contains(&format!(
            "data-settings=\"roundup_power2_divisions:[256:1,&gt;:8]\" data-peak-reserved={} data-peak-allocated={} \
             data-change=-{} data-retries=1 data-oom=false data-avoids=true data-min-memory={}",
            2u64 << 30,
            1u64 << 30,
            1u64 << 30,
            (2u64 << 30) + (2 << 20)
        )));
        assert!(page.contains("<td>default (recorded)</td>") && page.contains("<td>(recorded)</td>"));
        assert!(page.contains("<td>-1.00 GiB</td>"), "the change, signed");
        assert!(page.contains("no what-if: segment at 0x1 belongs to private pool (1, 2)"));
        assert!(page.contains("<h3>Device 1</h3>") && page.contains("note: a note"));
        // Without rows the page has no panel; with none computed for any device, it says so.
        assert!(!render(&snap, &sum, "x.pickle").contains("id=whatif"));
        assert!(render_with_whatif(&snap, &sum, "x", Some(&[])).contains("no what-if: the snapshot has no device"));
    }
}
