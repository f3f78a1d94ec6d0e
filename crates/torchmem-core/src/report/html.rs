//! The HTML report (`torchmem plot`): ONE self-contained file that works offline. It holds the memory chart
//! (inline SVG from `svg.rs`), a small inline script for the hover read-out (time, epoch, phase and every
//! series' value under the cursor), the report's tables and the line profile. Nothing is loaded from the
//! network: no script, style, font or image URL appears in the file.
//!
//! The chart stays small on long runs: each series is cut to one min/max pair per pixel column
//! (`timeline.rs`), so a 1-hour 100 Hz profile gives the same size of page as a 10-second one.
//! Opening the file with `#t=12.5` at the end of its URL puts the cursor at 12.5 s (a link to a moment).

use serde_json::json;

use crate::analysis::Summary;
use crate::journey;
use crate::lines;
use crate::model::Profile;
use crate::report::cells::{self, Table};
use crate::report::mermaid;
use crate::report::svg::{esc, render_chart, Layout};
use crate::report::timeline::Timeline;

const STYLE: &str = r#"
:root { color-scheme: light; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; margin: 24px auto; max-width: 1240px; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
code, pre { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12.5px; }
pre { background: #f6f6f6; padding: 10px; overflow-x: auto; }
dl.meta { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 8px 0; font-size: 14px; }
dl.meta dt { color: #666; } dl.meta dd { margin: 0; }
.warning { background: #fff4d6; border-left: 4px solid #e0a100; padding: 8px 12px; margin: 10px 0; font-size: 14px; }
.chart-box { position: relative; overflow-x: auto; }
#tm-chart { display: block; max-width: 100%; height: auto; cursor: crosshair; }
#tm-readout { font-size: 13px; min-height: 40px; padding: 6px 10px; background: #f7f7fa; border: 1px solid #e3e3ea; border-radius: 4px; margin-bottom: 6px; display: flex; flex-wrap: wrap; gap: 4px 18px; align-items: center; }
#tm-readout .sw { display: inline-block; width: 10px; height: 10px; margin-right: 5px; border-radius: 2px; vertical-align: -1px; }
#tm-readout .t { font-weight: 600; }
#tm-readout .hint { color: #777; }
table { border-collapse: collapse; font-size: 13px; margin: 4px 0; }
th, td { padding: 3px 10px; border-bottom: 1px solid #eee; text-align: left; white-space: nowrap; }
th { background: #f3f3f6; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.cmd { white-space: normal; font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 12px; }
p.note { color: #666; font-size: 12.5px; margin: 2px 0 8px; }
p.empty { color: #777; font-style: italic; }
"#;

/// The hover read-out. Reads the data block, follows the mouse over the chart, and shows under the cursor
/// the time, the epoch and phase, and for every series its value in that pixel column (max, and min when the
/// column spans a range); over columns without a sample, the value held since the last one.
const SCRIPT: &str = r#"
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("tm-data").textContent);
  var svg = document.getElementById("tm-chart");
  var out = document.getElementById("tm-readout");
  var cursor = document.getElementById("tm-cursor");
  if (!svg || !out || !cursor) return;
  var line = cursor.querySelector("line");
  var dots = cursor.querySelectorAll("circle");
  function fmt(b) {
    if (b === null || b === undefined) return "-";
    var K = 1024, M = K * K, G = M * K;
    if (b >= G) return (b / G).toFixed(2) + " GiB";
    if (b >= M) return (b / M).toFixed(1) + " MiB";
    if (b >= K) return (b / K).toFixed(1) + " KiB";
    return b + " B";
  }
  function esc(s) { return String(s).replace(/[&<>"]/g, function (c) { return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]; }); }
  function at(s, i) {
    if (s.max[i] !== null) return {min: s.min[i], max: s.max[i], held: false};
    for (var j = i - 1; j >= 0; j--) { if (s.last[j] !== null) return {min: s.last[j], max: s.last[j], held: true}; }
    return null;
  }
  function band(list, t) {
    for (var k = 0; k < list.length; k++) { if (t >= list[k][0] && t < list[k][1]) return list[k][2]; }
    return null;
  }
  function y(v) { return D.top + D.plot_h * (1 - v / D.y_top); }
  function show(i) {
    i = Math.max(0, Math.min(D.n - 1, i));
    var t0 = i * D.t_end_s / D.n, t1 = (i + 1) * D.t_end_s / D.n, tm = (t0 + t1) / 2;
    var x = D.left + (i + 0.5) * D.plot_w / D.n;
    line.setAttribute("x1", x); line.setAttribute("x2", x);
    var html = '<span class="t">t = ' + tm.toFixed(3) + ' s</span>';
    var e = band(D.epochs, tm), p = band(D.phase_mix, tm);
    if (e !== null) html += '<span class="epoch">' + esc(e) + '</span>';
    if (p !== null) html += '<span class="phase">phases ' + p.map(function (q) { return esc(q[0]) + ' ' + (q[1] === 0 ? '<1' : q[1]) + '%'; }).join(', ') + '</span>';
    D.series.forEach(function (s, k) {
      var v = at(s, i), dot = dots[k];
      var text = "-";
      if (v) {
        text = fmt(v.max);
        if (v.min !== v.max) text += " (min " + fmt(v.min) + ")";
        if (dot) { dot.setAttribute("cx", x); dot.setAttribute("cy", y(v.max)); dot.setAttribute("visibility", "visible"); }
      } else if (dot) { dot.setAttribute("visibility", "hidden"); }
      html += '<span class="v" data-series="' + esc(s.label) + '"><span class="sw" style="background:' + s.color + '"></span>' + esc(s.label) + ': <b>' + text + '</b></span>';
    });
    out.innerHTML = html;
    out.setAttribute("data-t", tm.toFixed(3));
    cursor.setAttribute("visibility", "visible");
  }
  function bucketAt(evt) {
    var pt = svg.createSVGPoint(); pt.x = evt.clientX; pt.y = evt.clientY;
    var p = pt.matrixTransform(svg.getScreenCTM().inverse());
    return Math.floor((p.x - D.left) / D.plot_w * D.n);
  }
  svg.addEventListener("mousemove", function (evt) {
    var i = bucketAt(evt);
    if (i >= 0 && i < D.n) show(i);
  });
  var m = /(?:^#|&)t=([0-9.]+)/.exec(location.hash);
  if (m && D.t_end_s > 0) show(Math.floor(parseFloat(m[1]) / D.t_end_s * D.n));
  document.body.setAttribute("data-chart", "ready");
})();
"#;

/// One table as HTML.
pub fn render_table(t: &Table) -> String {
    let mut out = if t.title.is_empty() { String::new() } else { format!("<h3>{}</h3>\n", esc(&t.title)) };
    if t.rows.is_empty() {
        out.push_str(&format!("<p class=\"empty\">{}</p>\n", esc(&t.empty)));
    } else {
        let class = |i: usize| {
            if t.numeric.get(i).copied().unwrap_or(false) {
                " class=\"num\""
            } else {
                ""
            }
        };
        out.push_str("<table>\n<thead><tr>");
        for (i, h) in t.headers.iter().enumerate() {
            out.push_str(&format!("<th{}>{}</th>", class(i), esc(h)));
        }
        out.push_str("</tr></thead>\n<tbody>\n");
        for row in &t.rows {
            out.push_str("<tr>");
            for (i, c) in row.iter().enumerate() {
                let cls =
                    if t.headers.get(i).map(String::as_str) == Some("command") { " class=\"cmd\"" } else { class(i) };
                out.push_str(&format!("<td{cls}>{}</td>", esc(c)));
            }
            out.push_str("</tr>\n");
        }
        out.push_str("</tbody>\n</table>\n");
    }
    for n in &t.notes {
        out.push_str(&format!("<p class=\"note\">{}</p>\n", esc(n)));
    }
    out
}

/// The data the hover script reads: per bucket min/max of each series, the bands, the plot's geometry.
fn chart_data(tl: &Timeline, lay: &Layout, legend_top: f64, y_top_bytes: f64) -> serde_json::Value {
    let secs = |ns: u64| ns as f64 / 1e9;
    json!({
        "n": tl.n,
        "t_end_s": secs(tl.t_end_ns),
        "left": lay.left,
        "top": legend_top,
        "plot_w": lay.plot_w(),
        "plot_h": lay.plot_h,
        "y_top": y_top_bytes,
        "series": tl.series.iter().map(|s| json!({"label": s.label, "color": s.color, "samples": s.samples, "min": s.buckets.min, "max": s.buckets.max, "last": s.buckets.last})).collect::<Vec<_>>(),
        "epochs": tl.epochs.iter().map(|b| json!([secs(b.start_ns), secs(b.end_ns), b.label])).collect::<Vec<_>>(),
        "phases": tl.phases.iter().map(|b| json!([secs(b.start_ns), secs(b.end_ns), b.label])).collect::<Vec<_>>(),
        "phase_mix": tl.phase_mix.iter().map(|b| json!([secs(b.start_ns), secs(b.end_ns), b.parts.iter().map(|p| json!([p.0, p.2])).collect::<Vec<_>>()])).collect::<Vec<_>>(),
    })
}

/// Reads the numbers the SVG renderer put on the `<svg>` element, so the script and the drawing agree.
fn svg_attr(svg: &str, name: &str) -> f64 {
    let key = format!("{name}=\"");
    svg.find(&key)
        .and_then(|i| {
            let rest = &svg[i + key.len()..];
            rest[..rest.find('"')?].parse().ok()
        })
        .unwrap_or(0.0)
}

/// "What the memory is": the stacked timeline by category (from the kept boundaries), the composition at
/// the peak, the per-boundary table and the detail; or how to record a breakdown.
fn breakdown_section(summary: &Summary) -> String {
    use crate::report::breakdown as bd;
    let b = &summary.breakdown;
    let mut h = format!("<h2 id=\"tm-breakdown\">{}</h2>\n", esc(bd::SECTION_TITLE));
    if !b.recorded {
        h.push_str(&format!("<p class=\"empty\">{}</p>\n", esc(crate::analysis::breakdown::NO_BREAKDOWN_HINT)));
        return h;
    }
    let chart = bd::render_stacked_svg(b);
    if !chart.is_empty() {
        h.push_str("<div class=\"chart-box\">\n");
        h.push_str(&chart);
        h.push_str("</div>\n<p class=\"note\">Each column is one boundary (step start, end of forward, end of backward, end of optimizer step) of the steps kept as markers; its categories are stacked in the legend's order.</p>\n");
    }
    for t in bd::tables(b) {
        h.push_str(&render_table(&t));
    }
    h
}

/// The whole HTML page.
pub fn render(profile: &Profile, summary: &Summary) -> String {
    let lay = Layout::standard();
    let tl = Timeline::build(profile, lay.buckets());
    let svg = render_chart(profile, &tl, &lay, true);
    let data = chart_data(&tl, &lay, svg_attr(&svg, "data-top"), svg_attr(&svg, "data-y-top"));
    // `</` inside a script block would end it early; JSON allows `<\/` for `</`.
    let data_text = data.to_string().replace("</", "<\\/");
    let command = profile.meta.command.join(" ");
    let mut h = String::with_capacity(svg.len() + data_text.len() + 32 * 1024);
    h.push_str("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n");
    h.push_str("<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n");
    h.push_str(&format!(
        "<title>torchmem: {}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        esc(if command.is_empty() { "report" } else { &command })
    ));
    h.push_str("<h1>torchmem report</h1>\n<dl class=\"meta\">\n");
    for (k, v) in cells::meta_lines(profile, summary) {
        h.push_str(&format!("<dt>{}</dt><dd>{}</dd>\n", esc(&k), esc(&v)));
    }
    h.push_str("</dl>\n");
    for g in &summary.growth {
        h.push_str(&format!(
            "<div class=\"warning\"><b>Warning:</b> {}</div>\n",
            esc(&super::findings::growth_message(g))
        ));
    }
    for l in &summary.leaks {
        h.push_str(&format!("<div class=\"warning leak\"><b>Leak:</b> {}</div>\n", esc(&l.message)));
    }
    h.push_str("<h2>Memory timeline</h2>\n");
    h.push_str("<div id=\"tm-readout\"><span class=\"hint\">Move the mouse over the chart to read every series at that moment.</span></div>\n");
    h.push_str("<div class=\"chart-box\">\n");
    h.push_str(&svg);
    h.push_str("</div>\n");
    if let Some(cpu) = &tl.cpu_note {
        h.push_str(&format!("<p class=\"note cpu-note\"><b>{}</b></p>\n", esc(cpu)));
    }
    let downsampled = tl.series.iter().any(|s| s.samples > tl.n);
    let mut notes: Vec<String> = Vec::new();
    if !tl.epochs.is_empty() {
        notes.push("Epochs are the shaded bands, numbered at the top.".into());
    }
    if !tl.phase_mix.is_empty() {
        notes.push("The coloured lane under the plot stacks, in each pixel column, every phase's share of that column's time (a phase present at all gets at least one thin step); the read-out gives the percentages.".into());
    }
    if downsampled {
        notes.push(format!("Each line is drawn through the minimum and maximum of every pixel column ({} columns), so no peak is lost.", tl.n));
    }
    if !notes.is_empty() {
        h.push_str(&format!("<p class=\"note\">{}</p>\n", esc(&notes.join(" "))));
    }
    h.push_str(&breakdown_section(summary));
    h.push_str("<h2>Tables</h2>\n");
    for t in cells::all_tables_of(profile, summary) {
        h.push_str(&render_table(&t));
    }
    h.push_str("<h2>Memory journey</h2>\n");
    // The section heading names the table: no second heading.
    h.push_str(&render_table(&Table { title: String::new(), ..cells::journey_table(&summary.journey) }));
    if !summary.journey.is_empty() {
        h.push_str(&format!(
            "<details><summary>Mermaid source</summary>\n<pre>{}</pre></details>\n",
            esc(&journey::render_mermaid(&summary.journey, &mermaid::title(profile)))
        ));
    }
    let line_html = lines::render_html(&profile.line_profiles);
    if !line_html.trim().is_empty() {
        // One heading: the page's section heading replaces the fragment's own.
        h.push_str("<h2>Line profile</h2>\n");
        h.push_str(&line_html.replacen("<h2>Line-by-line memory</h2>\n", "", 1));
        h.push('\n');
    }
    h.push_str(&format!("<script type=\"application/json\" id=\"tm-data\">{data_text}</script>\n"));
    h.push_str(&format!("<script>{SCRIPT}</script>\n</body>\n</html>\n"));
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    const MIB: u64 = 1 << 20;

    fn profile(seconds: u64, hz: u64) -> Profile {
        let mut p = Profile {
            meta: RunMeta {
                command: vec!["python".into(), "train.py".into()],
                interval_ms: 1000.0 / hz as f64,
                exit_code: Some(0),
                duration_ns: Some(seconds * 1_000_000_000),
                ..Default::default()
            },
            ..Default::default()
        };
        let step_ns = 1_000_000_000 / hz;
        for i in 0..seconds * hz {
            let t = i * step_ns;
            p.cpu.push(CpuSample {
                t_ns: t,
                rss_bytes: (200 + (i % 50)) * MIB,
                pss_bytes: None,
                uss_bytes: None,
                process_count: 1,
            });
            p.torch.push(TorchSample {
                t_ns: t,
                device: 0,
                allocated_bytes: (100 + (i % 30)) * MIB,
                reserved_bytes: 160 * MIB,
                peak_allocated_bytes: 130 * MIB,
                peak_reserved_bytes: 160 * MIB,
                active_bytes: 0,
                inactive_split_bytes: 0,
                origin: Default::default(),
            });
        }
        p
    }

    #[test]
    fn page_is_self_contained() {
        let p = profile(5, 100);
        let html = render(&p, &Summary::from_profile(&p));
        assert!(html.starts_with("<!DOCTYPE html>"));
        for needle in ["http://", "https://", "src=", "@import", "url(", "<link", "//cdn"] {
            assert!(!html.contains(needle), "found {needle:?}: the page must not load anything");
        }
        assert!(html.contains("id=\"tm-data\"") && html.contains("GPU allocated"));
        assert_eq!(html.matches("<script").count(), 2);
    }

    #[test]
    fn a_long_run_gives_a_small_page() {
        // 1 hour at 100 Hz: 360 000 CPU and 360 000 PyTorch samples.
        let p = profile(3600, 100);
        let html = render(&p, &Summary::from_profile(&p));
        assert!(html.len() < 600 * 1024, "{} bytes", html.len());
        // a 10-second run has about the same size: the chart does not grow with the run
        let small = profile(10, 100);
        let small_html = render(&small, &Summary::from_profile(&small));
        assert!(html.len() < small_html.len() * 3, "{} vs {}", html.len(), small_html.len());
    }

    #[test]
    fn no_heading_twice_and_the_band_note_only_with_bands() {
        let p = profile(2, 10);
        let html = render(&p, &Summary::from_profile(&p));
        assert_eq!(html.matches(">Memory journey</h").count(), 1, "one 'Memory journey' heading");
        assert!(!html.contains("Epochs are the shaded bands"), "no epochs, no note about them");
        assert!(!html.contains("coloured lane"), "no phases, no note about the lane");
        let mut q = profile(2, 10);
        for (t, edge) in [(0, Edge::Start), (1_000_000_000, Edge::End)] {
            q.markers.push(Marker { index: Some(0), ..Marker::new(t, MarkerKind::Epoch, edge, "epoch") });
        }
        let html = render(&q, &Summary::from_profile(&q));
        assert!(html.contains("Epochs are the shaded bands"));
    }

    #[test]
    fn script_data_cannot_close_the_script_block() {
        let mut p = profile(1, 10);
        p.markers.push(Marker::new(0, MarkerKind::Phase, Edge::Start, "</script><b>x"));
        p.markers.push(Marker::new(5, MarkerKind::Phase, Edge::End, "</script><b>x"));
        let html = render(&p, &Summary::from_profile(&p));
        assert_eq!(html.matches("</script>").count(), 2);
        assert!(!html.contains("</script><b>x"));
        assert!(html.contains("&lt;/script&gt;&lt;b&gt;x"), "the phase table shows the name, escaped");
    }
}
