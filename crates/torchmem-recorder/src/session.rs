//! A recording session, the engine of `torchmem run` below its arguments: [`Session::start`] (signal
//! supervision, the OOM watch, the live outputs, the profile, the event socket, the injected
//! `sitecustomize`, then the program, started by `launch`), [`Session::record_until_exit`] (the loop: a
//! sample every interval, signals forwarded or acted on, an [`Overlay`] redrawn from the run's one live
//! state, until the program ends) and [`Session::finish`] (the last samples, how the program ended, the
//! profile finished), which returns a [`RunEnd`] for the front end to print.
//!
//! As a supervisor it is never worse than running the program bare: signals are passed on exactly once and
//! ignored ones stay ignored (`signals`); a failed start leaves no file behind (the caller has checked the
//! output path with `output_path` before); the program's orphans stay in the recorded tree (the session is
//! their subreaper until the end); a program killed by a signal is named, with the OOM killer's part
//! (`oom_watch`).

use std::os::fd::AsRawFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use torchmem_core::model::{JobPlace, Profile, RunMeta};
use torchmem_core::sources::gpu::{GpuSource, NvmlSource};
use torchmem_core::store::ProfileWriter;

use crate::launch::{self, PrivateDir, Program};
use crate::live_state::{LiveHandle, LiveSnapshot};
use crate::oom_watch::OomWatch;
use crate::output_path::{self, Existing};
use crate::recorder::{Config, EventListener, Reaped, Recorder};
use crate::signals::Supervisor;
use crate::sinks::live::LiveSink;
use crate::sinks::{RunContext, SinkConfig, Sinks};

/// The `sitecustomize.py` a recorded Python program gets: `torchmem._bootstrap` (the allocator sampler and
/// the API's events to the recorder's socket), then the environment's own sitecustomize.
const RUN_SITECUSTOMIZE: &str = include_str!("sitecustomize_run.py");

/// Without a pidfd, how often the loop looks whether the program ended.
const NO_PIDFD_POLL: Duration = Duration::from_millis(20);

/// How often an overlay is redrawn.
const OVERLAY_EVERY: Duration = Duration::from_millis(250);

/// What a session records and how, all checked by the caller before anything is created.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// The command as the user gave it (`-m MODULE` first for a module), for the profile's metadata.
    pub command: Vec<String>,
    pub interval_ms: f64,
    pub pss_interval_ms: f64,
    pub keep_spans: u64,
    /// The profile's path, and what is there now (`output_path`'s verdict).
    pub output: PathBuf,
    pub existing: Existing,
    /// This recorder's own place in a distributed launch, and the host's name.
    pub place: Option<JobPlace>,
    pub hostname: String,
    /// Read NVML (false: `--no-gpu`).
    pub gpu: bool,
    /// Load torchmem into the program's Python (false: `--no-inject`).
    pub inject: bool,
    /// The line profiler's targets (`--line`), passed as `TORCHMEM_LINE`.
    pub line: Vec<String>,
    pub sinks: SinkConfig,
    /// A terminal overlay will render the live state (`--live`, `--status`): fold it even when nothing else
    /// does.
    pub overlay: bool,
    /// The live state's note when NVML cannot be opened.
    pub no_nvml_note: String,
}

/// A terminal view of the run redrawn by the loop (the status line, the `--live` panel).
pub trait Overlay {
    /// Draws the latest readings.
    fn draw(&mut self, now: &LiveSnapshot);
    /// Gives the terminal back before torchmem stops itself (Ctrl-Z).
    fn suspend(&mut self);
    /// Takes it again: after a stop (`after_stop`) or a resize.
    fn resume(&mut self, after_stop: bool);
}

/// How the program ended, when (monotonic ns), as the loop saw it.
#[derive(Debug, Clone, Copy)]
pub struct Ended {
    pub reaped: Reaped,
    pub exit_abs_ns: u64,
}

/// The end of a run, for the front end to say.
pub struct RunEnd {
    /// The program's exit code (128 + the signal that killed it), whatever became of the profile.
    pub exit_code: i32,
    pub signal: Option<i32>,
    /// The OOM killer's part, in one sentence, when it had one.
    pub oom_note: Option<String>,
    /// Lines from the program that were not messages.
    pub bad_messages: u64,
    /// The finished profile, or why it could not be finished (with what had been lost before, if anything).
    pub profile: Result<Profile, String>,
    pub output: PathBuf,
}

/// A started run: the program under supervision, the recorder and its sinks.
pub struct Session {
    signals: Supervisor,
    oom: OomWatch,
    inject: Option<PrivateDir>,
    child: std::process::Child,
    pidfd: Option<std::os::fd::OwnedFd>,
    rec: Recorder,
    live: Option<LiveHandle>,
    interval: Duration,
    output: PathBuf,
}

/// Makes this process the subreaper of the program's orphans (a child it leaves running, a worker whose
/// parent died), so the recorded tree keeps them; off again at the end (orphans still running go to init).
fn subreaper(on: bool) {
    // SAFETY: prctl with plain integer arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, libc::c_ulong::from(on), 0, 0, 0) };
}

impl Session {
    /// The launch step: signal supervision (its sentinel forks first), the OOM watch, the live outputs, the
    /// profile, the event socket, the injected `sitecustomize`, then the program itself. Every failure before
    /// the program starts leaves nothing behind.
    pub fn start(cfg: SessionConfig, program: &Program) -> anyhow::Result<Session> {
        // Before any thread starts (NVML, the event listener) and before any file is open: the sentinel
        // process forks here and must hold none of them.
        let mut signals = Supervisor::install().map_err(|e| anyhow!("cannot set up signal handling: {e}"))?;
        let oom = OomWatch::start();
        let base = launch::temp_base();
        launch::sweep_dead_runs(&base);

        let gpu: Option<Box<dyn GpuSource>> =
            if cfg.gpu { NvmlSource::open().ok().map(|s| Box::new(s) as Box<dyn GpuSource>) } else { None };
        let host = torchmem_core::sources::host::host_memory();
        let meta = RunMeta {
            command: cfg.command.clone(),
            started_unix_s: torchmem_core::clock::unix_time_s(),
            interval_ms: cfg.interval_ms,
            torchmem_version: env!("CARGO_PKG_VERSION").into(),
            hostname: cfg.hostname.clone(),
            gpu_total_bytes: gpu
                .as_ref()
                .map(|g| g.devices().iter().map(|d| d.total_bytes).collect())
                .unwrap_or_default(),
            gpu_names: gpu.as_ref().map(|g| g.devices().iter().map(|d| d.name.clone()).collect()).unwrap_or_default(),
            host_total_bytes: host.map(|h| h.total_bytes),
            keep_spans: Some(cfg.keep_spans),
            launch: cfg.place,
            ..RunMeta::default()
        };
        // Live outputs (a metrics port, event files) are opened here, after the sentinel's fork and before
        // the profile, so a taken port or an unwritable directory stops the run with nothing left behind.
        let sink_context = RunContext {
            devices: gpu.as_ref().map(|g| g.devices().to_vec()).unwrap_or_default(),
            hostname: meta.hostname.clone(),
            command: meta.command.clone(),
            started_unix_s: meta.started_unix_s,
            launch: cfg.place,
        };
        // The run's one live state: the recorder folds each batch into it once; the state file, the metrics,
        // the --live panel and the status line all render it.
        let live_state = LiveHandle::for_run(&sink_context);
        let mut live_sinks = cfg.sinks.build(&sink_context, &live_state)?;
        let gpu_note = match (&gpu, cfg.gpu) {
            (Some(_), _) => None,
            (None, false) => Some("not read (--no-gpu)".to_string()),
            (None, true) => Some(cfg.no_nvml_note.clone()),
        };
        let start_ns = torchmem_core::clock::monotonic_ns();
        let meta = RunMeta { start_monotonic_ns: Some(start_ns), ..meta };
        let output = cfg.output;
        let created = match cfg.existing {
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
            let inject = if cfg.inject {
                Some(PrivateDir::create(&base, "inject", &launch::sitecustomize(RUN_SITECUSTOMIZE))?)
            } else {
                None
            };
            Ok((ev, inject))
        }) {
            Ok(x) => x,
            Err(e) => {
                writer.discard();
                return Err(e);
            }
        };
        let mut cmd = program.command();
        cmd.env("TORCHMEM_EVENT_SOCKET", events.path()).env("TORCHMEM_INTERVAL_MS", cfg.interval_ms.to_string());
        if let Some(dir) = &inject {
            dir.inject_into(&mut cmd);
        }
        if !cfg.line.is_empty() {
            cmd.env("TORCHMEM_LINE", serde_json::to_string(&cfg.line)?);
        }
        // SAFETY: the hook makes only async-signal-safe calls (see `Supervisor::child_setup`).
        unsafe { cmd.pre_exec(signals.child_setup()) };
        signals.about_to_spawn();
        subreaper(true);
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                subreaper(false);
                writer.discard();
                anyhow::bail!("cannot start `{}`: {e}. Check that it is an executable program", program.argv[0]);
            }
        };
        let pidfd = launch::program_pidfd(child.id() as libc::pid_t);
        let config = Config {
            interval_ms: cfg.interval_ms,
            pss_interval_ms: cfg.pss_interval_ms,
            keep_spans: cfg.keep_spans,
            ..Config::default()
        };
        // Registered for `torchmem top` (and the state an overlay draws) as soon as the program runs, unless
        // TORCHMEM_LIVE=0.
        let register = crate::sinks::live::registration_enabled();
        live_state.set_program(child.id(), &output);
        live_state.set_gpu_note(gpu_note);
        if register {
            live_sinks.push(Box::new(LiveSink::start(&live_state, &crate::sinks::live::live_dir())));
        }
        let live = (register || cfg.overlay).then(|| live_state.clone());
        // Folded only when something renders it.
        let fold = (live.is_some() || !live_sinks.is_empty()).then_some(live_state);
        let mut rec =
            Recorder::new(config, Sinks::new(writer, live_sinks, fold), gpu, child.id(), start_ns, Some(events));
        rec.set_not_the_programs(signals.sentinel_pid());
        let interval = Duration::from_secs_f64(cfg.interval_ms / 1000.0);
        Ok(Session { signals, oom, inject, child, pidfd, rec, live, interval, output })
    }

    /// The program's pid.
    pub fn program_pid(&self) -> u32 {
        self.child.id()
    }

    /// The session loop: a sample every interval, signals forwarded (or acted on: a terminal stop, a
    /// resize), the overlay redrawn, until the program ends (its pidfd wakes the wait).
    pub fn record_until_exit(&mut self, mut overlay: Option<&mut dyn Overlay>) -> anyhow::Result<Ended> {
        let child_pid = self.child.id() as libc::pid_t;
        let interval = self.interval;
        let mut last_drawn: Option<Instant> = None;
        let mut next = Instant::now();
        let reaped = loop {
            // A signal or the program's end ends the wait early; samples still come at the interval.
            if Instant::now() >= next {
                if let Err(e) = self.rec.tick() {
                    // Said once: the profile sink stops writing after its first failure.
                    say_write_failure(&self.output, &e);
                }
                next += interval;
                let now = Instant::now();
                if next < now {
                    next = now;
                }
            }
            for d in self.signals.decide() {
                if d.forward {
                    // SAFETY: signalling our own child (not reaped yet: try_reap below has not seen it end).
                    unsafe { libc::kill(child_pid, d.signo) };
                }
                if d.signo == libc::SIGTSTP {
                    if let Some(o) = overlay.as_deref_mut() {
                        o.suspend();
                    }
                    self.signals.stop_self();
                    if let Some(o) = overlay.as_deref_mut() {
                        o.resume(true);
                    }
                } else if d.signo == libc::SIGWINCH {
                    if let Some(o) = overlay.as_deref_mut() {
                        o.resume(false);
                    }
                }
            }
            if let Some(reaped) = crate::recorder::try_reap(self.child.id())? {
                break reaped;
            }
            if let (Some(o), Some(live)) = (overlay.as_deref_mut(), self.live.as_ref()) {
                if last_drawn.is_none_or(|t| t.elapsed() >= OVERLAY_EVERY) {
                    o.draw(&live.snapshot());
                    last_drawn = Some(Instant::now());
                }
            }
            let mut timeout = next.saturating_duration_since(Instant::now());
            if self.pidfd.is_none() {
                timeout = timeout.min(NO_PIDFD_POLL);
            }
            self.signals.wait(timeout, self.pidfd.as_ref().map(|f| f.as_raw_fd()));
        };
        Ok(Ended { reaped, exit_abs_ns: torchmem_core::clock::monotonic_ns() })
    }

    /// The end: the last samples and messages, how the program ended (exit code, signal, the kernel's OOM
    /// killer), the profile finished. The caller has dropped its overlay.
    pub fn finish(self, ended: Ended) -> RunEnd {
        let Session { signals, mut oom, inject, child, pidfd, mut rec, output, .. } = self;
        drop(pidfd);
        if let Err(e) = rec.program_ended(ended.exit_abs_ns, ended.reaped) {
            say_write_failure(&output, &e);
        }
        rec.drain_until_closed(Duration::from_millis(500));
        let status = std::process::ExitStatus::from_raw(ended.reaped.status);
        let signal = status.signal();
        let exit_code = launch::exit_code(status);
        let finding = oom.finish(child.id());
        let bad_messages = rec.bad_messages;
        let oom_note = finding.describe(signal);
        let failure_so_far = rec.write_failure().cloned();
        let finished = rec.finish(|m| {
            m.exit_code = Some(exit_code);
            m.signal = signal;
            m.oom = Some(finding);
        });
        drop(inject);
        drop(signals);
        subreaper(false);
        let profile = finished.map_err(|e| {
            let lost = failure_so_far.map(|f| format!(" ({})", f.describe())).unwrap_or_default();
            format!("{e}{lost}")
        });
        RunEnd { exit_code, signal, oom_note, bad_messages, profile, output }
    }
}

/// Said once, at the first failure: the profile sink stops writing after it.
fn say_write_failure(output: &Path, e: &torchmem_core::CoreError) {
    let why = if torchmem_core::store::is_disk_full(e) { "the disk is full".to_string() } else { e.to_string() };
    eprintln!(
        "torchmem: warning: cannot write the profile {} any more ({why}). The program runs on; what was written is kept, and the end says how many samples were lost",
        output_path::shell_quoted(output)
    );
}
