//! The "What the memory is" section of every report, from `analysis::breakdown`: the composition at the
//! step peak (bytes and % of peak), the per-boundary table (mean and max of each category), parameters and
//! gradients per top-level module, optimizer state per param group, activations by module; the same as CSV
//! rows (`torchmem report --format csv --csv-table breakdown`) and as a stacked SVG timeline by category
//! for the HTML page. Without a breakdown each says how to record one (never zeros).

use std::collections::BTreeMap;

use crate::analysis::breakdown::{BoundaryRow, BreakdownSummary, PeakComposition, NO_BREAKDOWN_HINT};
use crate::breakdown::Category;
use crate::report::cells::Table;
use crate::report::svg::esc;
use crate::units::{format_bytes, format_delta, format_secs};

/// The section's heading in the text, Markdown and HTML reports.
pub const SECTION_TITLE: &str = "What the memory is";

fn signed_bytes(b: i64) -> String {
    if b < 0 {
        format_delta(b)
    } else {
        format_bytes(b as u64)
    }
}

/// Colours of the stacked layers (and the legend), by category.
pub fn color(c: Category) -> &'static str {
    match c {
        Category::Parameters => "#1f77b4",
        Category::Gradients => "#ff7f0e",
        Category::OptimizerState => "#2ca02c",
        Category::Activations => "#d62728",
        Category::Inputs => "#9467bd",
        Category::Other => "#8c564b",
        Category::Cache => "#bcbd22",
        Category::NonTorch => "#7f7f7f",
        Category::Allocated | Category::Reserved | Category::Rss => "#17becf",
    }
}

fn where_peak(p: &PeakComposition) -> String {
    let step = p.step.map(|s| format!("step {s}, ")).unwrap_or_default();
    format!("{step}{}, {}", p.phase, p.device)
}

/// Where the named categories of a composition were measured: the boundary, its step, and why that one.
fn read_at_note(p: &PeakComposition) -> String {
    let at = match p.boundary_step {
        Some(s) => format!("measured at step {s}'s {}", p.boundary),
        None => format!("measured at the {}", p.boundary),
    };
    let peak_step = p.step.map(|s| format!("step {s}")).unwrap_or_else(|| "the peak's step".into());
    match p.boundary_source {
        "peak step" => format!("{at}, the boundary nearest the {} phase's peak", p.phase),
        "nearest measured step" => format!(
            "{at}, the nearest measured step ({peak_step} was not measured: the breakdown measures the first 3 steps, then one in `breakdown_every`)"
        ),
        _ => format!("{at}, the last boundary measured before the {} phase began", p.phase),
    }
}

/// The composition at the step peak: one row per category, bytes and % of the peak's total.
pub fn composition_table(b: &BreakdownSummary) -> Table {
    let empty = if b.recorded {
        "no step or phase with a peak follows a boundary that carries a breakdown"
    } else {
        NO_BREAKDOWN_HINT
    };
    let Some(p) = &b.peak else {
        return Table::new(&format!("{SECTION_TITLE}: at the peak"), empty);
    };
    let mut t = Table::new(&format!("{SECTION_TITLE}: at the peak ({})", where_peak(p)), empty);
    t.headers = vec!["category".into(), "bytes".into(), "% of peak".into()];
    t.numeric = vec![false, true, true];
    for r in &p.rows {
        t.rows.push(vec![r.category.label().into(), signed_bytes(r.bytes), format!("{:.1}%", r.percent_of_peak)]);
    }
    t.rows.push(vec!["total".into(), format_bytes(p.total_bytes), "100.0%".into()]);
    let read_at = read_at_note(p);
    if p.basis == "allocator" {
        t.notes.push(format!(
            "parameters … inputs: {read_at}; other = peak allocated {} − those; allocator cache = peak reserved {} − peak allocated.",
            p.peak_allocated_bytes.map(format_bytes).unwrap_or_else(|| "-".into()),
            p.peak_reserved_bytes.map(format_bytes).unwrap_or_else(|| "-".into()),
        ));
        t.notes.push(match p.non_torch_source {
            Some("nvml") => "non-PyTorch = NVML's reading nearest the peak − reserved (CUDA context, libraries, other allocators); total = peak reserved + non-PyTorch.".into(),
            Some(_) => "non-PyTorch = the boundary's NVML reading − reserved (CUDA context, libraries, other allocators); total = peak reserved + non-PyTorch.".into(),
            None => "non-PyTorch: no NVML reading, so not shown; total = peak reserved.".into(),
        });
    } else {
        t.notes.push(format!(
            "CPU: parameters … inputs: {read_at}; other = the phase's peak RSS {} − those (the interpreter, libraries, other allocations).",
            format_bytes(p.total_bytes)
        ));
    }
    if b.folded_boundaries > 0 {
        t.notes.push("The peak is over the steps kept as markers (the first ones of a long run).".into());
    }
    t
}

/// The categories shown in the per-boundary table: those measured somewhere, in the stacking order.
fn boundary_categories(rows: &[BoundaryRow]) -> Vec<Category> {
    // Every category but reserved (the cache column already says what reserved adds to allocated).
    Category::ALL
        .into_iter()
        .filter(|&c| c != Category::Reserved && rows.iter().any(|r| r.categories.contains_key(&c)))
        .collect()
}

fn mean_max(r: &BoundaryRow, c: Category) -> String {
    match r.categories.get(&c) {
        None => "-".into(),
        Some(m) if m.mean_bytes == m.max_bytes => format_bytes(m.mean_bytes),
        Some(m) => format!("{} (max {})", format_bytes(m.mean_bytes), format_bytes(m.max_bytes)),
    }
}

/// Per boundary and device: the mean (and max, when it differs) of each category over every step.
pub fn boundaries_table(b: &BreakdownSummary) -> Table {
    let mut t =
        Table::new(&format!("{SECTION_TITLE}: per boundary"), if b.recorded { "none" } else { NO_BREAKDOWN_HINT });
    if b.boundaries.is_empty() {
        return t;
    }
    let several = {
        let mut who: Vec<_> = b.boundaries.iter().map(|r| (r.pid, r.rank)).collect();
        who.dedup();
        who.len() > 1
    };
    let cats = boundary_categories(&b.boundaries);
    if several {
        t.headers.push("process".into());
        t.numeric.push(false);
    }
    for h in ["boundary", "device", "steps"] {
        t.headers.push(h.into());
        t.numeric.push(h == "steps");
    }
    for c in &cats {
        t.headers.push(c.label().into());
        t.numeric.push(true);
    }
    for r in &b.boundaries {
        let mut row = Vec::new();
        if several {
            row.push(match (r.rank, r.pid) {
                (Some(rank), _) => format!("rank {rank}"),
                (None, Some(pid)) => format!("pid {pid}"),
                (None, None) => "-".into(),
            });
        }
        row.push(r.boundary.clone());
        row.push(r.device.clone());
        row.push(r.count.to_string());
        for c in &cats {
            row.push(mean_max(r, *c));
        }
        t.rows.push(row);
    }
    t.notes.push("Mean over every step at that boundary, (max …) where it varied; counted by storage (a storage shared by views or tied weights counts once).".into());
    if b.folded_boundaries > 0 {
        t.notes.push(format!(
            "{} boundaries of later steps were folded into exact aggregates (counted here; the other tables read the kept steps).",
            b.folded_boundaries
        ));
    }
    t
}

/// Parameters and gradients per top-level module.
pub fn modules_table(b: &BreakdownSummary) -> Option<Table> {
    if b.modules.is_empty() {
        return None;
    }
    let dev = b.detail_device.clone().unwrap_or_default();
    let mut t = Table::new(&format!("{SECTION_TITLE}: parameters and gradients per module ({dev})"), "none");
    t.headers = vec!["module".into(), "parameters".into(), "gradients".into()];
    t.numeric = vec![false, true, true];
    for r in &b.modules {
        t.rows.push(vec![
            r.module.clone(),
            format_bytes(r.parameters_bytes),
            r.gradients_bytes.map(format_bytes).unwrap_or_else(|| "-".into()),
        ]);
    }
    Some(t)
}

/// Optimizer state per param group.
pub fn param_groups_table(b: &BreakdownSummary) -> Option<Table> {
    if b.param_groups.is_empty() {
        return None;
    }
    let dev = b.detail_device.clone().unwrap_or_default();
    let mut t = Table::new(&format!("{SECTION_TITLE}: optimizer state per param group ({dev})"), "none");
    t.headers = vec!["param group".into(), "optimizer state".into()];
    t.numeric = vec![true, true];
    for g in &b.param_groups {
        t.rows.push(vec![g.group.to_string(), format_bytes(g.optimizer_state_bytes)]);
    }
    Some(t)
}

/// Activations by module, largest first (opt-in: `Monitor(..., activations="modules")`).
pub fn activations_table(b: &BreakdownSummary) -> Option<Table> {
    if b.activations_by_module.is_empty() {
        return None;
    }
    let mut t = Table::new(&format!("{SECTION_TITLE}: activations by module (end of forward)"), "none");
    t.headers = vec!["module".into(), "activations".into()];
    t.numeric = vec![false, true];
    for r in &b.activations_by_module {
        t.rows.push(vec![r.module.clone(), format_bytes(r.activations_bytes)]);
    }
    t.notes.push(
        "Bytes each module's forward left saved for backward, counted once per storage, in the innermost module."
            .into(),
    );
    Some(t)
}

/// Every table of the section, in order.
pub fn tables(b: &BreakdownSummary) -> Vec<Table> {
    let mut out = vec![composition_table(b)];
    if b.recorded {
        out.push(boundaries_table(b));
    }
    out.extend(modules_table(b));
    out.extend(param_groups_table(b));
    out.extend(activations_table(b));
    out
}

/// The in-process Monitor's "Breakdown" table: the per-boundary means (and the composition at the peak).
pub fn monitor_tables(b: &BreakdownSummary) -> Vec<Table> {
    if !b.recorded {
        return vec![Table::new("Breakdown", NO_BREAKDOWN_HINT)];
    }
    let mut per_boundary = boundaries_table(b);
    per_boundary.title = "Breakdown".into();
    let mut out = vec![per_boundary];
    if b.peak.is_some() {
        out.push(composition_table(b));
    }
    out
}

/// The kept boundaries as CSV: one row per (boundary, device), bytes per category (empty: not measured).
pub fn render_csv(b: &BreakdownSummary) -> String {
    let mut out = String::from("t_s,pid,step,boundary,device");
    for c in Category::ALL {
        out.push_str(&format!(",{}_bytes", c.as_str()));
    }
    out.push('\n');
    let quote = |s: &str| {
        if s.contains([',', '"', '\n']) {
            format!("\"{}\"", s.replace('"', "\"\""))
        } else {
            s.to_string()
        }
    };
    for p in &b.timeline {
        out.push_str(&format!(
            "{:.6},{},{},{},{}",
            p.t_ns as f64 / 1e9,
            p.pid.map(|v| v.to_string()).unwrap_or_default(),
            p.step.map(|v| v.to_string()).unwrap_or_default(),
            quote(&p.boundary),
            quote(&p.device)
        ));
        for c in Category::ALL {
            out.push(',');
            if let Some(v) = p.categories.get(&c) {
                out.push_str(&v.to_string());
            }
        }
        out.push('\n');
    }
    out
}

/// The stacked timeline by category (one chart per device): every kept boundary is a column, its
/// categories stacked bottom-up in `Category::STACKED` order; a legend names each category drawn.
pub fn render_stacked_svg(b: &BreakdownSummary) -> String {
    let mut devices: Vec<&str> = b.timeline.iter().map(|p| p.device.as_str()).collect();
    devices.sort_unstable();
    devices.dedup();
    let mut out = String::new();
    for dev in devices {
        let points: Vec<_> = b.timeline.iter().filter(|p| p.device == dev).collect();
        let cats: Vec<Category> = Category::STACKED
            .into_iter()
            .filter(|c| points.iter().any(|p| p.categories.get(c).is_some_and(|v| *v > 0)))
            .collect();
        let stack = |p: &BTreeMap<Category, u64>| cats.iter().map(|c| p.get(c).copied().unwrap_or(0)).sum::<u64>();
        let top = points.iter().map(|p| stack(&p.categories)).max().unwrap_or(0).max(1) as f64;
        let (w, h, left, right, top_pad, bottom) = (960.0, 300.0, 80.0, 16.0, 34.0, 40.0);
        let plot_w = w - left - right;
        let plot_h = h - top_pad - bottom;
        let n = points.len().max(1) as f64;
        let x = |i: usize| left + plot_w * i as f64 / (n - 1.0).max(1.0);
        let y = |v: f64| top_pad + plot_h * (1.0 - v / top);
        out.push_str(&format!(
            "<svg class=\"tm-breakdown\" data-device=\"{}\" viewBox=\"0 0 {w} {h}\" width=\"{w}\" height=\"{h}\" role=\"img\" aria-label=\"memory by category over the run, {}\">\n",
            esc(dev),
            esc(dev)
        ));
        out.push_str(&format!("<rect x=\"{left}\" y=\"{top_pad}\" width=\"{plot_w}\" height=\"{plot_h}\" fill=\"#fafafa\" stroke=\"#ddd\"/>\n"));
        // Layers: the area between the stack below a category and the stack including it.
        let mut below = vec![0u64; points.len()];
        for c in &cats {
            let upper: Vec<u64> =
                points.iter().zip(&below).map(|(p, b)| b + p.categories.get(c).copied().unwrap_or(0)).collect();
            let mut d = String::new();
            if points.len() == 1 {
                let (x0, x1) = (left, left + plot_w);
                d.push_str(&format!(
                    "M{x0:.1},{:.1} L{x1:.1},{:.1} L{x1:.1},{:.1} L{x0:.1},{:.1} Z",
                    y(upper[0] as f64),
                    y(upper[0] as f64),
                    y(below[0] as f64),
                    y(below[0] as f64)
                ));
            } else {
                for (i, v) in upper.iter().enumerate() {
                    d.push_str(&format!("{}{:.1},{:.1} ", if i == 0 { "M" } else { "L" }, x(i), y(*v as f64)));
                }
                for (i, v) in below.iter().enumerate().rev() {
                    d.push_str(&format!("L{:.1},{:.1} ", x(i), y(*v as f64)));
                }
                d.push('Z');
            }
            out.push_str(&format!(
                "<path class=\"layer\" data-category=\"{}\" d=\"{}\" fill=\"{}\" fill-opacity=\"0.85\"><title>{}</title></path>\n",
                c.as_str(),
                d.trim_end(),
                color(*c),
                esc(c.label())
            ));
            below = upper;
        }
        // Axes: the top value, 0, the time of the first and last boundary.
        let label = |x: f64, y: f64, anchor: &str, text: &str| {
            format!(
                "<text x=\"{x:.1}\" y=\"{y:.1}\" font-size=\"11\" fill=\"#555\" text-anchor=\"{anchor}\">{}</text>\n",
                esc(text)
            )
        };
        out.push_str(&label(left - 6.0, top_pad + 4.0, "end", &format_bytes(top as u64)));
        out.push_str(&label(left - 6.0, top_pad + plot_h, "end", "0"));
        if let (Some(first), Some(last)) = (points.first(), points.last()) {
            out.push_str(&label(left, h - bottom + 14.0, "start", &format_secs(first.t_ns)));
            out.push_str(&label(left + plot_w, h - bottom + 14.0, "end", &format_secs(last.t_ns)));
        }
        out.push_str(&label(
            left + plot_w / 2.0,
            h - 8.0,
            "middle",
            &format!(
                "{} boundaries on {dev} (step start, end of forward, end of backward, end of optimizer step)",
                points.len()
            ),
        ));
        // Legend.
        let mut lx = left;
        out.push_str("<g class=\"legend\">\n");
        for c in &cats {
            out.push_str(&format!(
                "<g class=\"legend-item\" data-category=\"{}\"><rect x=\"{lx:.1}\" y=\"10\" width=\"11\" height=\"11\" fill=\"{}\"/><text x=\"{:.1}\" y=\"20\" font-size=\"12\" fill=\"#222\">{}</text></g>\n",
                c.as_str(),
                color(*c),
                lx + 15.0,
                esc(c.label())
            ));
            lx += 22.0 + 7.0 * c.label().chars().count() as f64;
        }
        out.push_str("</g>\n</svg>\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::breakdown::breakdown_summary;
    use crate::breakdown::DeviceBreakdown;
    use crate::model::*;

    const MIB: u64 = 1 << 20;

    /// Two hand-built CPU steps: step start and end of forward carry a breakdown.
    fn hand_built_cpu_run() -> Vec<Marker> {
        let mk = |t: u64, kind, edge, name: &str, idx: Option<i64>, rss: u64, b: Option<(u64, u64)>| Marker {
            t_ns: t,
            kind,
            edge,
            name: name.into(),
            index: idx,
            memory: MarkerMemory { rss_bytes: Some(rss), peak_rss_bytes: Some(rss + MIB), ..Default::default() },
            origin: Origin::default(),
            device: None,
            breakdown: b.map(|(params, acts)| {
                vec![DeviceBreakdown {
                    device: "cpu".into(),
                    parameters_bytes: Some(params),
                    gradients_bytes: Some(params),
                    optimizer_state_bytes: Some(2 * params),
                    activations_bytes: Some(acts),
                    inputs_bytes: Some(MIB / 4),
                    rss_bytes: Some(rss),
                    by_module: crate::breakdown::ModuleBytes {
                        parameters: [("0".to_string(), params)].into(),
                        gradients: [("0".to_string(), params)].into(),
                    },
                    by_param_group: vec![2 * params],
                    ..Default::default()
                }]
            }),
            activations_by_module: None,
        };
        let mut v = Vec::new();
        for i in 0..2u64 {
            let t = i * 1_000_000_000;
            v.push(mk(t, MarkerKind::Step, Edge::Start, "step", Some(i as i64), 300 * MIB, Some((10 * MIB, 0))));
            v.push(mk(t + 1, MarkerKind::Phase, Edge::Start, "forward", None, 300 * MIB, None));
            v.push(mk(t + 500, MarkerKind::Phase, Edge::End, "forward", None, 340 * MIB, Some((10 * MIB, 30 * MIB))));
            v.push(mk(t + 900, MarkerKind::Step, Edge::End, "step", Some(i as i64), 310 * MIB, None));
        }
        v
    }

    #[test]
    fn snapshot_of_the_text_tables() {
        // Hand-checked: peak RSS 341 MiB (the forward's exit peak), read at that step's end of forward;
        // other = 341 − (10 + 10 + 20 + 30 + 0.25) MiB = 270.75 MiB = 79.4 % of it.
        let b = breakdown_summary(&hand_built_cpu_run(), &[], &[], &[]);
        let text: String = tables(&b).iter().take(2).map(crate::report::table::render_table).collect();
        let want = "\
What the memory is: at the peak (step 0, forward, cpu)
  category             bytes  % of peak
  ---------------  ---------  ---------
  parameters        10.0 MiB       2.9%
  gradients         10.0 MiB       2.9%
  optimizer state   20.0 MiB       5.9%
  activations       30.0 MiB       8.8%
  inputs           256.0 KiB       0.1%
  other            270.8 MiB      79.4%
  total            341.0 MiB     100.0%
  CPU: parameters … inputs: measured at step 0's end of forward, the boundary nearest the forward phase's peak; other = the phase's peak RSS 341.0 MiB − those (the interpreter, libraries, other allocations).

What the memory is: per boundary
  boundary        device  steps  parameters  gradients  optimizer state  activations     inputs        RSS
  --------------  ------  -----  ----------  ---------  ---------------  -----------  ---------  ---------
  step start      cpu         2    10.0 MiB   10.0 MiB         20.0 MiB          0 B  256.0 KiB  300.0 MiB
  end of forward  cpu         2    10.0 MiB   10.0 MiB         20.0 MiB     30.0 MiB  256.0 KiB  340.0 MiB
  Mean over every step at that boundary, (max …) where it varied; counted by storage (a storage shared by views or tied weights counts once).

";
        assert_eq!(text, want, "{text}");
        let all: String = tables(&b).iter().map(crate::report::table::render_table).collect();
        assert!(
            all.contains("parameters and gradients per module (cpu)")
                && all.contains("optimizer state per param group")
        );
        assert!(!all.contains("activations by module"), "not recorded, so no table");
    }

    #[test]
    fn without_a_breakdown_every_format_says_how_to_get_one() {
        let b = breakdown_summary(&[], &[], &[], &[]);
        let text: String = tables(&b).iter().map(crate::report::table::render_table).collect();
        assert!(text.contains("torchmem.Monitor(model, optimizer)") && !text.contains("0 B"), "{text}");
        assert_eq!(render_stacked_svg(&b), "");
        assert_eq!(render_csv(&b).lines().count(), 1, "the header only");
        assert!(monitor_tables(&b)[0].empty.contains("torchmem.watch"));
    }

    #[test]
    fn csv_and_stacked_chart_carry_every_kept_boundary() {
        let b = breakdown_summary(&hand_built_cpu_run(), &[], &[], &[]);
        let csv = render_csv(&b);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 5);
        assert!(lines[0].starts_with("t_s,pid,step,boundary,device,parameters_bytes,gradients_bytes"));
        assert_eq!(lines[2].split(',').nth(3), Some("end of forward"));
        assert_eq!(lines[2].split(',').nth(5), Some((10 * MIB).to_string().as_str()));
        let svg = render_stacked_svg(&b);
        assert_eq!(svg.matches("<svg").count(), 1);
        for c in ["parameters", "gradients", "optimizer_state", "activations", "inputs"] {
            assert!(svg.contains(&format!("class=\"layer\" data-category=\"{c}\"")), "{c}");
            assert!(svg.contains(&format!("class=\"legend-item\" data-category=\"{c}\"")), "{c}");
        }
        assert!(!svg.contains("data-category=\"cache\""), "the CPU has no allocator cache");
    }
}
