//! Drawing the live view with ratatui widgets into a `Buffer` (so tests render into a `TestBackend` and
//! read the cells): `render_top` is `torchmem top`'s full screen, `render_inline` the few rows `run --live`
//! keeps under the program's output, `plain_top` the text table for a dumb terminal or a pipe.

use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{
    Block, Borders, Cell, LineGauge, Paragraph, Row as TableRow, Sparkline, StatefulWidget, Table, TableState, Widget,
};
use torchmem_core::units::format_bytes;

use super::state::{GpuPanel, SortKey, Source, TopModel};
use torchmem_recorder::live_state::{LiveSnapshot, ProcessNow};

/// Rows `run --live` keeps at the bottom of the terminal.
pub const INLINE_HEIGHT: u16 = 4;
/// A run whose state file is older than this is shown as not updating (its recorder is stopped or stuck).
pub const STALLED_AFTER_S: f64 = 5.0;

/// What `top` says when NVML cannot be loaded.
pub const NO_NVML: &str = "no NVIDIA GPU (NVML not found)";

/// The keys, as the footer lists them.
pub fn footer_text() -> String {
    let cols: Vec<String> =
        SortKey::ALL.iter().enumerate().map(|(i, k)| format!("{} {}", i + 1, k.label().to_lowercase())).collect();
    format!("q quit  ↑↓ select  sort: {}  s next  r reverse", cols.join("  "))
}

fn bytes(v: Option<u64>) -> String {
    v.map(format_bytes).unwrap_or_else(|| "-".into())
}

/// Bytes in at most 7 characters for the table, as htop writes them: `512.0K`, `210.3M`, `1.25G`.
pub fn short_bytes(v: Option<u64>) -> String {
    const KIB: f64 = 1024.0;
    let Some(b) = v else { return "-".into() };
    let x = b as f64;
    if x >= KIB * KIB * KIB * KIB {
        format!("{:.2}T", x / (KIB * KIB * KIB * KIB))
    } else if x >= KIB * KIB * KIB {
        format!("{:.2}G", x / (KIB * KIB * KIB))
    } else if x >= KIB * KIB {
        format!("{:.1}M", x / (KIB * KIB))
    } else if x >= KIB {
        format!("{:.1}K", x / KIB)
    } else {
        format!("{b}B")
    }
}

/// A command line with its program's directory left out (`/venv/bin/python t.py` → `python t.py`).
pub fn short_command(cmdline: &str) -> String {
    let (program, rest) = cmdline.split_once(' ').unwrap_or((cmdline, ""));
    let name = program.rsplit('/').next().unwrap_or(program);
    if rest.is_empty() {
        name.to_string()
    } else {
        format!("{name} {rest}")
    }
}

fn processes_text(n: u32) -> String {
    if n == 1 {
        "1 process".into()
    } else {
        format!("{n} processes")
    }
}

/// How a run is named: its recorder's pid, or `profile` for a replayed one.
fn run_label(run: &LiveSnapshot) -> String {
    if run.recorder_pid == 0 {
        "profile".into()
    } else {
        format!("run {}", run.recorder_pid)
    }
}

fn opt_num(v: Option<i64>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

/// `HH:MM:SS UTC` of a Unix time.
fn clock(unix_s: f64) -> String {
    let s = unix_s.max(0.0) as u64 % 86_400;
    format!("{:02}:{:02}:{:02} UTC", s / 3600, s / 60 % 60, s % 60)
}

fn header_line(m: &TopModel) -> String {
    let runs = match m.runs.len() {
        1 => "1 run".to_string(),
        n => format!("{n} runs"),
    };
    let source = match &m.source {
        Source::All(_) => "all runs of this user".to_string(),
        Source::Follow(p) => format!("following {p}"),
        Source::Replay(p) => format!("replay of {p} (its last state)"),
    };
    let host = if m.hostname.is_empty() { String::new() } else { format!(" — {}", m.hostname) };
    format!("torchmem top{host} — {runs} — {source} — {}", clock(m.now_unix_s))
}

fn host_line(m: &TopModel) -> (String, f64) {
    match m.host {
        Some(h) => {
            let used = h.total_bytes.saturating_sub(h.available_bytes);
            let ratio = if h.total_bytes > 0 { used as f64 / h.total_bytes as f64 } else { 0.0 };
            (
                format!(
                    "Host RAM  used {} of {} ({} available)",
                    format_bytes(used),
                    format_bytes(h.total_bytes),
                    format_bytes(h.available_bytes)
                ),
                ratio,
            )
        }
        None => ("Host RAM  unknown (/proc/meminfo unreadable)".into(), 0.0),
    }
}

/// The GPU lines: one gauge line per device and one line of its processes; or the reason there is none.
fn gpu_lines(m: &TopModel) -> Vec<(String, Option<f64>)> {
    match &m.gpus {
        GpuPanel::NoNvml(_) => vec![(format!("GPU       {NO_NVML}"), None)],
        GpuPanel::Devices(d) if d.is_empty() => vec![("GPU       NVML lists no device".into(), None)],
        GpuPanel::Devices(devices) => {
            let mut out = Vec::new();
            for d in devices {
                let ratio = if d.total_bytes > 0 { d.used_bytes as f64 / d.total_bytes as f64 } else { 0.0 };
                out.push((
                    format!(
                        "GPU {} {}  used {} of {}",
                        d.index,
                        d.name,
                        format_bytes(d.used_bytes),
                        format_bytes(d.total_bytes)
                    ),
                    Some(ratio),
                ));
                let procs: Vec<String> =
                    d.process_bytes.iter().map(|(pid, b)| format!("{pid} {}", format_bytes(*b))).collect();
                let list = if procs.is_empty() { "none".to_string() } else { procs.join(", ") };
                out.push((format!("          processes (NVML): {list}"), None));
            }
            out
        }
    }
}

fn column_header(m: &TopModel, k: SortKey) -> String {
    let arrow = if m.sort == k {
        if m.ascending {
            "▲"
        } else {
            "▼"
        }
    } else {
        ""
    };
    format!("{}{arrow}", k.label())
}

fn row_cells(p: &ProcessNow) -> [String; 11] {
    [
        p.pid.to_string(),
        short_bytes(p.rss_bytes),
        short_bytes(p.pss_bytes),
        short_bytes(p.gpu_bytes),
        short_bytes(p.allocated_bytes()),
        short_bytes(p.reserved_bytes()),
        short_bytes(p.peak_allocated_bytes()),
        p.phase.clone().unwrap_or_else(|| "-".into()),
        opt_num(p.step),
        opt_num(p.epoch),
        short_command(&p.command),
    ]
}

/// PID, the six byte columns, PHASE, STEP, EPOCH (COMMAND takes the rest).
const WIDTHS: [u16; 10] = [7, 7, 7, 7, 7, 9, 11, 12, 6, 5];

fn run_state(run: &LiveSnapshot, now_unix_s: f64) -> String {
    if run.finished {
        return match run.exit_code {
            Some(c) => format!("finished, exit code {c}"),
            None => "finished".into(),
        };
    }
    let age = now_unix_s - run.updated_unix_s;
    if age > STALLED_AFTER_S {
        format!("no update for {age:.0} s (recorder stopped?)")
    } else {
        "running".into()
    }
}

fn torch_text(run: &LiveSnapshot) -> String {
    match (run.tree.allocated_bytes, run.tree.reserved_bytes) {
        (Some(a), Some(r)) => format!(
            "PyTorch allocated {} reserved {} (peak {} / {})",
            format_bytes(a),
            format_bytes(r),
            bytes(run.tree.peak_allocated_bytes),
            bytes(run.tree.peak_reserved_bytes)
        ),
        _ => match run.tree.peak_allocated_bytes {
            Some(p) => format!("PyTorch: no allocator now (peak allocated {})", format_bytes(p)),
            None => "PyTorch: no CUDA allocator readings (no CUDA device used)".into(),
        },
    }
}

fn rss_text(run: &LiveSnapshot) -> String {
    let t = &run.tree;
    let mut s = format!("RSS {} (peak {})", bytes(t.rss_bytes), bytes(t.peak_rss_bytes));
    if t.pss_bytes.is_some() {
        s.push_str(&format!("  PSS {} (peak {})", bytes(t.pss_bytes), bytes(t.peak_pss_bytes)));
    }
    s
}

fn spans_text(run: &LiveSnapshot) -> String {
    match run.main_process() {
        Some(p) => {
            format!("phase {}  step {}  epoch {}", p.phase.as_deref().unwrap_or("-"), opt_num(p.step), opt_num(p.epoch))
        }
        None => "phase -  step -  epoch -".into(),
    }
}

/// The last `width` points of `data` (the newest), lifted off their lowest value so the bars show how the
/// memory moves within its range (a sparkline from 0 would be a flat block for 900 MiB ± 50): the lowest
/// point is a low bar, the highest a full one; a constant series a row of low bars.
fn tail(data: &[u64], width: u16) -> Vec<u64> {
    let shown = &data[data.len().saturating_sub(width as usize)..];
    let lo = shown.iter().copied().min().unwrap_or(0);
    let hi = shown.iter().copied().max().unwrap_or(0);
    let floor = (hi - lo) / 8 + 1;
    shown.iter().map(|v| v - lo + floor).collect()
}

/// `lo–hi` of the points a sparkline shows.
fn range_text(data: &[u64], width: u16) -> String {
    let shown = &data[data.len().saturating_sub(width as usize)..];
    match (shown.iter().min(), shown.iter().max()) {
        (Some(lo), Some(hi)) => format!("{}–{}", format_bytes(*lo), format_bytes(*hi)),
        _ => String::new(),
    }
}

/// A label then a sparkline of `data` in the rest of the row.
fn labelled_sparkline(area: Rect, buf: &mut Buffer, label: &str, data: &[u64], color: Color) {
    let [l, s] =
        Layout::horizontal([Constraint::Length(label.chars().count() as u16 + 1), Constraint::Min(1)]).areas(area);
    Paragraph::new(label).render(l, buf);
    if data.is_empty() {
        Paragraph::new("(no readings yet)").style(Style::new().fg(Color::DarkGray)).render(s, buf);
    } else {
        let range = range_text(data, s.width);
        let [sp, r] =
            Layout::horizontal([Constraint::Min(1), Constraint::Length(range.chars().count() as u16 + 1)]).areas(s);
        Sparkline::default().data(tail(data, sp.width)).style(Style::new().fg(color)).render(sp, buf);
        Paragraph::new(format!(" {range}")).render(r, buf);
    }
}

/// `torchmem top`'s screen.
pub fn render_top(area: Rect, buf: &mut Buffer, m: &TopModel) {
    let gpu = gpu_lines(m);
    let memory_rows = 2 + 1 + gpu.len() as u16;
    let [header, memory, table, detail, footer] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(memory_rows),
        Constraint::Min(4),
        Constraint::Length(7),
        Constraint::Length(1),
    ])
    .areas(area);
    Paragraph::new(header_line(m)).style(Style::new().add_modifier(Modifier::BOLD)).render(header, buf);

    let block = Block::new().borders(Borders::ALL).title(" Memory ");
    let inner = block.inner(memory);
    block.render(memory, buf);
    let rows = Layout::vertical(vec![Constraint::Length(1); 1 + gpu.len()]).split(inner);
    let (text, ratio) = host_line(m);
    LineGauge::default()
        .ratio(ratio.clamp(0.0, 1.0))
        .label(format!("{text:<64}"))
        .filled_style(Style::new().fg(Color::Green))
        .render(rows[0], buf);
    for (i, (text, ratio)) in gpu.into_iter().enumerate() {
        match ratio {
            Some(r) => LineGauge::default()
                .ratio(r.clamp(0.0, 1.0))
                .label(format!("{text:<64}"))
                .filled_style(Style::new().fg(Color::Magenta))
                .render(rows[i + 1], buf),
            None => Paragraph::new(text).render(rows[i + 1], buf),
        }
    }

    let title =
        format!(" Processes (sort: {} {}) ", m.sort.label(), if m.ascending { "ascending" } else { "descending" });
    let block = Block::new().borders(Borders::ALL).title(title);
    let rows = m.rows();
    if rows.is_empty() {
        let inner = block.inner(table);
        block.render(table, buf);
        let where_ = match &m.source {
            Source::All(dirs) => format!(" (looked in {})", dirs.join(", ")),
            _ => String::new(),
        };
        Paragraph::new(vec![
            Line::from(format!("No program is running under torchmem{where_}.")),
            Line::from("Start one with `torchmem run -- python train.py`, or name a profile: `torchmem top PROFILE`."),
        ])
        .render(inner, buf);
    } else {
        let mut headers: Vec<String> = SortKey::ALL.iter().map(|k| column_header(m, *k)).collect();
        headers.extend(["PHASE", "STEP", "EPOCH", "COMMAND"].map(String::from));
        let header_row =
            TableRow::new(headers.into_iter().map(Cell::from)).style(Style::new().add_modifier(Modifier::BOLD));
        let body = rows.iter().map(|r| TableRow::new(row_cells(r.process).map(Cell::from)));
        let widths = WIDTHS.iter().map(|w| Constraint::Length(*w)).chain([Constraint::Min(10)]);
        let t = Table::new(body, widths)
            .header(header_row)
            .block(block)
            .row_highlight_style(Style::new().add_modifier(Modifier::REVERSED));
        let mut st = TableState::default().with_selected(Some(m.selected.min(rows.len() - 1)));
        StatefulWidget::render(t, table, buf, &mut st);
    }

    match m.selected_run() {
        Some(run) => render_run(detail, buf, run, m.now_unix_s),
        None => Block::new().borders(Borders::ALL).title(" Run ").render(detail, buf),
    }
    Paragraph::new(footer_text()).style(Style::new().fg(Color::Black).bg(Color::Gray)).render(footer, buf);
}

/// The selected run: its tree's memory with history sparklines and peaks, PyTorch's allocator, the phase.
fn render_run(area: Rect, buf: &mut Buffer, run: &LiveSnapshot, now_unix_s: f64) {
    let title = format!(
        " {} · {} · {:.1} s · {} ",
        run_label(run),
        run.command_line(),
        run.elapsed_s,
        run_state(run, now_unix_s)
    );
    let block = Block::new().borders(Borders::ALL).title(title);
    let inner = block.inner(area);
    block.render(area, buf);
    let [a, b, c, d, e] = Layout::vertical([Constraint::Length(1); 5]).areas(inner);
    let profile = run.profile.as_deref().map(|p| format!("   profile {p}")).unwrap_or_default();
    Paragraph::new(format!("{}   {}{profile}", rss_text(run), processes_text(run.tree.process_count))).render(a, buf);
    labelled_sparkline(b, buf, "RSS history  ", &run.history.rss_bytes, Color::Green);
    Paragraph::new(torch_text(run)).render(c, buf);
    if run.history.allocated_bytes.is_empty() {
        Paragraph::new("").render(d, buf);
    } else {
        labelled_sparkline(d, buf, "allocated    ", &run.history.allocated_bytes, Color::Magenta);
    }
    Paragraph::new(spans_text(run)).render(e, buf);
}

fn gpu_summary(run: &LiveSnapshot) -> String {
    if run.gpus.is_empty() {
        return format!("GPU: {}", run.gpu_note.as_deref().unwrap_or(NO_NVML));
    }
    run.gpus
        .iter()
        .map(|g| {
            let tree = g.tree_bytes.map(|b| format!(", this run {}", format_bytes(b))).unwrap_or_default();
            format!("GPU {} used {} of {}{tree}", g.index, format_bytes(g.used_bytes), format_bytes(g.total_bytes))
        })
        .collect::<Vec<_>>()
        .join("  ")
}

/// `run --live`'s panel: a title rule, then memory with sparklines, PyTorch, and the phase.
pub fn render_inline(area: Rect, buf: &mut Buffer, run: &LiveSnapshot) {
    let pid = run.program_pid.map(|p| format!(" · pid {p}")).unwrap_or_default();
    let title = Line::from(vec![
        Span::styled(" torchmem ", Style::new().add_modifier(Modifier::BOLD)),
        Span::raw(format!("{:.1} s{pid} · {} ", run.elapsed_s, run.command_line())),
    ]);
    let block = Block::new().borders(Borders::TOP).title(title);
    let inner = block.inner(area);
    block.render(area, buf);
    let [a, b, c] = Layout::vertical([Constraint::Length(1); 3]).areas(inner);
    // The texts, then the sparklines in the rest of the row.
    let text_width = rss_text(run).chars().count().max(torch_text(run).chars().count()) as u16 + 2;
    let text_width = text_width.min(area.width.saturating_sub(10));
    let half = |r: Rect| Layout::horizontal([Constraint::Length(text_width), Constraint::Min(1)]).areas::<2>(r);
    let [at, asp] = half(a);
    Paragraph::new(rss_text(run)).render(at, buf);
    if !run.history.rss_bytes.is_empty() {
        Sparkline::default()
            .data(tail(&run.history.rss_bytes, asp.width))
            .style(Style::new().fg(Color::Green))
            .render(asp, buf);
    }
    let [bt, bsp] = half(b);
    Paragraph::new(torch_text(run)).render(bt, buf);
    if !run.history.allocated_bytes.is_empty() {
        Sparkline::default()
            .data(tail(&run.history.allocated_bytes, bsp.width))
            .style(Style::new().fg(Color::Magenta))
            .render(bsp, buf);
    }
    Paragraph::new(format!("{}   {}   {}", spans_text(run), processes_text(run.tree.process_count), gpu_summary(run)))
        .render(c, buf);
}

/// The text form of `top` (a dumb terminal, a pipe, `--once`): the header, memory lines, the table, a line
/// per run.
pub fn plain_top(m: &TopModel) -> String {
    let mut out = format!("{}\n{}\n", header_line(m), host_line(m).0);
    for (text, _) in gpu_lines(m) {
        out.push_str(&text);
        out.push('\n');
    }
    let rows = m.rows();
    if rows.is_empty() {
        let where_ = match &m.source {
            Source::All(dirs) => format!(" (looked in {})", dirs.join(", ")),
            _ => String::new(),
        };
        out.push_str(&format!("No program is running under torchmem{where_}.\n"));
        return out;
    }
    let mut headers: Vec<String> = SortKey::ALL.iter().map(|k| column_header(m, *k)).collect();
    headers.extend(["PHASE", "STEP", "EPOCH", "COMMAND"].map(String::from));
    let fmt_row = |cells: &[String]| {
        let mut line = String::new();
        for (i, c) in cells.iter().enumerate() {
            match WIDTHS.get(i) {
                Some(w) => line.push_str(&format!("{c:<width$} ", width = *w as usize)),
                None => line.push_str(c),
            }
        }
        line.trim_end().to_string() + "\n"
    };
    out.push_str(&fmt_row(&headers));
    for r in &rows {
        out.push_str(&fmt_row(&row_cells(r.process)));
    }
    for run in &m.runs {
        out.push_str(&format!(
            "{} ({}, {:.1} s): {}; {}; {}; {}\n",
            run_label(run),
            run_state(run, m.now_unix_s),
            run.elapsed_s,
            run.command_line(),
            rss_text(run),
            torch_text(run),
            spans_text(run)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tui::state::{GpuDeviceNow, TopModel};
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;
    use torchmem_core::sources::host::HostMemory;
    use torchmem_recorder::live_state::fixtures::two_process_run;

    fn screen(width: u16, height: u16, draw: impl Fn(Rect, &mut Buffer)) -> Vec<String> {
        let mut t = Terminal::new(TestBackend::new(width, height)).unwrap();
        t.draw(|f| draw(f.area(), f.buffer_mut())).unwrap();
        let buf = t.backend().buffer();
        (0..height)
            .map(|y| (0..width).map(|x| buf[(x, y)].symbol().to_string()).collect::<String>().trim_end().to_string())
            .collect()
    }

    fn model() -> TopModel {
        let mut m = TopModel::new(Source::All(vec!["/run/user/0/torchmem".into()]));
        m.hostname = "h1".into();
        m.host = Some(HostMemory { total_bytes: 16 << 30, available_bytes: 12 << 30 });
        m.gpus = GpuPanel::NoNvml("libnvidia-ml.so.1 not found".into());
        m.runs = vec![two_process_run()];
        m.now_unix_s = 1002.5 + 86_400.0 * 3.0 + 3600.0 * 13.0;
        m.runs[0].updated_unix_s = m.now_unix_s - 1.0;
        m
    }

    fn find<'a>(lines: &'a [String], needle: &str) -> &'a String {
        lines
            .iter()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in\n{}", lines.join("\n")))
    }

    #[test]
    fn top_shows_memory_processes_the_run_and_the_keys() {
        let m = model();
        let lines = screen(120, 30, |a, b| render_top(a, b, &m));
        let all = lines.join("\n");
        assert!(lines[0].starts_with("torchmem top — h1 — 1 run — all runs of this user — 13:16:42 UTC"), "{all}");
        let host = find(&lines, "Host RAM");
        assert!(host.contains("used 4.00 GiB of 16.00 GiB (12.00 GiB available)"), "{host}");
        assert!(find(&lines, "GPU").contains(NO_NVML));
        let header = find(&lines, "PID");
        for col in ["RSS▼", "PSS", "GPU", "ALLOC", "RESERVED", "PEAK ALLOC", "PHASE", "STEP", "EPOCH", "COMMAND"] {
            assert!(header.contains(col), "{col} missing: {header}");
        }
        let main = find(&lines, "4242");
        for cell in ["200.0M ", "199.0M ", "100.0M ", "164.0M ", "200.0M ", "backward", " 7 ", "python train.py --fast"]
        {
            assert!(main.contains(cell), "{cell:?} missing: {main}");
        }
        let worker = find(&lines, "4243");
        assert!(worker.contains("50.0M") && worker.contains("python -c worker"), "{worker}");
        let (i_main, i_worker) = (lines.iter().position(|l| l == main), lines.iter().position(|l| l == worker));
        assert!(i_main < i_worker, "sorted by RSS, largest first\n{all}");
        assert!(find(&lines, "run 4241").contains("train.py --fast · 1.5 s · running"), "{all}");
        assert!(find(&lines, "RSS 250.0 MiB (peak 350.0 MiB)").contains("profile /tmp/p.sqlite"));
        let spark = find(&lines, "RSS history");
        assert!(spark.chars().any(|c| "▁▂▃▄▅▆▇█".contains(c)), "a sparkline of the history: {spark}");
        assert!(find(&lines, "PyTorch allocated 100.0 MiB reserved 164.0 MiB (peak 300.0 MiB / 364.0 MiB)").len() > 10);
        assert!(find(&lines, "allocated   ").chars().any(|c| "▁▂▃▄▅▆▇█".contains(c)));
        find(&lines, "phase backward  step 7  epoch 1");
        assert!(lines[29].starts_with("q quit  ↑↓ select  sort: 1 pid  2 rss  3 pss  4 gpu  5 alloc"), "{}", lines[29]);
    }

    #[test]
    fn sorting_by_pid_reorders_and_marks_the_column() {
        let mut m = model();
        m.key('1');
        let lines = screen(120, 30, |a, b| render_top(a, b, &m));
        assert!(find(&lines, "PID▼").contains("RSS "));
        let pos = |pid: &str| lines.iter().position(|l| l.trim_start_matches('│').starts_with(pid)).unwrap();
        assert!(pos("4243") < pos("4242"));
        assert!(lines[3..].iter().any(|l| l.contains("sort: PID descending")));
    }

    #[test]
    fn gpus_show_used_total_and_their_processes() {
        let mut m = model();
        m.gpus = GpuPanel::Devices(vec![GpuDeviceNow {
            index: 0,
            name: "NVIDIA H200".into(),
            used_bytes: 10 << 30,
            total_bytes: 140 << 30,
            process_bytes: [(4242, 3 << 30)].into_iter().collect(),
        }]);
        let lines = screen(120, 32, |a, b| render_top(a, b, &m));
        assert!(find(&lines, "GPU 0 NVIDIA H200").contains("used 10.00 GiB of 140.00 GiB"));
        assert!(find(&lines, "processes (NVML)").contains("4242 3.00 GiB"));
    }

    #[test]
    fn nothing_running_says_where_it_looked_and_what_to_do() {
        let mut m = model();
        m.runs.clear();
        let lines = screen(120, 24, |a, b| render_top(a, b, &m));
        find(&lines, "No program is running under torchmem (looked in /run/user/0/torchmem).");
        find(&lines, "torchmem run -- python train.py");
        assert!(plain_top(&m).contains("No program is running under torchmem"));
    }

    #[test]
    fn a_stalled_or_finished_run_says_so() {
        let mut m = model();
        m.runs[0].updated_unix_s = m.now_unix_s - 30.0;
        let lines = screen(140, 30, |a, b| render_top(a, b, &m));
        find(&lines, "no update for 30 s (recorder stopped?)");
        m.runs[0].finished = true;
        m.runs[0].exit_code = Some(3);
        let lines = screen(140, 30, |a, b| render_top(a, b, &m));
        find(&lines, "finished, exit code 3");
    }

    #[test]
    fn inline_panel_fits_its_rows() {
        let run = two_process_run();
        let lines = screen(120, INLINE_HEIGHT, |a, b| render_inline(a, b, &run));
        assert!(lines[0].starts_with(" torchmem 1.5 s · pid 4242 · train.py --fast ───"), "{}", lines[0]);
        assert!(lines[1].starts_with("RSS 250.0 MiB (peak 350.0 MiB)"), "{}", lines[1]);
        let spark_at = lines[1].find("(peak 350.0 MiB)").unwrap() + 16;
        assert!(lines[1][spark_at..].chars().any(|c| "▁▂▃▄▅▆▇█".contains(c)), "{}", lines[1]);
        assert!(lines[2].starts_with("PyTorch allocated 100.0 MiB"), "{}", lines[2]);
        assert!(
            lines[3].starts_with("phase backward  step 7  epoch 1   2 processes   GPU: no NVIDIA GPU"),
            "{}",
            lines[3]
        );
    }

    #[test]
    fn sparklines_show_the_range_of_what_they_draw() {
        assert_eq!(tail(&[100, 150, 300, 200], 10), vec![26, 76, 226, 126]);
        assert_eq!(tail(&[100, 150, 300, 200], 2), vec![113, 13], "the newest points that fit");
        assert_eq!(tail(&[5, 5], 4), vec![1, 1]);
        assert_eq!(range_text(&[1 << 20, 3 << 20], 4), "1.0 MiB–3.0 MiB");
        let m = model();
        let lines = screen(120, 30, |a, b| render_top(a, b, &m));
        assert!(find(&lines, "RSS history").contains(" 150.0 MiB–350.0 MiB"), "{}", lines.join("\n"));
    }

    #[test]
    fn commands_lose_their_program_directory() {
        assert_eq!(short_command("/venv/bin/python t.py --x /a/b"), "python t.py --x /a/b");
        assert_eq!(short_command("/usr/bin/sleep"), "sleep");
        assert_eq!(short_command(""), "");
    }

    #[test]
    fn short_bytes_fit_seven_characters() {
        assert_eq!(short_bytes(None), "-");
        assert_eq!(short_bytes(Some(512)), "512B");
        assert_eq!(short_bytes(Some((1023 << 20) + (966 << 10))), "1023.9M");
        assert_eq!(short_bytes(Some(210 << 20)), "210.0M");
        assert_eq!(short_bytes(Some(1280 << 20)), "1.25G");
        assert_eq!(short_bytes(Some(141 << 30)), "141.00G");
    }

    #[test]
    fn plain_text_has_the_table_and_a_line_per_run() {
        let m = model();
        let text = plain_top(&m);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("torchmem top — h1"));
        assert!(lines[2].contains(NO_NVML));
        assert!(lines[3].starts_with("PID     RSS▼"), "{text}");
        assert!(
            lines[4].starts_with("4242    200.0M  199.0M  -       100.0M  164.0M")
                && lines[4].ends_with("python train.py --fast"),
            "{text}"
        );
        assert!(lines[6].starts_with("run 4241 (running, 1.5 s): train.py --fast; RSS 250.0 MiB"), "{text}");
        assert!(!text.contains('\x1b'), "no escape sequences for a dumb terminal");
    }
}
