//! `torchmem run`: starts the program, records its memory into a profile until it exits, passes signals on,
//! returns the program's exit code, and prints a short summary.
//!
//! A Python program gets torchmem's in-process part with no change to its code: a `sitecustomize.py` placed
//! first on `PYTHONPATH` imports `torchmem._bootstrap`, which samples PyTorch's allocator and sends the
//! Python API's events through the pipe named by `TORCHMEM_EVENT_FD`.

use std::io::IsTerminal;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use torchmem_core::model::RunMeta;
use torchmem_core::sources::gpu::{GpuSource, NvmlSource};
use torchmem_core::store::{Profile, ProfileWriter};
use torchmem_core::units::format_bytes;

use crate::recorder::{spawn_pipe_reader, Config, Recorder};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Profile file to write [default: torchmem-<program>-<date>-<time>.sqlite in the current directory].
    #[arg(short = 'o', long = "output", value_name = "PROFILE")]
    pub output: Option<PathBuf>,
    /// CPU RSS and GPU sampling interval in milliseconds.
    #[arg(long = "interval", value_name = "MS", default_value_t = 10.0)]
    pub interval_ms: f64,
    /// PSS/USS (smaps_rollup) interval in milliseconds; slower because it is costlier.
    #[arg(long = "pss-interval", value_name = "MS", default_value_t = 250.0)]
    pub pss_interval_ms: f64,
    /// Line-by-line profile: `--line` profiles functions decorated with @profile; `--line=FILE_OR_MODULE:FUNCTION`
    /// (repeatable) picks functions by name.
    #[arg(long = "line", num_args = 0..=1, require_equals = true, default_missing_value = "", action = clap::ArgAction::Append, value_name = "FILE_OR_MODULE:FUNCTION")]
    pub line: Vec<String>,
    /// Do not read NVML even when a GPU is present.
    #[arg(long)]
    pub no_gpu: bool,
    /// Do not load torchmem inside the profiled Python process (no allocator timeline, no API events).
    #[arg(long)]
    pub no_inject: bool,
    /// No live status line and no summary at the end.
    #[arg(short, long)]
    pub quiet: bool,
    /// The program: `script.py [ARGS…]` runs under the current Python; anything else runs as given.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

static PENDING_SIGNAL: AtomicI32 = AtomicI32::new(0);
static PENDING_FROM_TTY: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let code = unsafe { (*info).si_code };
    PENDING_FROM_TTY.store((code == libc::SI_KERNEL) as i32, Ordering::SeqCst);
    PENDING_SIGNAL.store(sig, Ordering::SeqCst);
}

fn install_signal_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction with our async-signal-safe handler (it only stores atomics).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

/// The Python interpreter for bare scripts: `TORCHMEM_PYTHON` (set by the wheel's entry point to the
/// interpreter that runs torchmem), else `python3` from PATH.
fn python_interpreter() -> String {
    std::env::var("TORCHMEM_PYTHON").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "python3".into())
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    if program.contains('/') {
        let p = PathBuf::from(program);
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH")
        .and_then(|paths| std::env::split_paths(&paths).map(|d| d.join(program)).find(|p| p.is_file()))
}

/// Works out what to execute: a bare `*.py` runs under the current Python.
pub fn resolve_command(command: &[String]) -> anyhow::Result<Vec<String>> {
    let first = &command[0];
    if first.ends_with(".py") {
        if !Path::new(first).is_file() {
            bail!(
                "script not found: {first}. Check the path (it is resolved from the current directory {})",
                std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default()
            );
        }
        let mut argv = vec![python_interpreter()];
        argv.extend(command.iter().cloned());
        return Ok(argv);
    }
    Ok(command.to_vec())
}

fn default_output(command: &[String]) -> PathBuf {
    let program = command.iter().find(|a| a.ends_with(".py")).unwrap_or(&command[0]);
    let stem = Path::new(program)
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("run")
        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-' && c != '_', "_");
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    // SAFETY: localtime_r fills the tm we own.
    unsafe { libc::localtime_r(&now, &mut tm) };
    PathBuf::from(format!(
        "torchmem-{stem}-{:04}{:02}{:02}-{:02}{:02}{:02}.sqlite",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    ))
}

const SITECUSTOMIZE: &str = include_str!("sitecustomize.py");

/// A private folder holding our `sitecustomize.py`, removed when dropped.
struct InjectDir(PathBuf);

impl InjectDir {
    fn create() -> anyhow::Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "torchmem-inject-{}-{}",
            std::process::id(),
            torchmem_core::clock::monotonic_ns()
        ));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::write(dir.join("sitecustomize.py"), SITECUSTOMIZE)?;
        Ok(InjectDir(dir))
    }
}

impl Drop for InjectDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A pipe whose write end the child inherits (no CLOEXEC) and whose read end stays with us.
fn event_pipe() -> anyhow::Result<(OwnedFd, RawFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        bail!("cannot create the event pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: clearing FD_CLOEXEC on the write end we own so the child inherits it.
    unsafe { libc::fcntl(fds[1], libc::F_SETFD, 0) };
    // SAFETY: fds[0] is a fresh fd we own.
    Ok((unsafe { OwnedFd::from_raw_fd(fds[0]) }, fds[1]))
}

pub fn run(args: RunArgs) -> anyhow::Result<i32> {
    let interval_ok = args.interval_ms.is_finite() && args.interval_ms >= 0.1;
    if !interval_ok || args.pss_interval_ms.is_nan() || args.pss_interval_ms < args.interval_ms {
        bail!(
            "--interval must be at least 0.1 ms and --pss-interval at least --interval (got {} and {})",
            args.interval_ms,
            args.pss_interval_ms
        );
    }
    let argv = resolve_command(&args.command)?;
    let program = find_on_path(&argv[0]).with_context(|| {
        format!("cannot start `{}`: no such program on PATH. Check the command, or give a path", argv[0])
    })?;
    let output = args.output.clone().unwrap_or_else(|| default_output(&args.command));

    let gpu: Option<Box<dyn GpuSource>> =
        if args.no_gpu { None } else { NvmlSource::open().ok().map(|s| Box::new(s) as Box<dyn GpuSource>) };
    let host = torchmem_core::sources::host::host_memory();
    let meta = RunMeta {
        command: args.command.clone(),
        started_unix_s: torchmem_core::clock::unix_time_s(),
        interval_ms: args.interval_ms,
        torchmem_version: env!("CARGO_PKG_VERSION").into(),
        hostname: std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_default(),
        exit_code: None,
        duration_ns: None,
        gpu_total_bytes: gpu.as_ref().map(|g| g.devices().iter().map(|d| d.total_bytes).collect()).unwrap_or_default(),
        gpu_names: gpu.as_ref().map(|g| g.devices().iter().map(|d| d.name.clone()).collect()).unwrap_or_default(),
        host_total_bytes: host.map(|h| h.total_bytes),
        start_monotonic_ns: None,
    };
    let start_ns = torchmem_core::clock::monotonic_ns();
    let meta = RunMeta { start_monotonic_ns: Some(start_ns), ..meta };
    let writer = ProfileWriter::create(&output, &meta)
        .with_context(|| format!("cannot create the profile {}", output.display()))?;

    let (read_end, write_fd) = event_pipe()?;
    let inject = if args.no_inject { None } else { Some(InjectDir::create()?) };
    let mut cmd = Command::new(&program);
    cmd.arg0(&argv[0]).args(&argv[1..]);
    cmd.env("TORCHMEM_EVENT_FD", write_fd.to_string()).env("TORCHMEM_INTERVAL_MS", args.interval_ms.to_string());
    if let Some(dir) = &inject {
        let mut path = dir.0.display().to_string();
        if let Some(old) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
            path = format!("{path}:{}", old.to_string_lossy());
        }
        cmd.env("PYTHONPATH", path);
    }
    if !args.line.is_empty() {
        cmd.env("TORCHMEM_LINE", serde_json::to_string(&args.line)?);
    }
    // SAFETY: prctl is async-signal-safe; if the recorder dies, the program gets SIGTERM instead of running on
    // unobserved.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    install_signal_handlers();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            // SAFETY: closing our copy of the write end.
            unsafe { libc::close(write_fd) };
            let _ = std::fs::remove_file(&output);
            bail!("cannot start `{}`: {e}. Check that it is an executable program", argv[0]);
        }
    };
    // SAFETY: the child has its copy; ours must go so the reader sees EOF when the program ends.
    unsafe { libc::close(write_fd) };
    let messages = spawn_pipe_reader(read_end);
    let config = Config { interval_ms: args.interval_ms, pss_interval_ms: args.pss_interval_ms, ..Config::default() };
    let interval = Duration::from_secs_f64(args.interval_ms / 1000.0);
    let mut rec = Recorder::new(config, writer, gpu, child.id(), start_ns, Some(messages));
    let live = !args.quiet && std::io::stderr().is_terminal();
    let mut last_status = Instant::now();
    let mut next = Instant::now();
    let status = loop {
        if let Err(e) = rec.tick() {
            eprintln!("torchmem: warning: could not write a sample: {e}");
        }
        let sig = PENDING_SIGNAL.swap(0, Ordering::SeqCst);
        if sig != 0 {
            let from_tty = PENDING_FROM_TTY.load(Ordering::SeqCst) == 1 && sig == libc::SIGINT;
            if !from_tty {
                // SAFETY: signalling our own child.
                unsafe { libc::kill(child.id() as libc::pid_t, sig) };
            }
        }
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if live && last_status.elapsed() >= Duration::from_millis(250) {
            eprint!("\r\x1b[2K{}", status_line(&rec, start_ns));
            last_status = Instant::now();
        }
        next += interval;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        } else {
            next = now;
        }
    };
    if live {
        eprint!("\r\x1b[2K");
    }
    rec.tick().ok();
    rec.drain_until_closed(Duration::from_millis(500));
    let exit_code = status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1);
    let bad = rec.bad_messages;
    rec.finish(Some(exit_code)).with_context(|| format!("finishing the profile {}", output.display()))?;
    if bad > 0 {
        eprintln!("torchmem: warning: {bad} malformed messages from the program were ignored");
    }
    if !args.quiet {
        match Profile::open(&output) {
            Ok(profile) => eprint!("{}", end_summary(&profile)),
            Err(e) => eprintln!("torchmem: warning: cannot read back the profile: {e}"),
        }
        eprintln!(
            "torchmem: profile written to {} (see `torchmem report {0}` and `torchmem plot {0}`)",
            output.display()
        );
    }
    Ok(exit_code)
}

fn status_line(rec: &Recorder, start_ns: u64) -> String {
    let l = &rec.latest;
    let secs = (torchmem_core::clock::monotonic_ns() - start_ns) as f64 / 1e9;
    let mut s =
        format!("[torchmem] {secs:6.1} s  RSS {} (peak {})", format_bytes(l.rss_bytes), format_bytes(l.peak_rss_bytes));
    if let (Some(a), Some(r)) = (l.allocated_bytes, l.reserved_bytes) {
        s.push_str(&format!("  GPU alloc {} reserved {}", format_bytes(a), format_bytes(r)));
    }
    if let Some(p) = l.peak_allocated_bytes {
        s.push_str(&format!(" (peak {})", format_bytes(p)));
    }
    if let Some(n) = l.gpu_process_bytes {
        s.push_str(&format!("  NVML {}", format_bytes(n)));
    }
    s
}

/// The end-of-run summary: peaks, then the per-phase and per-epoch tables and any growth warning.
pub fn end_summary(profile: &Profile) -> String {
    use torchmem_core::analysis::Summary;
    use torchmem_core::report::table;
    let s = Summary::from_profile(profile);
    let mut out = String::from("\n== torchmem summary ==\n");
    out.push_str(&format!(
        "duration {:.2} s, exit code {}, {} samples\n",
        s.duration_ns.unwrap_or(0) as f64 / 1e9,
        s.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
        s.samples
    ));
    out.push_str(&format!("peak CPU RSS {}", s.peak.cpu_rss_bytes.map(format_bytes).unwrap_or_else(|| "-".into())));
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
