//! `torchmem run`: starts the program, records its memory into a profile until it exits, passes signals on,
//! returns the program's exit code, and prints a short summary.
//!
//! A Python program gets torchmem's in-process part with no change to its code: a `sitecustomize.py` placed
//! first on `PYTHONPATH` imports `torchmem._bootstrap`, which samples PyTorch's allocator and sends the
//! Python API's events to the recorder's Unix socket named by `TORCHMEM_EVENT_SOCKET` (every process of the
//! run, spawned ones included, connects to it by itself).
//!
//! As a supervisor it is never worse than running the program bare: signals are passed on exactly once and
//! ignored ones stay ignored (`signals`); the output path is checked before anything is created or removed,
//! an existing profile is replaced only with `--force`, and a profile that another live run holds never
//! (`output_path`, `store::ProfileWriter::create`); a failed start leaves no file behind; the summary is read
//! through the run's own connection; a program killed by a signal is named, with the OOM killer's part
//! (`oom_watch`). The live status line is opt-in (`--status`, `status_bar`): the program shares the
//! terminal, and a repainted line would glue itself to its output; `--live` is its successor, a ratatui
//! panel in the terminal's bottom rows (`tui::inline`). Every run registers itself for `torchmem top`
//! (`sinks::live`).

use std::ffi::OsString;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail};
use torchmem_core::model::Profile;
use torchmem_core::model::{signal_name, RunMeta};
use torchmem_core::sources::gpu::{GpuSource, NvmlSource};
use torchmem_core::store::ProfileWriter;
use torchmem_core::units::format_bytes;

use crate::status_bar::StatusBar;
use crate::tui::inline::{self, InlinePanel};
use crate::tui::view::{INLINE_HEIGHT, NO_NVML};
use torchmem_recorder::live_state::{LiveHandle, LiveSnapshot};
use torchmem_recorder::oom_watch::OomWatch;
use torchmem_recorder::output_path::{self, Existing};
use torchmem_recorder::recorder::{Config, EventListener, Recorder};
use torchmem_recorder::signals::Supervisor;
use torchmem_recorder::sinks::live::LiveSink;
use torchmem_recorder::sinks::{RunContext, Sinks};

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

/// A pidfd of the program (`pidfd_open`), readable once it has ended: the run loop wakes on it. None where
/// the kernel lacks pidfds (Linux < 5.3): the loop then checks at least every `NO_PIDFD_POLL`.
fn program_pidfd(pid: libc::pid_t) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags; a non-negative result is a new descriptor we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: fd is a fresh descriptor returned to us.
    (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

/// Without a pidfd, how often the loop looks whether the program ended.
const NO_PIDFD_POLL: Duration = Duration::from_millis(20);

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

/// The Python interpreter for bare scripts: `TORCHMEM_PYTHON` (set by the wheel's entry point to the
/// interpreter that runs torchmem), else `python3` from PATH.
fn python_interpreter() -> String {
    std::env::var("TORCHMEM_PYTHON").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "python3".into())
}

fn executable(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(p.as_os_str())) else {
        return false;
    };
    // SAFETY: access on a NUL-terminated path we own.
    p.is_file() && unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0
}

/// The file to execute for `program`: a path as given, else the first executable match on PATH. Each way
/// it can fail gets its own message.
fn find_program(program: &str) -> anyhow::Result<PathBuf> {
    if program.contains('/') {
        let p = PathBuf::from(program);
        if p.is_dir() {
            bail!("cannot start `{program}`: it is a directory (a directory runs only when it has a __main__.py)");
        }
        if !p.exists() {
            bail!("cannot start `{program}`: no such file. Check the path");
        }
        if !executable(&p) {
            bail!(
                "cannot start `{program}`: it is not executable. Make it so (`chmod +x {program}`), or name its interpreter (`torchmem run -- sh {program}`)"
            );
        }
        return Ok(p);
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join(program)).find(|p| executable(p)))
        .ok_or_else(|| anyhow!("cannot start `{program}`: no such program on PATH. Check the command, or give a path"))
}

/// Works out what to execute: `-m MODULE` and a bare `*.py`, `*.pyz` or a directory with `__main__.py` run
/// under the current Python; anything else runs as given.
pub fn resolve_command(module: Option<&str>, command: &[String]) -> anyhow::Result<Vec<String>> {
    if let Some(m) = module {
        let mut argv = vec![python_interpreter(), "-m".into(), m.to_string()];
        argv.extend(command.iter().cloned());
        return Ok(argv);
    }
    let first = &command[0];
    let path = Path::new(first);
    let cwd = || std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default();
    let python = |argv0: &str| {
        let mut argv = vec![python_interpreter(), argv0.to_string()];
        argv.extend(command[1..].iter().cloned());
        argv
    };
    if path.is_dir() {
        if path.join("__main__.py").is_file() {
            return Ok(python(first));
        }
        // A bare name (no `/`) is a program on PATH, as exec finds it: `-- python train.py` run from a
        // checkout with a `python/` folder runs Python, not the folder.
        if !first.contains('/') && find_program(first).is_ok() {
            return Ok(command.to_vec());
        }
        bail!(
            "{first} is a directory, not a program or a script (a directory runs only when it has a __main__.py; resolved from {})",
            cwd()
        );
    }
    if first.ends_with(".py") || first.ends_with(".pyz") {
        if !path.is_file() {
            bail!("script not found: {first}. Check the path (it is resolved from the current directory {})", cwd());
        }
        return Ok(python(first));
    }
    Ok(command.to_vec())
}

/// The program's name for the default profile name: the module, the script, or the command.
fn program_name(module: Option<&str>, command: &[String]) -> String {
    if let Some(m) = module {
        return m.replace('.', "_");
    }
    let program = command.iter().find(|a| a.ends_with(".py")).unwrap_or(&command[0]);
    let p = Path::new(program);
    if p.is_dir() {
        // `torchmem run -- ./pkgdir`: the directory's name.
        return std::fs::canonicalize(p)
            .ok()
            .and_then(|c| c.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "run".into());
    }
    program.clone()
}

const SITECUSTOMIZE: &str = include_str!("sitecustomize.py");

/// The directory for torchmem's private files: `TMPDIR` when it is an existing directory, else /tmp (with
/// a warning: a missing `TMPDIR` is never created).
fn temp_base() -> PathBuf {
    match std::env::var_os("TMPDIR").filter(|t| !t.is_empty()) {
        None => PathBuf::from("/tmp"),
        Some(t) if Path::new(&t).is_dir() => PathBuf::from(t),
        Some(t) => {
            eprintln!(
                "torchmem: warning: TMPDIR={} is not an existing directory; using /tmp for torchmem's files",
                Path::new(&t).display()
            );
            PathBuf::from("/tmp")
        }
    }
}

/// Removes `torchmem-inject-*` and `torchmem-events-*` directories of runs that were killed (SIGKILL gives
/// no chance to clean up): only ours (same uid), only when the owner pid in the name is gone, and for
/// inject directories only when no live run holds its lock.
fn sweep_dead_runs(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else { return };
    // SAFETY: geteuid is always safe.
    let uid = unsafe { libc::geteuid() };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("torchmem-inject-").or_else(|| name.strip_prefix("torchmem-events-")) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()).filter(|p| *p > 0) else {
            continue;
        };
        let path = e.path();
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() && m.uid() == uid => {}
            _ => continue,
        }
        // SAFETY: signal 0 only checks whether the pid exists.
        let alive =
            unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if alive {
            continue;
        }
        let Ok(dir) = std::fs::File::open(&path) else { continue };
        // SAFETY: flock on a directory descriptor we own.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// A private folder holding our `sitecustomize.py`, locked for the run (so a later run's sweep knows it is
/// live) and removed when dropped (on every way out of `run`; a SIGKILLed run's is swept by the next).
struct InjectDir {
    path: PathBuf,
    _lock: std::fs::File,
}

impl InjectDir {
    fn create(base: &Path) -> anyhow::Result<Self> {
        let dir = base.join(format!("torchmem-inject-{}-{}", std::process::id(), torchmem_core::clock::monotonic_ns()));
        std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(|e| {
            anyhow!("cannot create torchmem's directory {}: {e}. Set TMPDIR to a writable directory", dir.display())
        })?;
        let made = std::fs::write(dir.join("sitecustomize.py"), SITECUSTOMIZE).and_then(|_| std::fs::File::open(&dir));
        match made {
            Ok(lock) => {
                // SAFETY: flock on a directory descriptor we own (released when it closes).
                unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
                Ok(InjectDir { path: dir, _lock: lock })
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                bail!("cannot write torchmem's sitecustomize.py into {}: {e}", dir.display())
            }
        }
    }
}

impl Drop for InjectDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

pub fn run(args: RunArgs) -> anyhow::Result<i32> {
    let plan = plan(&args)?;
    let mut session = launch(&args, plan)?;
    let (reaped, exit_abs_ns) = record_until_exit(&mut session)?;
    finish(session, reaped, exit_abs_ns, args.quiet)
}

/// What `run` checked before creating anything: the program, the intervals, where the profile goes.
struct Plan {
    interval_ms: f64,
    pss_interval_ms: f64,
    argv: Vec<String>,
    program: PathBuf,
    place: Option<torchmem_core::model::JobPlace>,
    hostname: String,
    output: PathBuf,
    existing: Existing,
}

/// Checks everything about the command line and the output before anything is created or removed.
fn plan(args: &RunArgs) -> anyhow::Result<Plan> {
    let (interval_ms, pss_interval_ms) = checked_intervals(args.interval_ms, args.pss_interval_ms)?;
    let module = args.module.as_deref();
    let argv = resolve_command(module, &args.command)?;
    let program = find_program(&argv[0])?;
    // This recorder's own place in a distributed launch (it runs as a rank, or on a numbered node).
    let place = torchmem_core::model::JobPlace::from_vars(&|n| std::env::var(n).ok());
    let hostname =
        std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
    // Everything about the output is checked before anything is created or removed.
    let (output, existing) = match &args.output {
        Some(o) if output_path::names_a_directory(o) => {
            (output_path::dir_output(o, &hostname, place.as_ref())?, Existing::Nothing)
        }
        Some(o) => (o.clone(), output_path::check_profile_output(o, args.force)?),
        None => {
            let default = output_path::default_output(&program_name(module, &args.command));
            output_path::check_default_output_dir(&default)?;
            (default, Existing::Nothing)
        }
    };
    Ok(Plan { interval_ms, pss_interval_ms, argv, program, place, hostname, output, existing })
}

/// A started run: the program under supervision, the recorder and its sinks, the terminal outputs.
struct Session {
    signals: Supervisor,
    oom: OomWatch,
    inject: Option<InjectDir>,
    child: std::process::Child,
    pidfd: Option<std::os::fd::OwnedFd>,
    rec: Recorder,
    live: Option<LiveHandle>,
    bar: Option<StatusBar>,
    panel: Option<InlinePanel>,
    interval: Duration,
    output: PathBuf,
}

/// The launch step: signal supervision (its sentinel forks first), the OOM watch, the live outputs, the
/// profile, the event socket, the injected `sitecustomize`, then the program itself. Every failure before
/// the program starts leaves nothing behind.
fn launch(args: &RunArgs, plan: Plan) -> anyhow::Result<Session> {
    let Plan { interval_ms, pss_interval_ms, argv, program, place, hostname, output, existing } = plan;
    let module = args.module.as_deref();
    // Before any thread starts (NVML, the event listener) and before any file is open: the sentinel
    // process forks here and must hold none of them.
    let mut signals = Supervisor::install().map_err(|e| anyhow!("cannot set up signal handling: {e}"))?;
    let oom = OomWatch::start();
    let base = temp_base();
    sweep_dead_runs(&base);

    let gpu: Option<Box<dyn GpuSource>> =
        if args.no_gpu { None } else { NvmlSource::open().ok().map(|s| Box::new(s) as Box<dyn GpuSource>) };
    let host = torchmem_core::sources::host::host_memory();
    let mut command = args.command.clone();
    if let Some(m) = module {
        command.splice(0..0, ["-m".to_string(), m.to_string()]);
    }
    let meta = RunMeta {
        command,
        started_unix_s: torchmem_core::clock::unix_time_s(),
        interval_ms,
        torchmem_version: env!("CARGO_PKG_VERSION").into(),
        hostname,
        gpu_total_bytes: gpu.as_ref().map(|g| g.devices().iter().map(|d| d.total_bytes).collect()).unwrap_or_default(),
        gpu_names: gpu.as_ref().map(|g| g.devices().iter().map(|d| d.name.clone()).collect()).unwrap_or_default(),
        host_total_bytes: host.map(|h| h.total_bytes),
        keep_spans: Some(args.keep_spans),
        launch: place,
        ..RunMeta::default()
    };
    // Live outputs (a metrics port, event files) are opened here, after the sentinel's fork and before
    // the profile, so a taken port or an unwritable directory stops the run with nothing left behind.
    let sink_context = RunContext {
        devices: gpu.as_ref().map(|g| g.devices().to_vec()).unwrap_or_default(),
        hostname: meta.hostname.clone(),
        command: meta.command.clone(),
        started_unix_s: meta.started_unix_s,
        launch: place,
    };
    // The run's one live state: the recorder folds each batch into it once; the state file, the metrics,
    // the --live panel and the status line all render it.
    let live_state = LiveHandle::for_run(&sink_context);
    let mut live_sinks = args.sinks.config().build(&sink_context, &live_state)?;
    let gpu_note = match (&gpu, args.no_gpu) {
        (Some(_), _) => None,
        (None, true) => Some("not read (--no-gpu)".to_string()),
        (None, false) => Some(NO_NVML.to_string()),
    };
    let start_ns = torchmem_core::clock::monotonic_ns();
    let meta = RunMeta { start_monotonic_ns: Some(start_ns), ..meta };
    let created = match existing {
        Existing::Nothing => ProfileWriter::create(&output, &meta),
        Existing::Empty | Existing::Profile => ProfileWriter::create_replacing(&output, &meta),
    };
    let writer = created.map_err(|e| {
        anyhow!(
            "cannot create the profile {}: {e}. Choose another path with -o (e.g. -o \"$TMPDIR/run.sqlite\" or -o ~/run.sqlite)",
            output_path::shell_quoted(&output)
        )
    })?;

    let (events, inject) = match EventListener::bind().and_then(|ev| {
        let inject = if args.no_inject { None } else { Some(InjectDir::create(&base)?) };
        Ok((ev, inject))
    }) {
        Ok(x) => x,
        Err(e) => {
            writer.discard();
            return Err(e);
        }
    };
    let mut cmd = Command::new(&program);
    cmd.arg0(&argv[0]).args(&argv[1..]);
    cmd.env("TORCHMEM_EVENT_SOCKET", events.path()).env("TORCHMEM_INTERVAL_MS", interval_ms.to_string());
    if let Some(dir) = &inject {
        let mut path = OsString::from(&dir.path);
        if let Some(old) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
            path.push(":");
            path.push(old);
        }
        cmd.env("PYTHONPATH", path);
    }
    if !args.line.is_empty() {
        cmd.env("TORCHMEM_LINE", serde_json::to_string(&args.line)?);
    }
    // SAFETY: the hook makes only async-signal-safe calls (see `Supervisor::child_setup`).
    unsafe { cmd.pre_exec(signals.child_setup()) };
    signals.about_to_spawn();
    // The program's orphans (a child it leaves running, a worker whose parent died) come to us instead of
    // init, so the tree keeps them: recorded, and listed as having outlived the program.
    // SAFETY: prctl with plain integer arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            // SAFETY: as above.
            unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) };
            writer.discard();
            bail!("cannot start `{}`: {e}. Check that it is an executable program", argv[0]);
        }
    };
    let child_pid = child.id() as libc::pid_t;
    let pidfd = program_pidfd(child_pid);
    let config = Config { interval_ms, pss_interval_ms, keep_spans: args.keep_spans, ..Config::default() };
    // Registered for `torchmem top` (and the state `--live` draws) as soon as the program runs, unless
    // TORCHMEM_LIVE=0.
    let register = torchmem_recorder::sinks::live::registration_enabled();
    live_state.set_program(child.id(), &output);
    live_state.set_gpu_note(gpu_note);
    if register {
        live_sinks.push(Box::new(LiveSink::start(&live_state, &torchmem_recorder::sinks::live::live_dir())));
    }
    let live = (register || args.live || args.status).then(|| live_state.clone());
    // Folded only when something renders it.
    let fold = (live.is_some() || !live_sinks.is_empty()).then_some(live_state);
    let mut rec = Recorder::new(config, Sinks::new(writer, live_sinks, fold), gpu, child.id(), start_ns, Some(events));
    rec.set_not_the_programs(signals.sentinel_pid());
    let bar = if args.status { StatusBar::start() } else { None };
    let panel = if args.live {
        match inline::unavailable(INLINE_HEIGHT) {
            Some(why) => {
                eprintln!("torchmem: --live is off: {why} (`torchmem top` shows this run)");
                None
            }
            None => InlinePanel::start(INLINE_HEIGHT),
        }
    } else {
        None
    };
    let interval = Duration::from_secs_f64(interval_ms / 1000.0);
    Ok(Session { signals, oom, inject, child, pidfd, rec, live, bar, panel, interval, output })
}

/// The session loop: a sample every interval, signals forwarded (or acted on: a terminal stop, a resize),
/// the status line or panel redrawn, until the program ends (its pidfd wakes the wait). Returns how it
/// ended and when.
fn record_until_exit(s: &mut Session) -> anyhow::Result<(torchmem_recorder::recorder::Reaped, u64)> {
    let Session { signals, child, pidfd, rec, live, bar, panel, interval, output, .. } = s;
    let child_pid = child.id() as libc::pid_t;
    let interval = *interval;
    let mut last_status: Option<Instant> = None;
    let mut next = Instant::now();
    let reaped = loop {
        // A signal or the program's end ends the wait early; samples still come at the interval.
        if Instant::now() >= next {
            if let Err(e) = rec.tick() {
                // Said once: the profile sink stops writing after its first failure.
                say_write_failure(output, &e);
            }
            next += interval;
            let now = Instant::now();
            if next < now {
                next = now;
            }
        }
        for d in signals.decide() {
            if d.forward {
                // SAFETY: signalling our own child (not reaped yet: try_wait below has not seen it end).
                unsafe { libc::kill(child_pid, d.signo) };
            }
            if d.signo == libc::SIGTSTP {
                if let Some(b) = bar.as_mut() {
                    b.end();
                }
                if let Some(p) = panel.as_mut() {
                    p.end();
                }
                signals.stop_self();
                if let Some(b) = bar.as_mut() {
                    b.resume(true);
                }
                if let Some(p) = panel.as_mut() {
                    p.resume(true);
                }
            } else if d.signo == libc::SIGWINCH {
                if let Some(b) = bar.as_mut() {
                    b.resume(false);
                }
                if let Some(p) = panel.as_mut() {
                    p.resume(false);
                }
            }
        }
        if let Some(reaped) = torchmem_recorder::recorder::try_reap(child.id())? {
            break reaped;
        }
        if let Some(b) = bar.as_mut() {
            if last_status.is_none_or(|t| t.elapsed() >= Duration::from_millis(250)) {
                if let Some(live) = live.as_ref() {
                    b.draw(&status_line(&live.snapshot()));
                }
                last_status = Some(Instant::now());
            }
        }
        if let (Some(p), Some(live)) = (panel.as_mut(), live.as_ref()) {
            if last_status.is_none_or(|t| t.elapsed() >= Duration::from_millis(250)) {
                p.draw(&live.snapshot());
                last_status = Some(Instant::now());
            }
        }
        let mut timeout = next.saturating_duration_since(Instant::now());
        if pidfd.is_none() {
            timeout = timeout.min(NO_PIDFD_POLL);
        }
        signals.wait(timeout, pidfd.as_ref().map(|f| f.as_raw_fd()));
    };
    Ok((reaped, torchmem_core::clock::monotonic_ns()))
}

/// The end: the last samples and messages, how the program ended (exit code, signal, the kernel's OOM
/// killer), the profile finished, the summary. Returns the program's exit code whatever became of the
/// profile.
fn finish(
    s: Session,
    reaped: torchmem_recorder::recorder::Reaped,
    exit_abs_ns: u64,
    quiet: bool,
) -> anyhow::Result<i32> {
    let Session { signals, mut oom, inject, child, pidfd, mut rec, bar, panel, output, .. } = s;
    drop(pidfd);
    drop(bar);
    drop(panel);
    if let Err(e) = rec.program_ended(exit_abs_ns, reaped) {
        say_write_failure(&output, &e);
    }
    rec.drain_until_closed(Duration::from_millis(500));
    let status = std::process::ExitStatus::from_raw(reaped.status);
    let signal = status.signal();
    let exit_code = status.code().or_else(|| signal.map(|s| 128 + s)).unwrap_or(1);
    let finding = oom.finish(child.id());
    let bad = rec.bad_messages;
    let oom_note = finding.describe(signal);
    let failure_so_far = rec.write_failure().cloned();
    let finished = rec.finish(|m| {
        m.exit_code = Some(exit_code);
        m.signal = signal;
        m.oom = Some(finding);
    });
    drop(inject);
    drop(signals);
    // SAFETY: prctl with plain integer arguments. Orphans still running go on to init from here.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) };
    let quoted = output_path::shell_quoted(&output);
    // The program's exit code whatever became of the profile (a full disk is not the program's failure).
    let profile = match finished {
        Ok(p) => p,
        Err(e) => {
            let lost = failure_so_far.map(|f| format!(" ({})", f.describe())).unwrap_or_default();
            eprintln!(
                "torchmem: warning: could not finish the profile {quoted}: {e}{lost}. It keeps what was written; `torchmem report` shows it as unfinished"
            );
            return Ok(exit_code);
        }
    };
    if let Some(f) = &profile.meta.write_failure {
        eprintln!("torchmem: warning: the profile is incomplete: {}", f.describe());
    }
    if bad > 0 {
        eprintln!("torchmem: warning: {bad} malformed messages from the program were ignored");
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
    Ok(exit_code)
}

/// Said once, at the first failure: the profile sink stops writing after it.
fn say_write_failure(output: &Path, e: &torchmem_core::CoreError) {
    let why = if torchmem_core::store::is_disk_full(e) { "the disk is full".to_string() } else { e.to_string() };
    eprintln!(
        "torchmem: warning: cannot write the profile {} any more ({why}). The program runs on; what was written is kept, and the end says how many samples were lost",
        output_path::shell_quoted(output)
    );
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
