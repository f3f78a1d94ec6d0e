//! The report's tables as plain cells (title, header, rows, notes), built once from a `Summary` and drawn
//! by every tabular format: aligned text (`table.rs`), Markdown (`markdown.rs`) and HTML (`html.rs`).
//!
//! GPU columns are left out, with a note saying so, when the run had no CUDA device: a CPU-only run shows
//! no fake zeros.

use crate::analysis::{EpochRow, Leak, PhaseRow, ProcessRow, Summary};
use crate::journey::JourneyStage;
use crate::model::Profile;
use crate::units::{format_bytes, format_delta, format_duration, format_opt_bytes, format_secs};

/// Shown under a table whose GPU columns were left out.
pub const NO_CUDA_NOTE: &str = "GPU: no CUDA device in this run, so there are no GPU columns (not zeros).";

/// One table, ready to draw in any format.
#[derive(Debug, Clone, PartialEq)]
pub struct Table {
    pub title: String,
    pub headers: Vec<String>,
    /// Per column: true for numbers (drawn right-aligned).
    pub numeric: Vec<bool>,
    pub rows: Vec<Vec<String>>,
    /// Lines drawn under the table.
    pub notes: Vec<String>,
    /// Drawn instead of the table when there are no rows.
    pub empty: String,
}

impl Table {
    /// An empty table: a title, and what is drawn while it has no rows.
    pub fn new(title: &str, empty: &str) -> Table {
        Table {
            title: title.into(),
            headers: Vec::new(),
            numeric: Vec::new(),
            rows: Vec::new(),
            notes: Vec::new(),
            empty: empty.into(),
        }
    }
}

/// Builds a table column by column from rows of `R`, so optional column groups stay aligned with their cells.
struct Columns<'a, R> {
    cols: Vec<Column<'a, R>>,
}

/// Header, numeric, how to draw the cell.
type Column<'a, R> = (String, bool, Box<dyn Fn(&R) -> String + 'a>);

impl<'a, R> Columns<'a, R> {
    fn new() -> Self {
        Columns { cols: Vec::new() }
    }
    fn text(&mut self, header: &str, f: impl Fn(&R) -> String + 'a) {
        self.cols.push((header.into(), false, Box::new(f)));
    }
    fn num(&mut self, header: &str, f: impl Fn(&R) -> String + 'a) {
        self.cols.push((header.into(), true, Box::new(f)));
    }
    fn fill(self, table: &mut Table, rows: &[R]) {
        table.headers = self.cols.iter().map(|c| c.0.clone()).collect();
        table.numeric = self.cols.iter().map(|c| c.1).collect();
        table.rows = rows.iter().map(|r| self.cols.iter().map(|c| (c.2)(r)).collect()).collect();
    }
}

fn opt_delta(d: Option<i64>) -> String {
    d.map(format_delta).unwrap_or_else(|| "-".into())
}

fn opt_secs(ns: Option<u64>) -> String {
    ns.map(format_secs).unwrap_or_else(|| "unfinished".into())
}

/// True when the run had a CUDA device: PyTorch CUDA samples or an NVML device.
pub fn has_cuda(summary: &Summary) -> bool {
    !summary.peak.gpus.is_empty()
}

/// The run as key/value lines: profile, command, how it ended, duration, samples, host, GPUs.
pub fn meta_lines(profile: &Profile, summary: &Summary) -> Vec<(String, String)> {
    let m = &profile.meta;
    let mut out = vec![("profile".to_string(), profile.path.display().to_string())];
    out.push(("command".into(), if m.command.is_empty() { "-".into() } else { m.command.join(" ") }));
    let mut ended = match (m.exit_code, m.duration_ns, m.signal) {
        (Some(code), _, Some(sig)) => format!("killed by {} (exit code {code})", crate::model::signal_name(sig)),
        (Some(code), _, None) => format!("exit code {code}"),
        (None, Some(_), _) => "ended by a signal (no exit code)".into(),
        (None, None, _) if m.recording => {
            "still recording: a live `torchmem run` holds this profile; the data up to now is shown".into()
        }
        (None, None, _) if m.copied_without_wal => format!(
            "unfinished: this is the main file of a live profile copied without its write-ahead log ({}-wal); the data up to the log's last checkpoint is shown. Copy the -wal along with it, or copy the profile again once its run has ended",
            profile.path.display()
        ),
        (None, None, _) => {
            "unfinished: the recorder stopped before the run ended (killed?); the data up to then is shown".into()
        }
    };
    if let Some(note) = m.oom.as_ref().and_then(|o| o.describe(m.signal)) {
        ended.push_str(&format!(": {note}"));
    }
    if let Some(f) = &m.write_failure {
        ended.push_str(&format!("; the profile is incomplete: {}", f.describe()));
    }
    out.push(("ended".into(), ended));
    out.push(("duration".into(), summary.duration_ns.map(format_secs).unwrap_or_else(|| "-".into())));
    let interval = if m.interval_ms > 0.0 { format!(", every {} ms", m.interval_ms) } else { String::new() };
    out.push((
        "samples".into(),
        format!(
            "{} CPU{interval}; {} PyTorch allocator; {} NVML",
            summary.samples, summary.torch_samples, summary.gpu_samples
        ),
    ));
    if !m.hostname.is_empty() || m.host_total_bytes.is_some() {
        let ram = m.host_total_bytes.map(|b| format!(", {} RAM", format_bytes(b))).unwrap_or_default();
        out.push(("host".into(), format!("{}{ram}", if m.hostname.is_empty() { "-" } else { &m.hostname })));
    }
    let gpus = if summary.peak.gpus.is_empty() {
        "no CUDA device in this run".to_string()
    } else {
        summary
            .peak
            .gpus
            .iter()
            .map(|g| {
                let name = g.name.clone().unwrap_or_else(|| "unknown".into());
                match g.total_bytes {
                    Some(t) => format!("{}: {name}, {}", g.device, format_bytes(t)),
                    None => format!("{}: {name}", g.device),
                }
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    out.push(("GPUs".into(), gpus));
    if !m.torchmem_version.is_empty() {
        out.push(("torchmem".into(), m.torchmem_version.clone()));
    }
    out
}

fn share(bytes: Option<u64>, total: Option<u64>) -> String {
    match (bytes, total) {
        (Some(b), Some(t)) if t > 0 => {
            format!("{:.1}% of {}", b as f64 * 100.0 / t as f64, format_bytes(t))
        }
        _ => String::new(),
    }
}

/// Peaks: CPU RSS/PSS/USS of the process tree, and per GPU allocated, reserved and NVML.
pub fn peaks_table(summary: &Summary) -> Table {
    let mut t = Table::new("Peaks", "no samples recorded");
    t.headers = vec!["memory".into(), "peak".into(), "".into()];
    t.numeric = vec![false, true, false];
    let p = &summary.peak;
    let when = p.cpu_rss_t_ns.map(|ns| format!("at {}", format_secs(ns))).unwrap_or_default();
    t.rows.push(vec![
        "CPU RSS, process tree".into(),
        format_opt_bytes(p.cpu_rss_bytes),
        if p.cpu_rss_bytes.is_some() { when } else { "no CPU samples".into() },
    ]);
    if let Some(pss) = p.cpu_pss_bytes {
        t.rows.push(vec![
            "CPU PSS, process tree".into(),
            format_bytes(pss),
            "shared pages split between processes".into(),
        ]);
    }
    if let Some(uss) = p.cpu_uss_bytes {
        t.rows.push(vec!["CPU USS, process tree".into(), format_bytes(uss), "private pages only".into()]);
    }
    for g in &p.gpus {
        let name = g.name.as_deref().map(|n| format!(" ({n})")).unwrap_or_default();
        let torch_missing = "not recorded: no PyTorch CUDA allocator samples";
        let rows = [
            ("allocated (PyTorch)", g.allocated_bytes, torch_missing),
            ("reserved (PyTorch)", g.reserved_bytes, torch_missing),
            ("NVML, profiled processes", g.nvml_process_bytes, "not recorded: no NVML per-process reading"),
            ("NVML, whole device", g.nvml_used_bytes, "not recorded: no NVML reading"),
        ];
        for (i, (what, bytes, missing)) in rows.into_iter().enumerate() {
            let label =
                if i == 0 { format!("GPU {}{name} {what}", g.device) } else { format!("GPU {} {what}", g.device) };
            let detail = if bytes.is_some() { share(bytes, g.total_bytes) } else { missing.to_string() };
            t.rows.push(vec![label, format_opt_bytes(bytes), detail]);
        }
    }
    if p.gpus.is_empty() {
        t.notes
            .push("GPU: no CUDA device in this run (no NVML device, no PyTorch CUDA samples), so no GPU peaks.".into());
    }
    t
}

/// One row per epoch: time, memory at its end, peaks inside it, growth since the previous epoch.
pub fn epochs_table(rows: &[EpochRow]) -> Table {
    let mut t = Table::new("Epochs", "none recorded; mark them with `with mon.epoch():` (torchmem.Monitor)");
    let gpu = rows
        .iter()
        .any(|r| r.allocated_bytes.is_some() || r.reserved_bytes.is_some() || r.peak_allocated_bytes.is_some());
    let mut c: Columns<EpochRow> = Columns::new();
    c.num("epoch", |r| r.index.to_string());
    c.num("time", |r| opt_secs(r.duration_ns));
    if gpu {
        c.num("allocated", |r| format_opt_bytes(r.allocated_bytes));
        c.num("reserved", |r| format_opt_bytes(r.reserved_bytes));
        c.num("peak allocated", |r| format_opt_bytes(r.peak_allocated_bytes));
        c.num("peak reserved", |r| format_opt_bytes(r.peak_reserved_bytes));
        c.num("Δ allocated", |r| opt_delta(r.growth_allocated_bytes));
    }
    c.num("CPU RSS", |r| format_opt_bytes(r.rss_bytes));
    c.num("peak RSS", |r| format_opt_bytes(r.peak_rss_bytes));
    c.num("Δ RSS", |r| opt_delta(r.growth_rss_bytes));
    c.fill(&mut t, rows);
    if !rows.is_empty() {
        t.notes.push("Memory at the end of each epoch; Δ = change since the previous epoch's end.".into());
        if !gpu {
            t.notes.push(NO_CUDA_NOTE.into());
        }
    }
    t
}

/// One row per phase name (forward, backward, optimizer, tracked blocks), aggregated over its occurrences.
pub fn phases_table(rows: &[PhaseRow]) -> Table {
    let mut t = Table::new(
        "Phases",
        "none recorded; record them with `torchmem.track(name)` or `torchmem.Monitor(model, optimizer)`",
    );
    let gpu = rows.iter().any(|r| r.max_peak_allocated_bytes.is_some() || r.mean_delta_allocated_bytes.is_some());
    let mut c: Columns<PhaseRow> = Columns::new();
    c.text("phase", |r| r.name.clone());
    c.num("count", |r| r.count.to_string());
    c.num("total time", |r| format_secs(r.total_ns));
    c.num("mean time", |r| format_duration(r.total_ns.checked_div(r.count).unwrap_or(0)));
    if gpu {
        c.num("mean Δ allocated", |r| opt_delta(r.mean_delta_allocated_bytes));
        c.num("max peak allocated", |r| format_opt_bytes(r.max_peak_allocated_bytes));
        c.num("max peak reserved", |r| format_opt_bytes(r.max_peak_reserved_bytes));
    }
    c.num("mean Δ RSS", |r| opt_delta(r.mean_delta_rss_bytes));
    c.num("max peak RSS", |r| format_opt_bytes(r.max_peak_rss_bytes));
    c.fill(&mut t, rows);
    if !rows.is_empty() {
        t.notes.push("Δ = memory at the phase's end minus at its start, averaged over its occurrences.".into());
        if !gpu {
            t.notes.push(NO_CUDA_NOTE.into());
        }
    }
    t
}

fn short_command(cmd: &str) -> String {
    const MAX_CHARS: usize = 70;
    if cmd.chars().count() <= MAX_CHARS {
        cmd.to_string()
    } else {
        format!("{}…", cmd.chars().take(MAX_CHARS - 1).collect::<String>())
    }
}

/// What a process of the tree is, from its parent and command line: the profiled program ("main"), a
/// fork of its parent (same command line: what DataLoader workers with the default fork start method look
/// like), a multiprocessing spawn/forkserver child, or another child.
pub fn process_role(row: &ProcessRow, rows: &[ProcessRow]) -> String {
    let Some(parent) = rows.iter().find(|p| p.pid == row.ppid && p.pid != row.pid) else {
        return "main".into();
    };
    let cmd = row.cmdline.as_str();
    if cmd.contains("multiprocessing.spawn") || cmd.contains("spawn_main") {
        format!("spawned by {} (multiprocessing; DataLoader worker?)", parent.pid)
    } else if cmd.contains("multiprocessing.forkserver") {
        format!("forkserver of {}", parent.pid)
    } else if !cmd.is_empty() && cmd == parent.cmdline {
        format!("fork of {} (DataLoader worker?)", parent.pid)
    } else {
        format!("child of {}", parent.pid)
    }
}

/// One row per process of the tree (workers included), with its peaks.
pub fn processes_table(rows: &[ProcessRow]) -> Table {
    let mut t = Table::new("Processes", "none recorded");
    let gpu = rows.iter().any(|r| r.peak_gpu_bytes.is_some());
    let mut c: Columns<ProcessRow> = Columns::new();
    c.num("pid", |r| r.pid.to_string());
    c.num("ppid", |r| r.ppid.to_string());
    c.text("role", |r| process_role(r, rows));
    c.num("peak RSS", |r| format_opt_bytes(r.peak_rss_bytes));
    c.num("peak PSS", |r| format_opt_bytes(r.peak_pss_bytes));
    c.num("peak USS", |r| format_opt_bytes(r.peak_uss_bytes));
    if gpu {
        c.num("peak GPU (NVML)", |r| format_opt_bytes(r.peak_gpu_bytes));
    }
    c.num("lifetime", |r| format_secs(r.lifetime_ns));
    c.text("command", |r| short_command(&r.cmdline));
    c.fill(&mut t, rows);
    if !rows.is_empty() && !gpu {
        t.notes.push("GPU: no NVML reading for these processes (no CUDA device in this run), so no GPU column.".into());
    }
    t
}

/// The journey as a table (Markdown and HTML; the text report uses `journey::render_text`).
pub fn journey_table(stages: &[JourneyStage]) -> Table {
    let mut t = Table::new("Memory journey", "no stages recorded");
    let gpu = stages.iter().any(|s| s.allocated_bytes.is_some() || s.reserved_bytes.is_some());
    let mut c: Columns<JourneyStage> = Columns::new();
    c.num("#", |_| String::new());
    c.text("stage", |s| s.name.clone());
    if gpu {
        c.num("allocated", |s| format_opt_bytes(s.allocated_bytes));
        c.num("reserved", |s| format_opt_bytes(s.reserved_bytes));
    }
    c.num("CPU RSS", |s| format_opt_bytes(s.rss_bytes));
    c.num("of capacity", |s| match (s.pressure(), s.capacity_bytes) {
        (Some(p), Some(cap)) => format!("{:.1}% of {}", p * 100.0, format_bytes(cap)),
        _ => "-".into(),
    });
    c.fill(&mut t, stages);
    for (i, row) in t.rows.iter_mut().enumerate() {
        row[0] = (i + 1).to_string();
    }
    t
}

/// Each process's kernel RSS high-water mark (`VmHWM`), from the recorder's `vmhwm` blobs (the highest).
pub fn kernel_peaks(profile: &Profile) -> std::collections::BTreeMap<u32, u64> {
    let mut out = std::collections::BTreeMap::new();
    for b in &profile.blobs {
        let crate::record::Blob::Vmhwm(v) = b else { continue };
        for (&pid, &bytes) in &v.pids {
            let e = out.entry(pid).or_insert(0);
            *e = bytes.max(*e);
        }
    }
    out
}

/// The processes of the tree still running when the program ended (it left them running), from the
/// recorder's `outlived_program` blob.
pub fn outlived_program(profile: &Profile) -> std::collections::BTreeSet<u32> {
    profile
        .blobs
        .iter()
        .filter_map(|b| match b {
            crate::record::Blob::Outlived(o) => Some(o.pids.iter().copied()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// Every table of a recorded run: `all_tables`, plus what only the profile knows. The kernel's
/// high-water marks (VmHWM) raise a sampled peak that missed a short spike (labelled so), and a PSS/USS
/// peak from fewer than 2 samples (a run shorter than the PSS interval) is said to be one, not printed.
pub fn all_tables_of(profile: &Profile, summary: &Summary) -> Vec<Table> {
    let mut tables = all_tables(summary);
    let hwm = kernel_peaks(profile);
    let pss_samples = profile.cpu.iter().filter(|s| s.pss_bytes.is_some()).count();
    let interval = format!("{:.0} ms", profile.meta.interval_ms);
    for t in &mut tables {
        if t.title == "Peaks" {
            let top = hwm.iter().max_by_key(|(_, b)| **b);
            for row in &mut t.rows {
                match row[0].as_str() {
                    "CPU RSS, process tree" => {
                        if let Some((pid, &b)) = top.filter(|(_, &b)| summary.peak.cpu_rss_bytes.is_none_or(|s| b > s))
                        {
                            row[1] = format!("≥ {}", format_bytes(b));
                            row[2] = format!(
                                "kernel high-water mark (VmHWM) of pid {pid}; the {interval} samples peaked at {}",
                                format_opt_bytes(summary.peak.cpu_rss_bytes)
                            );
                        }
                    }
                    "CPU PSS, process tree" | "CPU USS, process tree" if pss_samples < 2 => {
                        row[1] = "-".into();
                        row[2] = format!(
                            "{pss_samples} sample only, at the start (the run was shorter than the PSS interval): no peak"
                        );
                    }
                    _ => {}
                }
            }
        }
        if t.title == "Processes" {
            let col = |name: &str| t.headers.iter().position(|h| h == name);
            let (Some(pid_col), Some(rss_col)) = (col("pid"), col("peak RSS")) else { continue };
            let outlived = outlived_program(profile);
            if let (Some(role_col), false) = (col("role"), outlived.is_empty()) {
                let main = summary.processes.first().map(|p| p.pid);
                for row in &mut t.rows {
                    let Ok(pid) = row[pid_col].parse::<u32>() else { continue };
                    if outlived.contains(&pid) && Some(pid) != main {
                        // Its parent may be torchmem (the kernel hands orphans to it), which is no row.
                        let role = &mut row[role_col];
                        *role = if role == "main" { "left running".into() } else { format!("{role}, left running") };
                    }
                }
                t.notes.push("left running: still running when the program ended (it outlived it); its lifetime is what was seen until then.".into());
            }
            let pss_cols: Vec<usize> = ["peak PSS", "peak USS"].iter().filter_map(|h| col(h)).collect();
            for row in &mut t.rows {
                let Ok(pid) = row[pid_col].parse::<u32>() else { continue };
                let sampled = summary.processes.iter().find(|p| p.pid == pid).and_then(|p| p.peak_rss_bytes);
                if let Some(&b) = hwm.get(&pid).filter(|&&b| sampled.is_none_or(|s| b > s)) {
                    row[rss_col] = format!("{} (VmHWM)", format_bytes(b));
                }
                let n = profile.process_samples.iter().filter(|s| s.pid == pid && s.pss_bytes.is_some()).count();
                if n < 2 {
                    for &c in &pss_cols {
                        row[c] = if n == 1 { "- (1 sample)".into() } else { "- (no sample)".into() };
                    }
                }
            }
            if !hwm.is_empty() {
                t.notes.push(format!("peak RSS: the highest of the {interval} samples and, marked (VmHWM), the kernel's high-water mark when that is higher (a peak between two samples). PSS/USS are read less often; \"- (1 sample)\" means too few reads for a peak."));
            }
        }
    }
    tables
}

/// Every table of the report, in the order the reports show them.
pub fn all_tables(summary: &Summary) -> Vec<Table> {
    let mut tables = Vec::new();
    if !summary.leaks.is_empty() {
        tables.push(leaks_table(&summary.leaks));
    }
    tables.extend([
        peaks_table(summary),
        phases_table(&summary.phases),
        epochs_table(&summary.epochs),
        processes_table(&summary.processes),
    ]);
    tables
}

/// The lines that keep memory alive step after step (`analysis::leaks`): where, what, how much per step,
/// how many live objects, the autograd graph a tensor holds, the source line.
pub fn leaks_table(leaks: &[Leak]) -> Table {
    let mut t = Table::new("Leaks", "no line keeps memory alive step after step");
    let mut c: Columns<Leak> = Columns::new();
    c.text("line", |l| format!("{}:{}", l.file.rsplit('/').next().unwrap_or(&l.file), l.line));
    c.text("kind", |l| match &l.device {
        Some(d) if d.starts_with("cuda") => format!("{} ({d})", l.kind.as_str()),
        _ => l.kind.as_str().to_string(),
    });
    c.num("per step", |l| format_delta(l.per_step_bytes));
    c.num("live", |l| format!("{} ({})", l.live_count, format_bytes(l.live_bytes)));
    c.text("holds", |l| match (l.holds_graph, l.graph_saved_bytes) {
        (true, Some(b)) => format!("graph: {} saved, {} nodes", format_bytes(b), l.graph_nodes.unwrap_or(0)),
        _ => "-".into(),
    });
    c.text("source", |l| l.source.clone());
    c.fill(&mut t, leaks);
    t.notes = leaks
        .iter()
        .map(|l| format!("{}:{} is {}", l.file.rsplit('/').next().unwrap_or(&l.file), l.line, l.file))
        .collect();
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn process_roles_tell_forked_and_spawned_workers_apart() {
        let row = |pid: u32, ppid: u32, cmd: &str| ProcessRow {
            pid,
            ppid,
            cmdline: cmd.into(),
            peak_rss_bytes: None,
            peak_pss_bytes: None,
            peak_uss_bytes: None,
            peak_gpu_bytes: None,
            lifetime_ns: 0,
        };
        let rows = vec![
            row(10, 1, "python train.py"),
            row(11, 10, "python train.py"),
            row(12, 10, "python -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7) --multiprocessing-fork"),
            row(13, 10, "nvidia-smi"),
        ];
        let roles: Vec<String> = rows.iter().map(|r| process_role(r, &rows)).collect();
        assert_eq!(
            roles,
            [
                "main",
                "fork of 10 (DataLoader worker?)",
                "spawned by 10 (multiprocessing; DataLoader worker?)",
                "child of 10"
            ]
        );
    }

    #[test]
    fn one_pss_read_is_not_a_peak_and_a_high_water_mark_raises_the_sampled_peak() {
        use crate::model::*;
        let mut p = Profile::default();
        p.meta.interval_ms = 10.0;
        for (i, pss) in [(0u64, Some(50 << 10)), (1, None), (2, None)] {
            p.cpu.push(CpuSample {
                t_ns: i * 10_000_000,
                rss_bytes: 80 << 20,
                pss_bytes: pss,
                uss_bytes: pss,
                process_count: 1,
            });
        }
        p.processes.push(ProcessInfo {
            pid: 7,
            ppid: 1,
            cmdline: "python x.py".into(),
            first_t_ns: 0,
            last_t_ns: 20_000_000,
        });
        p.process_samples.push(ProcessSample {
            t_ns: 0,
            pid: 7,
            rss_bytes: 200 << 10,
            pss_bytes: Some(50 << 10),
            uss_bytes: Some(30 << 10),
            gpu_bytes: None,
        });
        p.blobs.push(crate::record::Blob::from_parts("vmhwm".into(), serde_json::json!({"pids": {"7": 91u64 << 20}})));
        let s = Summary::from_profile(&p);
        let tables = all_tables_of(&p, &s);
        let peaks = tables.iter().find(|t| t.title == "Peaks").unwrap();
        let row = |name: &str| peaks.rows.iter().find(|r| r[0] == name).unwrap().clone();
        assert_eq!(row("CPU PSS, process tree")[1], "-");
        assert!(row("CPU PSS, process tree")[2].contains("1 sample only"));
        assert_eq!(row("CPU RSS, process tree")[1], "≥ 91.0 MiB");
        assert!(row("CPU RSS, process tree")[2].contains("VmHWM) of pid 7"));
        let procs = tables.iter().find(|t| t.title == "Processes").unwrap();
        let r = &procs.rows[0];
        assert!(r.contains(&"91.0 MiB (VmHWM)".to_string()) && r.contains(&"- (1 sample)".to_string()), "{r:?}");
        assert!(r.contains(&"main".to_string()));
    }

    const MIB: u64 = 1 << 20;

    fn cpu_epoch(index: i64, rss: u64) -> EpochRow {
        EpochRow {
            index,
            pid: None,
            rank: None,
            steps: None,
            duration_ns: Some(1_500_000_000),
            allocated_bytes: None,
            reserved_bytes: None,
            peak_allocated_bytes: None,
            peak_reserved_bytes: None,
            rss_bytes: Some(rss),
            peak_rss_bytes: Some(rss + MIB),
            held_rss_bytes: None,
            rss_after_emptied_cache_bytes: None,
            growth_allocated_bytes: None,
            growth_rss_bytes: Some(0),
        }
    }

    #[test]
    fn cpu_only_epochs_have_no_gpu_columns_and_say_why() {
        let t = epochs_table(&[cpu_epoch(0, 100 * MIB), cpu_epoch(1, 100 * MIB)]);
        assert_eq!(t.headers, ["epoch", "time", "CPU RSS", "peak RSS", "Δ RSS"]);
        assert_eq!(t.rows[1], ["1", "1.500 s", "100.0 MiB", "101.0 MiB", "0 B"]);
        assert!(t.notes.iter().any(|n| n == NO_CUDA_NOTE));
    }

    #[test]
    fn gpu_epochs_have_gpu_columns() {
        let mut r = cpu_epoch(0, 100 * MIB);
        r.allocated_bytes = Some(2 * MIB);
        r.peak_allocated_bytes = Some(3 * MIB);
        let t = epochs_table(&[r]);
        assert!(t.headers.contains(&"peak allocated".to_string()));
        assert_eq!(t.rows[0][2], "2.0 MiB");
        assert_eq!(t.rows[0][3], "-", "reserved was not measured: a dash, not a zero");
        assert!(!t.notes.iter().any(|n| n == NO_CUDA_NOTE));
    }

    #[test]
    fn long_commands_are_shortened() {
        let long = "x".repeat(200);
        assert_eq!(short_command(&long).chars().count(), 70);
        assert_eq!(short_command("python a.py"), "python a.py");
    }
}
