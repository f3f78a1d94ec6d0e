//! The Monitor's views, rendered from its `MarkerLog` (the Python Monitor keeps the hooks and pushes each
//! marker into the log; this is everything it shows): `summary()` as text (per-epoch and per-phase tables,
//! growth warnings; as data it is `MarkerLog::summary`), the same tables as HTML for Jupyter's rich display
//! (`summary_html`: `cells` tables drawn by `html::render_table`, as every report's HTML is), the journey as
//! text or Mermaid, and the line and growth warnings printed when an epoch ends.

use serde::Serialize;

use crate::analysis::{EpochRow, MarkerLog, Summary};
use crate::error::Result;
use crate::journey;
use crate::model::Marker;
use crate::report::{breakdown, cells, html, svg::esc, table};
use crate::units::{format_delta, format_opt_bytes};

/// Parses markers in their `model::Marker` serde form (a JSON list).
pub fn parse_markers(markers_json: &str) -> Result<Vec<Marker>> {
    Ok(serde_json::from_str(markers_json)?)
}

/// The Monitor's `summary()` text: the per-epoch table, the per-phase table, growth warnings.
pub fn summary_text(log: &MarkerLog, capacity_bytes: Option<u64>) -> String {
    let s = log.summary(capacity_bytes);
    let mut out = String::new();
    if !s.epochs.is_empty() {
        out.push_str(&table::render_epochs(&s.epochs));
    }
    if s.steps > 0 {
        out.push_str(&format!("{} step{}\n", s.steps, if s.steps == 1 { "" } else { "s" }));
    }
    if !s.phases.is_empty() {
        out.push_str(&table::render_phases(&s.phases));
    }
    if s.steps > 0 || !s.phases.is_empty() || s.breakdown.recorded {
        // "Breakdown": what the memory is at each boundary, or how to record it.
        for t in crate::report::breakdown::monitor_tables(&s.breakdown) {
            out.push_str(&table::render_table(&t));
        }
    }
    out.push_str(&table::render_growth(&s.growth));
    if out.is_empty() {
        out.push_str("no epochs, steps or phases recorded yet\n");
    }
    out
}

/// The rules `summary_html`'s tables need where no stylesheet is (a notebook's output cell), scoped to its div.
const MONITOR_STYLE: &str = "<style>\
.torchmem-monitor{font-family:sans-serif;font-size:12px;margin:4px 0}\
.torchmem-monitor h3{font-size:13px;margin:6px 0 2px}\
.torchmem-monitor table{border-collapse:collapse}\
.torchmem-monitor th,.torchmem-monitor td{padding:2px 10px;white-space:nowrap;border-bottom:1px solid #ddd;text-align:left}\
.torchmem-monitor th{background:#eee}\
.torchmem-monitor .num{text-align:right}\
.torchmem-monitor .note,.torchmem-monitor .empty{font-size:11px;color:#666;margin:2px 0}\
.torchmem-monitor .warning{color:#b00}\
</style>";

/// The Monitor's rich display (Jupyter's `_repr_html_`): the tables `summary_text` draws (epochs, phases, the
/// breakdown), then the journey and the growth warnings, each table only when it has rows; one
/// self-contained `<div>` (a scoped `<style>`, no script, nothing loaded), every cell escaped.
pub fn summary_html(log: &MarkerLog, capacity_bytes: Option<u64>) -> String {
    let s = log.summary(capacity_bytes);
    let mut tables = Vec::new();
    if !s.epochs.is_empty() {
        tables.push(cells::epochs_table(&s.epochs));
    }
    if !s.phases.is_empty() {
        let mut t = cells::phases_table(&s.phases);
        t.title = format!("Phases ({} step{})", s.steps, if s.steps == 1 { "" } else { "s" });
        tables.push(t);
    }
    if s.steps > 0 || !s.phases.is_empty() || s.breakdown.recorded {
        tables.extend(breakdown::monitor_tables(&s.breakdown));
    }
    if !s.journey.is_empty() {
        tables.push(cells::journey_table(&s.journey));
    }
    let mut out = format!("<div class=\"torchmem-monitor\">{MONITOR_STYLE}");
    for t in &tables {
        out.push_str(&html::render_table(t));
    }
    for g in &s.growth {
        out.push_str(&format!("<p class=\"warning\">WARNING: {}</p>\n", esc(&super::findings::growth_message(g))));
    }
    if tables.is_empty() && s.growth.is_empty() {
        out.push_str("<p>torchmem.Monitor: nothing recorded yet</p>");
    }
    out.push_str("</div>");
    out
}

/// The journey as text or as a Mermaid `journey` diagram.
pub fn journey_render(log: &MarkerLog, capacity_bytes: Option<u64>, mermaid: bool, title: &str) -> String {
    let stages = log.summary(capacity_bytes).journey;
    if mermaid {
        journey::render_mermaid(&stages, title)
    } else {
        journey::render_text(&stages)
    }
}

/// What the Monitor prints and warns about when an epoch ends.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochReport {
    /// One line: `epoch 3: allocated 1.2 GiB, reserved 2.0 GiB, peak 1.8 GiB, CPU RSS 900.1 MiB, growth +0 B`.
    pub line: String,
    pub row: Option<EpochRow>,
    /// Growth warnings over all epochs so far (empty when memory does not grow every epoch).
    pub growth: Vec<String>,
    pub growth_per_epoch_bytes: Option<i64>,
}

/// The line and warnings for the last finished epoch, from the epoch markers (start/end pairs) so far.
pub fn epoch_report(epoch_markers: &[Marker]) -> EpochReport {
    let s = Summary::from_markers(epoch_markers, None);
    let row = s.epochs.iter().rev().find(|r| r.duration_ns.is_some()).cloned();
    let line = match &row {
        None => "epoch: no finished epoch".to_string(),
        Some(r) => epoch_line(r),
    };
    EpochReport {
        line,
        row,
        growth_per_epoch_bytes: s.growth.first().map(|g| g.per_unit_bytes),
        growth: s.growth.iter().map(super::findings::growth_message).collect(),
    }
}

pub fn epoch_line(r: &EpochRow) -> String {
    let mut parts = Vec::new();
    if r.allocated_bytes.is_some() || r.reserved_bytes.is_some() {
        parts.push(format!("allocated {}", format_opt_bytes(r.allocated_bytes)));
        parts.push(format!("reserved {}", format_opt_bytes(r.reserved_bytes)));
        parts.push(format!("peak {}", format_opt_bytes(r.peak_allocated_bytes)));
    }
    parts.push(format!("CPU RSS {}", format_opt_bytes(r.rss_bytes)));
    parts.push(format!("peak RSS {}", format_opt_bytes(r.peak_rss_bytes)));
    let growth = match (r.growth_allocated_bytes, r.growth_rss_bytes) {
        (Some(g), Some(c)) => format!("growth {} (RSS {})", format_delta(g), format_delta(c)),
        (None, Some(c)) => format!("growth RSS {}", format_delta(c)),
        (Some(g), None) => format!("growth {}", format_delta(g)),
        (None, None) => "growth -".to_string(),
    };
    parts.push(growth);
    let secs = r.duration_ns.map(|ns| format!(" ({:.2} s)", ns as f64 / 1e9)).unwrap_or_default();
    format!("epoch {}{}: {}", r.index, secs, parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Edge;

    const MIB: u64 = 1 << 20;

    /// An epoch marker in its wire/serde form (the fields a Python Monitor sends).
    fn epoch(t: u64, edge: Edge, idx: i64, rss: u64) -> Marker {
        let peak = (edge == Edge::End).then_some(rss + MIB);
        let edge = serde_json::to_value(edge).unwrap();
        serde_json::from_value(serde_json::json!({
            "t_ns": t, "kind": "epoch", "edge": edge, "name": "epoch", "index": idx,
            "memory": {"rss_bytes": rss, "peak_rss_bytes": peak},
        }))
        .unwrap()
    }

    #[test]
    fn summary_html_draws_the_text_summarys_tables_self_contained() {
        let empty = summary_html(&MarkerLog::new(None), None);
        assert!(empty.contains("nothing recorded yet") && !empty.contains("Epochs"), "{empty}");
        let mut log = MarkerLog::new(None);
        for e in 0..3 {
            log.push(epoch(e as u64 * 10, Edge::Start, e, 100 * MIB + e as u64 * 8 * MIB));
            log.push(epoch(e as u64 * 10 + 5, Edge::End, e, 100 * MIB + (e as u64 + 1) * 8 * MIB));
        }
        let h = summary_html(&log, None);
        assert!(h.starts_with("<div class=\"torchmem-monitor\"><style>") && h.ends_with("</div>"), "{h}");
        assert!(h.contains("<h3>Epochs</h3>") && h.contains("<td class=\"num\">124.0 MiB</td>"), "{h}");
        assert!(h.contains("WARNING: ") && h.contains("+8.0 MiB per epoch"), "{h}");
        assert!(!h.contains("<script") && !h.contains("src="), "{h}");
        // A phase's name is the user's text: escaped, never markup.
        let mut named = MarkerLog::new(None);
        for (t, edge) in [(0, "start"), (5, "end")] {
            named.push(
                serde_json::from_value(serde_json::json!({
                    "t_ns": t, "kind": "phase", "edge": edge, "name": "<img onerror=x>",
                    "memory": {"rss_bytes": 100 * MIB},
                }))
                .unwrap(),
            );
        }
        let h = summary_html(&named, None);
        assert!(h.contains("&lt;img onerror=x&gt;") && !h.contains("<img"), "{h}");
    }

    #[test]
    fn epoch_report_says_the_growth_per_epoch() {
        let mut m = Vec::new();
        for e in 0..4 {
            m.push(epoch(e as u64 * 10, Edge::Start, e, 100 * MIB + e as u64 * 8 * MIB));
            m.push(epoch(e as u64 * 10 + 5, Edge::End, e, 100 * MIB + (e as u64 + 1) * 8 * MIB));
        }
        let r = epoch_report(&m);
        assert!(r.line.starts_with("epoch 3"), "{}", r.line);
        assert!(r.line.contains("CPU RSS 132.0 MiB") && r.line.contains("growth RSS +8.0 MiB"), "{}", r.line);
        assert_eq!(r.growth_per_epoch_bytes, Some(8 * MIB as i64));
        assert!(r.growth[0].contains("+8.0 MiB per epoch"), "{:?}", r.growth);
        // Flat memory: no warning.
        let flat: Vec<Marker> = (0..4)
            .flat_map(|e| {
                [epoch(e as u64 * 10, Edge::Start, e, 100 * MIB), epoch(e as u64 * 10 + 5, Edge::End, e, 100 * MIB)]
            })
            .collect();
        assert!(epoch_report(&flat).growth.is_empty());
    }

    #[test]
    fn epoch_growth_judges_rss_less_mallocs_free_bytes_where_the_monitor_read_it() {
        // A healthy CNN's shape (issue 28 item 9): raw RSS rose at every epoch end by glibc's freed memory
        // (+28 MiB per epoch), RSS less malloc's free bytes stayed flat: no warning.
        let with_held = |e: i64, edge: Edge, rss: u64, held: u64| {
            let mut m = epoch(e as u64 * 10 + (edge == Edge::End) as u64 * 5, edge, e, rss);
            if edge == Edge::End {
                m.memory.held_rss_bytes = Some(held);
            }
            m
        };
        let healthy: Vec<Marker> = (0..3)
            .flat_map(|e| {
                let rss = 900 * MIB + e as u64 * 28 * MIB;
                [with_held(e, Edge::Start, rss, 0), with_held(e, Edge::End, rss + 28 * MIB, 770 * MIB)]
            })
            .collect();
        let r = epoch_report(&healthy);
        assert!(r.growth.is_empty(), "{:?}", r.growth);
        assert_eq!(r.row.unwrap().growth_rss_bytes, Some(28 * MIB as i64), "the table still shows raw RSS");
        // A real leak: the held series rises too, and warns by its own growth.
        let leak: Vec<Marker> = (0..3)
            .flat_map(|e| {
                let rss = 900 * MIB + e as u64 * 28 * MIB;
                [
                    with_held(e, Edge::Start, rss, 0),
                    with_held(e, Edge::End, rss + 28 * MIB, 770 * MIB + e as u64 * 20 * MIB),
                ]
            })
            .collect();
        let r = epoch_report(&leak);
        assert!(r.growth[0].contains("+20.0 MiB per epoch"), "{:?}", r.growth);
        // Markers without it (a profile): raw RSS, as before.
        let raw: Vec<Marker> = healthy
            .into_iter()
            .map(|mut m| {
                m.memory.held_rss_bytes = None;
                m
            })
            .collect();
        assert!(epoch_report(&raw).growth[0].contains("+28.0 MiB per epoch"));
    }

    #[test]
    fn views_of_a_log_of_python_markers() {
        let json = r#"[{"t_ns":1,"kind":"mark","edge":"point","name":"Device checked","index":null,"memory":{"rss_bytes":10}},
                       {"t_ns":2,"kind":"phase","edge":"start","name":"forward","index":null,"memory":{"rss_bytes":10}},
                       {"t_ns":3,"kind":"phase","edge":"end","name":"forward","index":null,"memory":{"rss_bytes":20,"peak_rss_bytes":30}}]"#;
        let mut log = MarkerLog::new(None);
        for m in parse_markers(json).unwrap() {
            assert!(log.push(m));
        }
        let text = journey_render(&log, Some(1000), false, "run");
        assert!(text.contains("Device checked") && text.contains("forward"), "{text}");
        let mermaid = journey_render(&log, Some(1000), true, "run");
        assert!(mermaid.starts_with("journey\n"));
        assert!(summary_text(&log, None).contains("forward"));
        assert!(parse_markers("[{}]").is_err());
    }
}
