//! The memory chart as SVG, drawn from a `Timeline`: one line per series (the min/max envelope of each pixel
//! column, so peaks show), epochs as shaded bands with their number, phases as a coloured lane under the plot,
//! axes in binary units and seconds, and a legend. `torchmem plot --svg` writes it alone; the HTML report
//! embeds it and adds the hover read-out on top (the cursor elements are only in the HTML version).

use crate::model::Profile;
use crate::report::timeline::Timeline;

/// Escapes text for XML/HTML content and attribute values.
pub fn esc(s: &str) -> String {
    crate::units::escape_html(s)
}

/// Where things go, in SVG user units (= CSS pixels at 100 %).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Layout {
    pub width: f64,
    pub left: f64,
    pub right: f64,
    pub top: f64,
    pub plot_h: f64,
    pub lane_h: f64,
    pub bottom: f64,
}

impl Layout {
    pub const fn standard() -> Layout {
        Layout { width: 1200.0, left: 80.0, right: 16.0, top: 0.0, plot_h: 330.0, lane_h: 14.0, bottom: 44.0 }
    }
    pub fn plot_w(&self) -> f64 {
        self.width - self.left - self.right
    }
    /// One bucket per pixel column.
    pub fn buckets(&self) -> usize {
        self.plot_w().floor() as usize
    }
    pub fn lane_y(&self) -> f64 {
        self.top + self.plot_h + 4.0
    }
    pub fn height(&self) -> f64 {
        self.lane_y() + self.lane_h + self.bottom
    }
}

/// A "nice" axis: tick step and top, in a display unit.
#[derive(Debug, Clone, PartialEq)]
pub struct Axis {
    pub unit_bytes: u64,
    pub unit: &'static str,
    pub step: f64,
    pub ticks: usize,
}

fn nice_step(raw: f64) -> f64 {
    if raw <= 0.0 || !raw.is_finite() {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let norm = raw / mag;
    let nice = if norm <= 1.0 {
        1.0
    } else if norm <= 2.0 {
        2.0
    } else if norm <= 2.5 {
        2.5
    } else if norm <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// Byte axis from 0 to at least `max_bytes`, about five ticks, in B/KiB/MiB/GiB.
pub fn byte_axis(max_bytes: u64) -> Axis {
    let max = max_bytes.max(1);
    let (unit_bytes, unit) = if max >= 1 << 30 {
        (1u64 << 30, "GiB")
    } else if max >= 1 << 20 {
        (1 << 20, "MiB")
    } else if max >= 1 << 10 {
        (1 << 10, "KiB")
    } else {
        (1, "B")
    };
    let value = max as f64 / unit_bytes as f64;
    let mut step = nice_step(value / 5.0);
    if unit_bytes == 1 {
        step = step.max(1.0); // no fractions of a byte
    }
    let ticks = (value / step).ceil().max(1.0) as usize;
    Axis { unit_bytes, unit, step, ticks }
}

impl Axis {
    pub fn top_bytes(&self) -> f64 {
        self.step * self.ticks as f64 * self.unit_bytes as f64
    }
    /// Fewest decimals that show the step exactly (0.5 → 1, 0.25 → 2, 2 → 0).
    fn decimals(&self) -> usize {
        (0..6)
            .find(|d| {
                let scaled = self.step * 10f64.powi(*d as i32);
                (scaled - scaled.round()).abs() < 1e-6
            })
            .unwrap_or(6)
    }
    pub fn label(&self, i: usize) -> String {
        format!("{:.*} {}", self.decimals(), self.step * i as f64, self.unit)
    }
}

/// Time ticks: (step in seconds, count) for an axis of `t_end_s`.
pub fn time_ticks(t_end_s: f64) -> (f64, usize) {
    let step = nice_step(t_end_s / 8.0);
    (step, (t_end_s / step).floor() as usize)
}

fn time_label(t_s: f64, step: f64) -> String {
    let dec = Axis { unit_bytes: 1, unit: "", step, ticks: 1 }.decimals();
    format!("{t_s:.dec$}")
}

/// The chart's legend items: (label, colour, dash, is a lane swatch).
fn legend_items(tl: &Timeline) -> Vec<(String, &'static str, Option<&'static str>, bool)> {
    let mut items: Vec<_> = tl.series.iter().map(|s| (s.label.clone(), s.color, s.dash, false)).collect();
    const MAX_PHASES: usize = 10;
    for name in tl.phase_names.iter().take(MAX_PHASES) {
        items.push((format!("phase {name}"), tl.phase_color(name), None, true));
    }
    if tl.phase_names.len() > MAX_PHASES {
        items.push((format!("… {} more phases", tl.phase_names.len() - MAX_PHASES), "#cccccc", None, true));
    }
    items
}

/// Lays the legend out in rows; returns the SVG and its height.
fn legend(tl: &Timeline, lay: &Layout) -> (String, f64) {
    let mut out = String::new();
    let (mut x, mut y) = (lay.left, 16.0);
    for (label, color, dash, swatch) in legend_items(tl) {
        let w = 28.0 + 6.6 * label.chars().count() as f64 + 16.0;
        if x + w > lay.width - lay.right && x > lay.left {
            x = lay.left;
            y += 18.0;
        }
        if swatch {
            out.push_str(&format!(
                r#"<rect x="{:.1}" y="{:.1}" width="20" height="10" fill="{color}" fill-opacity="0.75"/>"#,
                x,
                y - 9.0
            ));
        } else {
            let d = dash.map(|d| format!(r#" stroke-dasharray="{d}""#)).unwrap_or_default();
            out.push_str(&format!(
                r#"<line x1="{:.1}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="{color}" stroke-width="2.5"{d}/>"#,
                x,
                y - 4.0,
                x + 20.0,
                y - 4.0
            ));
        }
        out.push_str(&format!(r#"<text x="{:.1}" y="{:.1}">{}</text>"#, x + 26.0, y, esc(&label)));
        x += w;
    }
    if let Some(note) = &tl.cpu_note {
        // Which line to trust, under the legend (in the standalone SVG there is no page around it to say so).
        y += 18.0;
        out.push_str(&format!(
            r##"<text class="cpu-note" x="{:.1}" y="{:.1}" fill="{}" font-size="11.5">{}</text>"##,
            lay.left,
            y,
            crate::report::timeline::CPU_PSS_COLOR,
            esc(note)
        ));
    }
    (out, y + 14.0)
}

/// The SVG path of one series, drawn as a step function (memory holds its value until the next sample): per
/// pixel column, a horizontal run at the value held from before, then its min and max in the order they
/// happened, then its last value.
fn series_path(b: &crate::report::timeline::Buckets, lay: &Layout, axis_top: f64, n: usize) -> String {
    let mut d = String::new();
    let y = |v: u64| lay.top + lay.plot_h * (1.0 - v as f64 / axis_top);
    let mut last_point: Option<(f64, f64)> = None;
    let mut push = |x: f64, yv: f64| {
        let p = ((x * 10.0).round() / 10.0, (yv * 10.0).round() / 10.0);
        if last_point == Some(p) {
            return;
        }
        d.push(if last_point.is_none() { 'M' } else { 'L' });
        d.push_str(&format!("{:.1},{:.1}", p.0, p.1));
        last_point = Some(p);
    };
    let mut held: Option<u64> = None;
    for k in 0..n {
        let (Some(lo), Some(hi), Some(last)) = (b.min[k], b.max[k], b.last[k]) else {
            continue;
        };
        let x = lay.left + (k as f64 + 0.5) * lay.plot_w() / n as f64;
        if let Some(h) = held {
            push(x, y(h));
        }
        if b.max_first[k] {
            push(x, y(hi));
            push(x, y(lo));
        } else {
            push(x, y(lo));
            push(x, y(hi));
        }
        push(x, y(last));
        held = Some(last);
    }
    d
}

/// The chart. `interactive` adds the hover cursor elements (used by the HTML report's script) and leaves out
/// the XML namespace, which inline SVG in HTML does not need.
pub fn render_chart(profile: &Profile, tl: &Timeline, lay: &Layout, interactive: bool) -> String {
    let (legend_svg, legend_h) = legend(tl, lay);
    let lay = Layout { top: legend_h, ..*lay };
    let height = lay.height();
    let axis = byte_axis(tl.max_bytes());
    let top_bytes = axis.top_bytes();
    let t_end_s = tl.t_end_ns as f64 / 1e9;
    let x_of = |t_ns: u64| lay.left + lay.plot_w() * (t_ns as f64 / tl.t_end_ns as f64);
    let title = format!("Memory timeline of {}", profile.meta.command.join(" "));
    let mut s = String::with_capacity(64 * 1024);
    let ns = if interactive { String::new() } else { r#" xmlns="http://www.w3.org/2000/svg""#.to_string() };
    s.push_str(&format!(
        r##"<svg{ns} id="tm-chart" viewBox="0 0 {w} {h:.0}" width="{w}" height="{h:.0}" font-family="system-ui, -apple-system, 'Segoe UI', sans-serif" font-size="12" fill="#333" role="img" aria-label="{t}" data-left="{l}" data-top="{top}" data-plot-w="{pw}" data-plot-h="{ph}" data-y-top="{yt}">"##,
        w = lay.width,
        h = height,
        t = esc(&title),
        l = lay.left,
        top = lay.top,
        pw = lay.plot_w(),
        ph = lay.plot_h,
        yt = top_bytes,
    ));
    s.push_str(&format!("<title>{}</title>", esc(&title)));
    s.push_str(&format!(r##"<rect x="0" y="0" width="{}" height="{height:.0}" fill="#ffffff"/>"##, lay.width));
    s.push_str(&legend_svg);
    // Epoch bands: alternate shading across the whole plot height, number at the top.
    s.push_str(r#"<g class="epochs">"#);
    for (i, b) in tl.epochs.iter().enumerate() {
        let (x0, x1) = (x_of(b.start_ns), x_of(b.end_ns));
        let opacity = if i % 2 == 0 { 0.07 } else { 0.035 };
        s.push_str(&format!(
            r##"<rect x="{x0:.1}" y="{:.1}" width="{:.1}" height="{:.1}" fill="#4a5a8a" fill-opacity="{opacity}"><title>{}</title></rect>"##,
            lay.top,
            (x1 - x0).max(0.5),
            lay.plot_h,
            esc(&b.label)
        ));
        s.push_str(&format!(
            r##"<line x1="{x0:.1}" y1="{:.1}" x2="{x0:.1}" y2="{:.1}" stroke="#4a5a8a" stroke-opacity="0.35"/>"##,
            lay.top,
            lay.top + lay.plot_h
        ));
        // The number and peak when they fit, else the number alone ("epoch 3"), else nothing (the
        // band's <title> and the HTML read-out still name it).
        let short = b.label.split(" (").next().unwrap_or(&b.label);
        let fits = |text: &str| x1 - x0 >= 8.0 + 6.0 * text.chars().count() as f64;
        let text = if fits(&b.label) { Some(b.label.as_str()) } else { fits(short).then_some(short) };
        if let Some(text) = text {
            s.push_str(&format!(
                r##"<text x="{:.1}" y="{:.1}" fill="#4a5a8a" font-size="11">{}</text>"##,
                x0 + 4.0,
                lay.top + 13.0,
                esc(text)
            ));
        }
    }
    s.push_str("</g>");
    // Grid and y axis.
    s.push_str(r#"<g class="y-axis">"#);
    for i in (0..=axis.ticks).filter(|_| !tl.series.is_empty()) {
        let y = lay.top + lay.plot_h * (1.0 - i as f64 / axis.ticks as f64);
        s.push_str(&format!(
            r##"<line x1="{}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#000" stroke-opacity="0.1"/>"##,
            lay.left,
            lay.left + lay.plot_w()
        ));
        s.push_str(&format!(
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
            lay.left - 6.0,
            y + 4.0,
            axis.label(i)
        ));
    }
    s.push_str("</g>");
    // Phase lane.
    let lane_y = lay.lane_y();
    if !tl.phases.is_empty() {
        s.push_str(r#"<g class="phases">"#);
        s.push_str(&format!(
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" font-size="11">phases</text>"#,
            lay.left - 6.0,
            lane_y + lay.lane_h - 3.0
        ));
        // Per run of pixel columns, each phase's share of the time as a stack (bottom up, first-seen order).
        let step_h = lay.lane_h / crate::report::timeline::MIX_LEVELS as f64;
        for b in &tl.phase_mix {
            let (x0, x1) = (x_of(b.start_ns), x_of(b.end_ns));
            let mut y = lane_y + lay.lane_h;
            let title: Vec<String> = b.parts.iter().map(|(name, _, pct)| format!("{name} {pct}%")).collect();
            s.push_str(&format!("<g><title>{}</title>", esc(&title.join(", "))));
            for (name, steps, _) in &b.parts {
                let h = step_h * *steps as f64;
                y -= h;
                s.push_str(&format!(
                    r#"<rect x="{x0:.1}" y="{y:.1}" width="{:.1}" height="{h:.1}" fill="{}" fill-opacity="0.75"/>"#,
                    (x1 - x0).max(0.5),
                    tl.phase_color(name),
                ));
            }
            s.push_str("</g>");
        }
        s.push_str("</g>");
    }
    // X axis.
    let axis_y = lane_y + lay.lane_h + 4.0;
    let (step, count) = if tl.series.is_empty() { (1.0, 0) } else { time_ticks(t_end_s) };
    s.push_str(r#"<g class="x-axis">"#);
    for i in 0..=count {
        let t = step * i as f64;
        let x = lay.left + lay.plot_w() * (t / t_end_s);
        s.push_str(&format!(
            r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#000" stroke-opacity="0.4"/>"##,
            axis_y - 3.0,
            axis_y + 2.0
        ));
        s.push_str(&format!(
            r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            axis_y + 15.0,
            time_label(t, step)
        ));
    }
    s.push_str(&format!(
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time (s)</text>"#,
        lay.left + lay.plot_w() / 2.0,
        axis_y + 33.0
    ));
    s.push_str("</g>");
    s.push_str(&format!(
        r##"<rect x="{}" y="{:.1}" width="{:.1}" height="{:.1}" fill="none" stroke="#000" stroke-opacity="0.35"/>"##,
        lay.left,
        lay.top,
        lay.plot_w(),
        lay.plot_h
    ));
    // Series.
    s.push_str(r#"<g class="series" fill="none" stroke-width="1.6" stroke-linejoin="round">"#);
    for se in &tl.series {
        let d = series_path(&se.buckets, &lay, top_bytes, tl.n);
        let dash = se.dash.map(|d| format!(r#" stroke-dasharray="{d}""#)).unwrap_or_default();
        s.push_str(&format!(r#"<path d="{d}" stroke="{}"{dash}><title>{}</title></path>"#, se.color, esc(&se.label)));
    }
    s.push_str("</g>");
    if tl.series.is_empty() {
        s.push_str(&format!(
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="14">no memory samples in this profile</text>"#,
            lay.left + lay.plot_w() / 2.0,
            lay.top + lay.plot_h / 2.0
        ));
    }
    if interactive {
        s.push_str(&format!(
            r##"<g id="tm-cursor" visibility="hidden" pointer-events="none"><line x1="0" y1="{:.1}" x2="0" y2="{:.1}" stroke="#000" stroke-opacity="0.6" stroke-dasharray="3 3"/>"##,
            lay.top,
            lane_y + lay.lane_h
        ));
        for se in &tl.series {
            s.push_str(&format!(
                r##"<circle r="3.5" cx="0" cy="0" fill="{}" stroke="#fff" stroke-width="1"/>"##,
                se.color
            ));
        }
        s.push_str("</g>");
        s.push_str(&format!(
            r#"<rect id="tm-hit" x="{}" y="{:.1}" width="{:.1}" height="{:.1}" fill="transparent"/>"#,
            lay.left,
            lay.top,
            lay.plot_w(),
            lane_y + lay.lane_h - lay.top
        ));
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    #[test]
    fn byte_axis_picks_units_and_covers_the_max() {
        let a = byte_axis(1_300 << 20);
        assert_eq!(a.unit, "GiB");
        assert!(a.top_bytes() >= (1_300u64 << 20) as f64);
        assert_eq!(a.label(1), "0.5 GiB");
        let a = byte_axis(300 << 20);
        assert_eq!((a.unit, a.step), ("MiB", 100.0));
        assert_eq!(a.label(3), "300 MiB");
        assert_eq!(byte_axis(0).unit, "B");
        assert_eq!(byte_axis(3).label(1), "1 B");
        let a = byte_axis(130 << 20);
        assert_eq!(a.label(1), "50 MiB");
        assert_eq!(byte_axis(3 << 30).label(1), "1 GiB");
        let a = byte_axis(5 << 29);
        assert_eq!(a.label(1), "0.5 GiB");
        let a = byte_axis(11 << 29);
        assert_eq!((a.step, a.label(1)), (2.0, "2 GiB".to_string()));
    }

    #[test]
    fn series_are_steps_held_until_the_next_sample() {
        // two samples: 1 KiB at the start, 2 KiB at the end; the line stays at 1 KiB until the end, then rises
        let b = crate::report::timeline::downsample([(0u64, 1024u64), (100, 2048)].into_iter(), 100, 10);
        let lay = Layout { width: 110.0, left: 0.0, right: 0.0, top: 0.0, plot_h: 100.0, lane_h: 0.0, bottom: 0.0 };
        let d = series_path(&b, &lay, 4096.0, 10);
        assert_eq!(d, "M5.5,75.0L104.5,75.0L104.5,50.0");
    }

    #[test]
    fn time_ticks_are_round() {
        assert_eq!(time_ticks(3600.0), (500.0, 7));
        assert_eq!(time_ticks(1.2).0, 0.2);
        assert_eq!(time_label(0.4, 0.2), "0.4");
        assert_eq!(time_label(1000.0, 500.0), "1000");
    }

    #[test]
    fn svg_is_well_formed_and_standalone() {
        let mut p = Profile::default();
        p.meta.command = vec!["python".into(), "a<b>.py".into()];
        for i in 0..100u64 {
            p.cpu.push(CpuSample {
                t_ns: i * 10_000_000,
                rss_bytes: (100 + i) << 20,
                pss_bytes: None,
                uss_bytes: None,
                process_count: 1,
            });
        }
        p.markers.push(Marker { index: Some(0), ..Marker::new(0, MarkerKind::Epoch, Edge::Start, "epoch") });
        p.markers.push(Marker { index: Some(0), ..Marker::new(500_000_000, MarkerKind::Epoch, Edge::End, "epoch") });
        let lay = Layout::standard();
        let tl = Timeline::build(&p, lay.buckets());
        let svg = render_chart(&p, &tl, &lay, false);
        assert!(svg.starts_with(r#"<svg xmlns="http://www.w3.org/2000/svg""#));
        assert!(svg.contains("a&lt;b&gt;.py") && !svg.contains("a<b>"));
        assert!(svg.contains(r##"stroke="#1f77b4""##));
        assert!(svg.contains(">epoch 0 (peak CPU RSS 150.0 MiB)</text>"), "the band names its epoch and peak: {svg}");
        assert!(!svg.contains("tm-cursor"));
        assert_eq!(svg.matches("<svg").count(), 1);
        assert_eq!(svg.matches("<g").count(), svg.matches("</g>").count());
        let html_svg = render_chart(&p, &tl, &lay, true);
        assert!(html_svg.contains("tm-cursor") && !html_svg.contains("xmlns"));
    }
}
