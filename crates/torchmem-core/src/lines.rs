//! Line-profile tables: the typed form of the line profiler's JSON payload (what
//! `python/torchmem/line_profiler.py` sends as `{"type": "line_profile", "data": …}`), and its pure
//! renderings: the `lines` section of the JSON report, memory_profiler-style text tables, and an HTML
//! fragment with annotated source and the heaviest lines highlighted.
//!
//! Column meanings (docs/line-profiler.md): `hits` = times the line started; `cpu_rss_bytes` = process RSS
//! after the line's last hit; `cpu_delta_bytes` = sum over hits of (RSS after − RSS before);
//! `cpu_delta_max_bytes` = the largest single hit; `gpu_alloc_delta_bytes` / `gpu_reserved_delta_bytes` =
//! the same sums for the CUDA caching allocator's allocated / reserved bytes; `gpu_peak_bytes` = the
//! highest allocated bytes above the line's starting point reached within the line (max over hits).

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::units::{escape_html, format_bytes, format_delta};

/// One payload as sent by the Python side (`line_profiler.profile_data()`): the typed `line_profile` record
/// (`record::Record::LineProfile`, `wire::ChildMessage::LineProfile`), stored as its JSON.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct LineProfile {
    #[serde(default)]
    pub schema: String,
    #[serde(default)]
    pub hook: String,
    #[serde(default)]
    pub gate_ns: f64,
    /// CUDA device the GPU columns come from; `None` when there are no GPU columns.
    #[serde(default)]
    pub gpu_device: Option<i64>,
    /// The Python version that ran it ("3.12.1").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub python: Option<String>,
    /// Memory reads and line events the profiler made (its cost).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reads: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<u64>,
    #[serde(default)]
    pub warnings: Vec<String>,
    #[serde(default)]
    pub functions: Vec<FunctionProfile>,
}

#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
pub struct FunctionProfile {
    pub name: String,
    #[serde(default)]
    pub filename: String,
    #[serde(default)]
    pub first_line: u64,
    #[serde(default)]
    pub calls: u64,
    #[serde(default)]
    pub threads: u64,
    #[serde(default)]
    pub lines: Vec<LineRow>,
}

/// One source line. Lines that never ran have `hits == 0` and no numbers.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
pub struct LineRow {
    pub line: u64,
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub hits: u64,
    #[serde(default)]
    pub cpu_rss_bytes: Option<i64>,
    #[serde(default)]
    pub cpu_delta_bytes: Option<i64>,
    #[serde(default)]
    pub cpu_delta_max_bytes: Option<i64>,
    #[serde(default)]
    pub gpu_alloc_delta_bytes: Option<i64>,
    #[serde(default)]
    pub gpu_peak_bytes: Option<i64>,
    #[serde(default)]
    pub gpu_reserved_delta_bytes: Option<i64>,
}

impl LineRow {
    /// How heavy the line is, for highlighting: the largest of |CPU Δ|, GPU peak, |GPU alloc Δ|.
    pub fn weight_bytes(&self) -> u64 {
        [
            self.cpu_delta_bytes.map(|v| v.unsigned_abs()),
            self.gpu_peak_bytes.map(|v| v.unsigned_abs()),
            self.gpu_alloc_delta_bytes.map(|v| v.unsigned_abs()),
        ]
        .into_iter()
        .flatten()
        .max()
        .unwrap_or(0)
    }
}

/// Parse payloads, skipping (not failing on) ones that are not line profiles.
pub fn parse(profiles: &[Value]) -> Vec<LineProfile> {
    profiles.iter().filter_map(|v| LineProfile::deserialize(v).ok()).filter(|p| !p.functions.is_empty()).collect()
}

/// The profiles that profiled a function (an empty one renders nothing).
fn with_functions(profiles: &[LineProfile]) -> Vec<&LineProfile> {
    profiles.iter().filter(|p| !p.functions.is_empty()).collect()
}

/// The `lines` section of `torchmem report --format json`.
pub fn to_json(profiles: &[LineProfile]) -> Value {
    let parsed = with_functions(profiles);
    let mut functions = Vec::new();
    for p in &parsed {
        for f in &p.functions {
            let mut v = serde_json::to_value(f).unwrap_or(Value::Null);
            if let Value::Object(m) = &mut v {
                m.insert("gpu".into(), Value::Bool(p.gpu_device.is_some()));
                m.insert("gpu_device".into(), serde_json::json!(p.gpu_device));
                m.insert("hook".into(), Value::String(p.hook.clone()));
            }
            functions.push(v);
        }
    }
    let warnings: Vec<&String> = parsed.iter().flat_map(|p| p.warnings.iter()).collect();
    serde_json::json!({ "functions": functions, "warnings": warnings })
}

fn opt_delta(v: Option<i64>) -> String {
    v.map(format_delta).unwrap_or_default()
}

fn opt_bytes(v: Option<i64>) -> String {
    v.map(|b| format_bytes(b.max(0) as u64)).unwrap_or_default()
}

/// memory_profiler-style tables, one per function; empty string when there is nothing.
pub fn render_text(profiles: &[LineProfile]) -> String {
    let parsed = with_functions(profiles);
    let mut out = String::new();
    for p in &parsed {
        let gpu = p.gpu_device.is_some();
        for f in &p.functions {
            out.push_str(&format!(
                "Function: {}  ({}:{})  calls: {}  threads: {}\n\n",
                f.name, f.filename, f.first_line, f.calls, f.threads
            ));
            let mut header =
                format!("{:>6} {:>8} {:>11} {:>11} {:>11}", "Line #", "Hits", "CPU mem", "CPU Δ", "CPU Δ max");
            if gpu {
                header.push_str(&format!(" {:>12} {:>11} {:>15}", "GPU alloc Δ", "GPU peak", "GPU reserved Δ"));
            }
            header.push_str("   Line Contents");
            let width = header.chars().count().max(60);
            out.push_str(&header);
            out.push('\n');
            out.push_str(&"=".repeat(width));
            out.push('\n');
            for r in &f.lines {
                let ran = r.hits > 0 || r.cpu_delta_bytes.is_some_and(|d| d != 0);
                let mut row = if ran {
                    format!(
                        "{:>6} {:>8} {:>11} {:>11} {:>11}",
                        r.line,
                        r.hits,
                        opt_bytes(r.cpu_rss_bytes),
                        opt_delta(r.cpu_delta_bytes),
                        opt_delta(r.cpu_delta_max_bytes)
                    )
                } else {
                    format!("{:>6} {:>8} {:>11} {:>11} {:>11}", r.line, "", "", "", "")
                };
                if gpu {
                    if ran {
                        row.push_str(&format!(
                            " {:>12} {:>11} {:>15}",
                            opt_delta(r.gpu_alloc_delta_bytes),
                            opt_bytes(r.gpu_peak_bytes),
                            opt_delta(r.gpu_reserved_delta_bytes)
                        ));
                    } else {
                        row.push_str(&format!(" {:>12} {:>11} {:>15}", "", "", ""));
                    }
                }
                row.push_str("   ");
                row.push_str(r.source.trim_end());
                out.push_str(row.trim_end());
                out.push('\n');
            }
            out.push('\n');
        }
        for w in &p.warnings {
            out.push_str(&format!("warning: {w}\n"));
        }
    }
    out
}

/// A self-contained HTML fragment (inline styles, no scripts, nothing fetched): annotated source per
/// function, the heaviest lines highlighted (shade grows with the line's weight; the top 3 are bold; red
/// where the line allocated, green where it freed).
pub fn render_html(profiles: &[LineProfile]) -> String {
    let parsed = with_functions(profiles);
    if parsed.is_empty() {
        return String::new();
    }
    let mut out = String::from(
        "<section class=\"torchmem-lines\" style=\"font-family:sans-serif\">\n<h2>Line-by-line memory</h2>\n",
    );
    let td = "style=\"padding:1px 8px;text-align:right;white-space:nowrap\"";
    for p in &parsed {
        let gpu = p.gpu_device.is_some();
        for f in &p.functions {
            let max_w = f.lines.iter().map(LineRow::weight_bytes).max().unwrap_or(0);
            let mut ranked: Vec<(u64, u64)> =
                f.lines.iter().map(|r| (r.weight_bytes(), r.line)).filter(|(w, _)| *w > 0).collect();
            ranked.sort_by(|a, b| b.cmp(a));
            let top: Vec<u64> = ranked.iter().take(3).map(|(_, l)| *l).collect();
            out.push_str(&format!(
                "<h3 style=\"font-size:1em\">{} <span style=\"color:#666;font-weight:normal\">{}:{} · calls {} · threads {}</span></h3>\n",
                escape_html(&f.name),
                escape_html(&f.filename),
                f.first_line,
                f.calls,
                f.threads
            ));
            out.push_str("<table style=\"border-collapse:collapse;font-size:12px\">\n<tr style=\"background:#eee\">");
            let mut cols = vec!["Line #", "Hits", "CPU mem", "CPU Δ", "CPU Δ max"];
            if gpu {
                cols.extend(["GPU alloc Δ", "GPU peak", "GPU reserved Δ"]);
            }
            for c in cols {
                out.push_str(&format!("<th {td}>{c}</th>"));
            }
            out.push_str("<th style=\"padding:1px 8px;text-align:left\">Line Contents</th></tr>\n");
            for r in &f.lines {
                let w = r.weight_bytes();
                let heavy = top.contains(&r.line);
                let style = if w > 0 && max_w > 0 {
                    let alpha = 0.08 + 0.5 * (w as f64 / max_w as f64);
                    // Red for a line that allocated, green for one that freed more than it allocated.
                    let net = [r.cpu_delta_bytes, r.gpu_alloc_delta_bytes]
                        .into_iter()
                        .flatten()
                        .max_by_key(|v| v.unsigned_abs());
                    let freed =
                        net.is_some_and(|d| d < 0 && d.unsigned_abs() >= r.gpu_peak_bytes.unwrap_or(0).unsigned_abs());
                    let rgb = if freed { "40,160,90" } else { "220,60,40" };
                    format!(
                        " style=\"background:rgba({rgb},{alpha:.2}){}\"{}",
                        if heavy { ";font-weight:bold" } else { "" },
                        if freed { " data-freed=\"1\"" } else { "" }
                    )
                } else {
                    String::new()
                };
                let attr = if heavy { " data-heavy=\"1\"" } else { "" };
                out.push_str(&format!("<tr{style}{attr}><td {td}>{}</td>", r.line));
                let ran = r.hits > 0;
                let mut cells = vec![
                    if ran { r.hits.to_string() } else { String::new() },
                    opt_bytes(r.cpu_rss_bytes),
                    opt_delta(r.cpu_delta_bytes),
                    opt_delta(r.cpu_delta_max_bytes),
                ];
                if gpu {
                    cells.extend([
                        opt_delta(r.gpu_alloc_delta_bytes),
                        opt_bytes(r.gpu_peak_bytes),
                        opt_delta(r.gpu_reserved_delta_bytes),
                    ]);
                }
                for c in cells {
                    out.push_str(&format!("<td {td}>{}</td>", escape_html(&c)));
                }
                out.push_str(&format!(
                    "<td style=\"padding:1px 8px;font-family:monospace;white-space:pre\">{}</td></tr>\n",
                    escape_html(r.source.trim_end())
                ));
            }
            out.push_str("</table>\n");
        }
        for w in &p.warnings {
            out.push_str(&format!("<p style=\"color:#a60\">warning: {}</p>\n", escape_html(w)));
        }
    }
    out.push_str("</section>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MIB: i64 = 1 << 20;

    fn payload(gpu: bool) -> LineProfile {
        LineProfile::deserialize(payload_json(gpu)).unwrap()
    }

    fn payload_json(gpu: bool) -> Value {
        let g = |v: i64| if gpu { json!(v) } else { Value::Null };
        json!({
            "schema": "torchmem.lines/1", "hook": "settrace", "gate_ns": 400.0,
            "gpu_device": if gpu { json!(0) } else { Value::Null },
            "warnings": [],
            "functions": [{
                "name": "step", "filename": "/tmp/x.py", "first_line": 3, "calls": 2, "threads": 1,
                "lines": [
                    {"line": 3, "source": "def step():", "hits": 0},
                    {"line": 4, "source": "    a = torch.ones(64 << 20, dtype=torch.uint8)", "hits": 2,
                     "cpu_rss_bytes": 200 * MIB, "cpu_delta_bytes": 128 * MIB, "cpu_delta_max_bytes": 64 * MIB,
                     "gpu_alloc_delta_bytes": g(256 * MIB), "gpu_peak_bytes": g(256 * MIB), "gpu_reserved_delta_bytes": g(0)},
                    {"line": 5, "source": "    del a  # <b>", "hits": 2,
                     "cpu_rss_bytes": 136 * MIB, "cpu_delta_bytes": -128 * MIB, "cpu_delta_max_bytes": -64 * MIB,
                     "gpu_alloc_delta_bytes": g(0), "gpu_peak_bytes": g(0), "gpu_reserved_delta_bytes": g(0)}
                ]
            }]
        })
    }

    #[test]
    fn json_section_keeps_every_column_in_bytes() {
        let v = to_json(&[payload(true)]);
        let f = &v["functions"][0];
        assert_eq!(f["name"], "step");
        assert_eq!(f["gpu"], true);
        assert_eq!(f["lines"][1]["cpu_delta_bytes"], 128 * MIB);
        assert_eq!(f["lines"][1]["gpu_peak_bytes"], 256 * MIB);
        assert_eq!(f["lines"][2]["source"], "    del a  # <b>");
        assert_eq!(f["lines"][0]["cpu_delta_bytes"], Value::Null);
    }

    #[test]
    fn text_has_memory_profiler_layout_and_gpu_columns_only_with_gpu() {
        let t = render_text(&[payload(true)]);
        assert!(t.contains("Line #"), "{t}");
        assert!(t.contains("GPU peak"));
        assert!(t.contains("+128.0 MiB"));
        assert!(t.contains("-64.0 MiB"));
        assert!(t.contains("200.0 MiB"));
        assert!(t.contains("    a = torch.ones"));
        let t = render_text(&[payload(false)]);
        assert!(!t.contains("GPU"), "{t}");
        assert_eq!(render_text(&[]), "");
        assert_eq!(render_text(&parse(&[json!({"something": "else"}), json!({"functions": 3})])), "");
        assert_eq!(parse(&[payload_json(false)]), [payload(false)]);
        assert!(render_text(&[LineProfile::default()]).is_empty(), "no function: nothing");
    }

    #[test]
    fn html_is_self_contained_escaped_and_highlights_heaviest() {
        let h = render_html(&[payload(true)]);
        assert!(h.starts_with("<section"));
        assert!(!h.contains("<script"));
        assert!(!h.contains("http"));
        assert!(h.contains("&lt;b&gt;"));
        assert!(h.contains("data-heavy=\"1\"><td style=\"padding:1px 8px;text-align:right;white-space:nowrap\">4</td>"));
        assert_eq!(render_html(&[]), "");
    }

    #[test]
    fn weight_takes_largest_magnitude() {
        let r = LineRow { cpu_delta_bytes: Some(-5), gpu_peak_bytes: Some(3), ..Default::default() };
        assert_eq!(r.weight_bytes(), 5);
    }
}
