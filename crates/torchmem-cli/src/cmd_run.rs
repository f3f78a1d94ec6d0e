//! `torchmem run`: its arguments, the checks before anything is created ([`plan`]: the program, the
//! intervals, the output path), the call into the recording engine (`torchmem_recorder::session`: the
//! launch, the session loop, the end) and what is printed: the terminal overlay (`--status`'s line,
//! `status_bar`; `--live`'s panel, `tui::inline`), the end's warnings and the summary.
//!
//! A Python program gets torchmem's in-process part with no change to its code: a `sitecustomize.py` placed
//! first on `PYTHONPATH` (`torchmem_recorder::launch`) imports `torchmem._bootstrap`, which samples
//! PyTorch's allocator and sends the Python API's events to the recorder's Unix socket named by
//! `TORCHMEM_EVENT_SOCKET` (every process of the run, spawned ones included, connects to it by itself).
//!
//! As a supervisor it is never worse than running the program bare (`torchmem_recorder::signals`); the
//! output path is checked before anything is created or removed, an existing profile is replaced only with
//! `--force`, and a profile that another live run holds never (`output_path`, `store::ProfileWriter::create`);
//! a program killed by a signal is named, with the OOM killer's part. The live status line is opt-in
//! (`--status`): the program shares the terminal, and a repainted line would glue itself to its output;
//! `--live` is its successor, a ratatui panel in the terminal's bottom rows. Every run registers itself for
//! `torchmem top` (`sinks::live`).

use std::path::PathBuf;

use anyhow::bail;
use torchmem_core::model::{signal_name, Profile};
use torchmem_core::units::format_bytes;

use crate::status_bar::StatusBar;
use crate::tui::inline::{self, InlinePanel};
use crate::tui::view::{INLINE_HEIGHT, NO_NVML};
use torchmem_recorder::launch::{self, Program};
use torchmem_recorder::live_state::LiveSnapshot;
use torchmem_recorder::output_path::{self, Existing};
use torchmem_recorder::session::{Overlay, RunEnd, Session, SessionConfig};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Profile file to write [default: torchmem-<program>-<date>-<time>-<pid>.sqlite in the current
    /// directory]. An existing profile is replaced only with --force; any other existing file never.
    /// A directory (`-o prof/`, or an existing one) gets a new file of this recorder's own,
    /// `<host>-rank<R>-<date>-<time>-<pid>.sqlite` (`node<G>` or `pid<PID>` where it is not a rank), so
    /// every rank or node of a job writes its own; `torchmem report prof/` reads them all.
    #[arg(short = 'o', long = "output", value_name = "PROFILE")]
    pub output: Option<PathBuf>,
    /// Replace an existing profile at -o's path (never a file that is not a torchmem profile, nor a profile
    /// that another run is recording).
    #[arg(short = 'f', long)]
    pub force: bool,
    /// Run a Python module, as `python -m MODULE [ARGS…]` (the COMMAND words are its arguments).
    #[arg(short = 'm', value_name = "MODULE")]
    pub module: Option<String>,
    /// CPU RSS and GPU sampling interval in milliseconds (0.1 to 3600000, one hour). The run ends when
    /// the program does, whatever the interval.
    #[arg(long = "interval", value_name = "MS", default_value_t = 10.0)]
    pub interval_ms: f64,
    /// PSS/USS (smaps_rollup) interval in milliseconds, at least --interval; slower because it is
    /// costlier [default: 250, or --interval when that is longer].
    #[arg(long = "pss-interval", value_name = "MS")]
    pub pss_interval_ms: Option<f64>,
    /// Markers kept per step or phase name and process: later occurrences are folded into exact per-epoch
    /// totals, so a long, fast loop's profile stays small (0: fold all but epochs and marks).
    #[arg(long = "keep-spans", value_name = "N", default_value_t = torchmem_core::fold::DEFAULT_KEEP_SPANS)]
    pub keep_spans: u64,
    /// Line-by-line profile: `--line` profiles functions decorated with @profile; `--line=FILE_OR_MODULE:FUNCTION`
    /// (repeatable) picks functions by name.
    #[arg(long = "line", num_args = 0..=1, require_equals = true, default_missing_value = "", action = clap::ArgAction::Append, value_name = "FILE_OR_MODULE:FUNCTION", value_parser = line_spec)]
    pub line: Vec<String>,
    /// Do not read NVML even when a GPU is present.
    #[arg(long)]
    pub no_gpu: bool,
    /// Do not load torchmem inside the profiled Python process (no allocator timeline, no API events).
    #[arg(long)]
    pub no_inject: bool,
    /// Live outputs besides the profile: --metrics, --metrics-textfile, --tensorboard (`crate::sinks`).
    #[command(flatten)]
    pub sinks: SinkArgs,
    /// Show a live status line in the terminal's bottom row (reserved, so it never mixes with the
    /// program's output). Off by default: only the summary at the end.
    #[arg(long, conflicts_with = "quiet")]
    pub status: bool,
    /// Show a live panel in the terminal's bottom rows, under the program's output (reserved, so it never
    /// mixes with it): memory with history sparklines and peaks, PyTorch's allocated/reserved, the phase,
    /// step and epoch, the GPUs. Replaces --status. Off (with a note) when stderr is not a terminal. For
    /// the full-screen view of every run, see `torchmem top`.
    #[arg(long, conflicts_with = "status")]
    pub live: bool,
    /// No summary at the end (a program killed by a signal is still named).
    #[arg(short, long)]
    pub quiet: bool,
    /// The program: `script.py [ARGS…]` (or a directory with `__main__.py`) runs under the current Python;
    /// anything else runs as given.
    #[arg(
        required_unless_present = "module",
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND"
    )]
    pub command: Vec<String>,
}

/// The shortest `--interval` and `--pss-interval` accepted, in milliseconds.
pub const MIN_INTERVAL_MS: f64 = 0.1;
/// The longest `--interval` and `--pss-interval` accepted: one hour (the run still ends when the program
/// does; a longer interval would only mean no sample at all).
pub const MAX_INTERVAL_MS: f64 = 3_600_000.0;
/// `--pss-interval` when not given: this, or `--interval` when that is longer.
pub const DEFAULT_PSS_INTERVAL_MS: f64 = 250.0;

/// A number as the user typed it, short (`1e300`, not 300 digits).
fn shown(v: f64) -> String {
    if v.is_finite() && v.abs() >= 1e9 {
        format!("{v:e}")
    } else {
        v.to_string()
    }
}

/// The sampling intervals in ms (`--interval`, `--pss-interval`), checked before anything is created:
/// both within [`MIN_INTERVAL_MS`, `MAX_INTERVAL_MS`], the PSS one at least the other. Without
/// `--pss-interval` it follows `--interval`: `max(DEFAULT_PSS_INTERVAL_MS, interval)`.
pub fn checked_intervals(interval_ms: f64, pss_interval_ms: Option<f64>) -> anyhow::Result<(f64, f64)> {
    let in_range = |v: f64| v.is_finite() && (MIN_INTERVAL_MS..=MAX_INTERVAL_MS).contains(&v);
    if !in_range(interval_ms) {
        bail!(
            "--interval must be between {MIN_INTERVAL_MS} and {MAX_INTERVAL_MS:.0} ms (one hour), got {}. Give the sampling interval in milliseconds, e.g. --interval 10",
            shown(interval_ms)
        );
    }
    let pss = match pss_interval_ms {
        None => DEFAULT_PSS_INTERVAL_MS.max(interval_ms),
        Some(p) if !in_range(p) => bail!(
            "--pss-interval must be between {MIN_INTERVAL_MS} and {MAX_INTERVAL_MS:.0} ms (one hour), got {}. Leave it out to follow --interval",
            shown(p)
        ),
        Some(p) if p < interval_ms => bail!(
            "--pss-interval must be at least --interval (got {} and {}). Raise --pss-interval, or leave it out to follow --interval",
            shown(p),
            shown(interval_ms)
        ),
        Some(p) => p,
    };
    Ok((interval_ms, pss))
}

/// A `--line` value: empty (the @profile functions) or `FILE_OR_MODULE:FUNCTION`, both parts non-empty (the
/// target is all before the last ':'), checked before the program runs (a usage error, exit 2).
fn line_spec(value: &str) -> Result<String, String> {
    match value.rsplit_once(':') {
        _ if value.is_empty() => Ok(String::new()),
        Some((target, func)) if !target.is_empty() && !func.is_empty() => Ok(value.to_string()),
        _ => Err("expected FILE_OR_MODULE:FUNCTION, e.g. --line=train.py:step or --line=mypkg.data:collate \
             (or --line alone for the functions decorated with @profile)"
            .into()),
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<i32> {
    let (config, program) = plan(&args)?;
    let mut session = Session::start(config, &program)?;
    let mut overlay = overlay(&args);
    let ended = session.record_until_exit(overlay.as_mut().map(|o| &mut **o as &mut dyn Overlay))?;
    // The terminal is given back before the end's messages.
    drop(overlay);
    Ok(print_end(session.finish(ended), args.quiet))
}

/// Checks everything about the command line and the output before anything is created or removed: the
/// program, the intervals, where the profile goes.
fn plan(args: &RunArgs) -> anyhow::Result<(SessionConfig, Program)> {
    let (interval_ms, pss_interval_ms) = checked_intervals(args.interval_ms, args.pss_interval_ms)?;
    let module = args.module.as_deref();
    let program = Program::resolve(module, &args.command)?;
    // This recorder's own place in a distributed launch (it runs as a rank, or on a numbered node).
    let place = torchmem_core::model::JobPlace::from_vars(&|n| std::env::var(n).ok());
    let hostname =
        std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
    let (output, existing) = match &args.output {
        Some(o) if output_path::names_a_directory(o) => {
            (output_path::dir_output(o, &hostname, place.as_ref())?, Existing::Nothing)
        }
        Some(o) => (o.clone(), output_path::check_profile_output(o, args.force)?),
        None => {
            let default = output_path::default_output(&launch::program_name(module, &args.command));
            output_path::check_default_output_dir(&default)?;
            (default, Existing::Nothing)
        }
    };
    let mut command = args.command.clone();
    if let Some(m) = module {
        command.splice(0..0, ["-m".to_string(), m.to_string()]);
    }
    let config = SessionConfig {
        command,
        interval_ms,
        pss_interval_ms,
        keep_spans: args.keep_spans,
        output,
        existing,
        place,
        hostname,
        gpu: !args.no_gpu,
        inject: !args.no_inject,
        line: args.line.clone(),
        sinks: args.sinks.config(),
        overlay: args.live || args.status,
        no_nvml_note: NO_NVML.to_string(),
    };
    Ok((config, program))
}

/// The terminal view `--status` or `--live` asks for, once the program runs (none where the terminal
/// cannot show it; `--live` says why).
fn overlay(args: &RunArgs) -> Option<Box<dyn Overlay>> {
    if args.status {
        return StatusBar::start().map(|b| Box::new(b) as Box<dyn Overlay>);
    }
    if !args.live {
        return None;
    }
    if let Some(why) = inline::unavailable(INLINE_HEIGHT) {
        eprintln!("torchmem: --live is off: {why} (`torchmem top` shows this run)");
        return None;
    }
    InlinePanel::start(INLINE_HEIGHT).map(|p| Box::new(p) as Box<dyn Overlay>)
}

impl Overlay for StatusBar {
    fn draw(&mut self, now: &LiveSnapshot) {
        StatusBar::draw(self, &status_line(now));
    }
    fn suspend(&mut self) {
        self.end();
    }
    fn resume(&mut self, after_stop: bool) {
        StatusBar::resume(self, after_stop);
    }
}

impl Overlay for InlinePanel {
    fn draw(&mut self, now: &LiveSnapshot) {
        InlinePanel::draw(self, now);
    }
    fn suspend(&mut self) {
        self.end();
    }
    fn resume(&mut self, after_stop: bool) {
        InlinePanel::resume(self, after_stop);
    }
}

/// Says how the run ended (warnings, a killing signal, the OOM killer, the summary) and returns the
/// program's exit code whatever became of the profile (a full disk is not the program's failure).
fn print_end(end: RunEnd, quiet: bool) -> i32 {
    let RunEnd { exit_code, signal, oom_note, bad_messages, profile, output } = end;
    let quoted = output_path::shell_quoted(&output);
    let profile = match profile {
        Ok(p) => p,
        Err(e) => {
            eprintln!(
                "torchmem: warning: could not finish the profile {quoted}: {e}. It keeps what was written; `torchmem report` shows it as unfinished"
            );
            return exit_code;
        }
    };
    if let Some(f) = &profile.meta.write_failure {
        eprintln!("torchmem: warning: the profile is incomplete: {}", f.describe());
    }
    if bad_messages > 0 {
        eprintln!("torchmem: warning: {bad_messages} malformed messages from the program were ignored");
    }
    if let Some(sig) = signal {
        let why = oom_note.as_deref().map(|n| format!(": {n}")).unwrap_or_default();
        eprintln!("torchmem: the program was killed by {} (exit code {exit_code}){why}", signal_name(sig));
    } else if let Some(n) = &oom_note {
        eprintln!("torchmem: warning: {n}");
    }
    if !quiet {
        eprint!("{}", end_summary(&profile));
        eprintln!(
            "torchmem: profile written to {quoted} (see `torchmem report {quoted}` and `torchmem plot {quoted}`)"
        );
    }
    exit_code
}

/// The one-line status (`--status`), from the run's live state: the tree's RSS, PyTorch's allocator summed
/// over the tree's processes and devices, NVML's bytes of the tree.
fn status_line(now: &LiveSnapshot) -> String {
    let t = &now.tree;
    let mut s = format!(
        "[torchmem] {:6.1} s  RSS {} (peak {})",
        (now.updated_unix_s - now.started_unix_s).max(0.0),
        format_bytes(t.rss_bytes.unwrap_or(0)),
        format_bytes(t.peak_rss_bytes.unwrap_or(0))
    );
    if let (Some(a), Some(r)) = (t.allocated_bytes, t.reserved_bytes) {
        s.push_str(&format!("  GPU alloc {} reserved {}", format_bytes(a), format_bytes(r)));
    }
    if let Some(p) = t.peak_allocated_bytes {
        s.push_str(&format!(" (peak {})", format_bytes(p)));
    }
    let nvml: Vec<u64> = now.gpus.iter().filter_map(|g| g.tree_bytes).collect();
    if !nvml.is_empty() {
        s.push_str(&format!("  NVML {}", format_bytes(nvml.iter().sum())));
    }
    s
}

/// The end-of-run summary: peaks, then the per-phase and per-epoch tables and any growth warning.
pub fn end_summary(profile: &Profile) -> String {
    use torchmem_core::analysis::Summary;
    use torchmem_core::report::table;
    let s = Summary::from_profile(profile);
    let mut out = String::from("\n== torchmem summary ==\n");
    let killed = profile.meta.signal.map(|sig| format!(" (killed by {})", signal_name(sig))).unwrap_or_default();
    out.push_str(&format!(
        "duration {:.2} s, exit code {}{killed}, {} samples\n",
        s.duration_ns.unwrap_or(0) as f64 / 1e9,
        s.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
        s.samples
    ));
    // The kernel's high-water marks (VmHWM, and `wait4`'s ru_maxrss at the end) hold a peak that fell
    // between two samples, or a run shorter than one interval: the peak said is never below them.
    let kernel = torchmem_core::report::cells::kernel_peaks(profile).into_iter().max_by_key(|(_, b)| *b);
    match (s.peak.cpu_rss_bytes, kernel) {
        (sampled, Some((pid, k))) if sampled.is_none_or(|v| k > v) => out.push_str(&format!(
            "peak CPU RSS {} (the kernel's high-water mark of pid {pid}; the samples peaked at {})",
            format_bytes(k),
            sampled.map(format_bytes).unwrap_or_else(|| "-".into())
        )),
        (sampled, _) => {
            out.push_str(&format!("peak CPU RSS {}", sampled.map(format_bytes).unwrap_or_else(|| "-".into())))
        }
    }
    if let Some(pss) = s.peak.cpu_pss_bytes {
        out.push_str(&format!(", PSS {}", format_bytes(pss)));
    }
    if let Some(uss) = s.peak.cpu_uss_bytes {
        out.push_str(&format!(", USS {}", format_bytes(uss)));
    }
    out.push('\n');
    if s.peak.gpus.is_empty() {
        out.push_str("GPU: no CUDA device used\n");
    }
    for g in &s.peak.gpus {
        out.push_str(&format!(
            "peak GPU {}{}: allocated {}, reserved {}, NVML process {}\n",
            g.device,
            g.name.as_ref().map(|n| format!(" ({n})")).unwrap_or_default(),
            g.allocated_bytes.map(format_bytes).unwrap_or_else(|| "-".into()),
            g.reserved_bytes.map(format_bytes).unwrap_or_else(|| "-".into()),
            g.nvml_process_bytes.map(format_bytes).unwrap_or_else(|| "-".into()),
        ));
    }
    if !s.phases.is_empty() {
        out.push_str(&table::render_phases(&s.phases));
    }
    if !s.epochs.is_empty() {
        out.push_str(&table::render_epochs(&s.epochs));
    }
    out.push_str(&table::render_growth(&s.growth));
    out
}

/// The command-line options that attach live sinks to `torchmem run`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SinkArgs {
    /// Serve Prometheus metrics at http://HOST:PORT/metrics while the program runs (`:PORT` is
    /// 127.0.0.1:PORT; port 0 picks a free one, printed at the start). Bytes, labels pid, rank, local_rank,
    /// device and UUID (as DCGM's exporter, to join on UUID).
    #[arg(long = "metrics", value_name = "HOST:PORT", value_parser = torchmem_recorder::sinks::http::parse_listen_address)]
    pub metrics: Option<String>,
    /// With --metrics, when one `torchmem run` runs per rank (`torchrun -m torchmem run …`, `srun
    /// torchmem run …`): serve on PORT + this recorder's LOCAL_RANK (else SLURM_LOCALID; 0 when neither is
    /// set), so the ranks of a node never ask for the same port. A recorder inside a launch whose port is
    /// taken anyway serves on a free port (printed) rather than ending its rank.
    #[arg(long = "metrics-port-offset", value_name = "WHAT", value_enum, requires = "metrics")]
    pub metrics_port_offset: Option<PortOffset>,
    /// Write the same metrics to PATH (a `*.prom` file in node_exporter's textfile-collector directory)
    /// every few seconds, atomically (a temporary file renamed over it), and once more at the end.
    #[arg(long = "metrics-textfile", value_name = "PATH")]
    pub metrics_textfile: Option<PathBuf>,
    /// Write TensorBoard event files into DIR (created if missing): memory scalars under `torchmem/`
    /// (the highest value of each second, step = ms since the start) and per-step, per-phase peaks
    /// (step = the program's step index).
    #[arg(long = "tensorboard", value_name = "DIR")]
    pub tensorboard: Option<PathBuf>,
}

/// What `--metrics-port-offset` adds to the port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PortOffset {
    /// The recorder's LOCAL_RANK (else SLURM_LOCALID).
    LocalRank,
}

impl SinkArgs {
    /// The recorder's sink configuration these options ask for.
    pub fn config(&self) -> torchmem_recorder::sinks::SinkConfig {
        torchmem_recorder::sinks::SinkConfig {
            metrics: self.metrics.clone(),
            metrics_port_offset_local_rank: self.metrics_port_offset == Some(PortOffset::LocalRank),
            metrics_textfile: self.metrics_textfile.clone(),
            tensorboard: self.tensorboard.clone(),
        }
    }
}
