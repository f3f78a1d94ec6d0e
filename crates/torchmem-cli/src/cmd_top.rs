//! `torchmem top`: a full-screen live view (ratatui + crossterm) of every program running under
//! `torchmem run` for this user, or of one profile: each GPU (NVML used/total and its processes), the
//! host's RAM, the processes with RSS/PSS, and for each run PyTorch's allocated/reserved, the phase, step
//! and epoch, with history sparklines and peaks. Runs are found through the state files their recorders
//! keep (`sinks::live`); the screen is drawn by `tui::view` from `tui::state::TopModel`.
//!
//! `torchmem top PROFILE` follows that profile's run while it is live, and shows a finished profile's last
//! state (rebuilt from its records, `torchmem_recorder::live_state::replay_profile`). On a dumb terminal (`TERM=dumb`) or when
//! stdout is not a terminal it prints a plain text table every interval instead; `--once` prints one and
//! exits. `q`, Esc, Ctrl-C or SIGTERM/SIGHUP end it with the terminal restored.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use torchmem_core::sources::gpu::{GpuSource, NvmlSource};

use crate::tui::state::{GpuDeviceNow, GpuPanel, Source, TopModel};
use crate::tui::view::{plain_top, render_top};
use torchmem_recorder::live_state::{replay_profile, LiveSnapshot};
use torchmem_recorder::sinks::live;

const KEYS_HELP: &str = "Keys: q, Esc or Ctrl-C quit; Up/Down (or k/j) select a process (its run's history is shown \
below the table); 1 PID, 2 RSS, 3 PSS, 4 GPU (NVML), 5 ALLOC, 6 RESERVED, 7 PEAK ALLOC sort by that column \
(the same key again reverses it); s moves to the next sort column; r reverses the order.

Runs are found in $TORCHMEM_LIVE_DIR, else $XDG_RUNTIME_DIR/torchmem, else /tmp/torchmem-<uid> (each \
`torchmem run` keeps <pid>.json there while it runs). Without a terminal (a pipe, TERM=dumb) a plain table \
is printed every interval.";

#[derive(Debug, clap::Args)]
#[command(after_help = KEYS_HELP)]
pub struct TopArgs {
    /// A profile to show instead of every run: followed while its `torchmem run` is live, else its last
    /// recorded state (a finished or killed run), with its history.
    #[arg(value_name = "PROFILE")]
    pub profile: Option<PathBuf>,
    /// Refresh interval in milliseconds.
    #[arg(long = "interval", value_name = "MS", default_value_t = 500)]
    pub interval_ms: u64,
    /// Print the plain text table once and exit.
    #[arg(long)]
    pub once: bool,
    /// Print plain text tables (every interval) even on a terminal.
    #[arg(long)]
    pub plain: bool,
}

/// SIGTERM, SIGHUP or SIGINT arrived: leave the loop and restore the terminal.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

fn catch_stop_signals() {
    for sig in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        unsafe { libc::signal(sig, on_stop_signal as *const () as libc::sighandler_t) };
    }
}

/// What `top` reads on each refresh.
struct Sources {
    source: Source,
    dirs: Vec<PathBuf>,
    /// A replayed profile's state (read once).
    replayed: Option<LiveSnapshot>,
    gpu: Result<NvmlSource, String>,
    hostname: String,
}

fn canonical(p: &Path) -> String {
    std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()).display().to_string()
}

fn replay(path: &Path) -> anyhow::Result<LiveSnapshot> {
    let profile = torchmem_core::model::Profile::open(path)
        .map_err(|e| anyhow::anyhow!("{}: cannot read it as a torchmem profile ({e})", path.display()))?;
    Ok(replay_profile(&profile))
}

impl Sources {
    fn new(profile: Option<&Path>) -> anyhow::Result<Sources> {
        let dirs = live::search_dirs();
        let (source, replayed) = match profile {
            None => (Source::All(dirs.iter().map(|d| d.display().to_string()).collect()), None),
            Some(p) => {
                crate::existing_file(p, "profile")?;
                if p.is_dir() {
                    bail!("{} is a directory; give one profile file (or no argument for every live run)", p.display());
                }
                let want = canonical(p);
                if live::scan(&dirs).iter().any(|r| r.profile.as_deref() == Some(want.as_str())) {
                    (Source::Follow(want), None)
                } else {
                    (Source::Replay(want), Some(replay(p)?))
                }
            }
        };
        let gpu = NvmlSource::open().map_err(|e| e.to_string());
        let hostname =
            std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default();
        Ok(Sources { source, dirs, replayed, gpu, hostname })
    }

    /// Reads everything again into `m` (keeping the viewer's choices).
    fn refresh(&mut self, m: &mut TopModel) {
        m.runs = match &self.source {
            Source::All(_) => live::scan(&self.dirs),
            Source::Follow(p) => {
                let p = p.clone();
                let runs: Vec<LiveSnapshot> =
                    live::scan(&self.dirs).into_iter().filter(|r| r.profile.as_deref() == Some(p.as_str())).collect();
                if runs.is_empty() {
                    // The run ended: show what it wrote.
                    if let Ok(s) = replay(Path::new(&p)) {
                        self.replayed = Some(s);
                        self.source = Source::Replay(p);
                    }
                }
                runs
            }
            Source::Replay(_) => Vec::new(),
        };
        if let Some(s) = &self.replayed {
            m.runs = vec![s.clone()];
        }
        m.source = self.source.clone();
        m.hostname = self.hostname.clone();
        m.host = torchmem_core::sources::host::host_memory();
        m.gpus = match &self.gpu {
            Err(e) => GpuPanel::NoNvml(e.clone()),
            Ok(nvml) => {
                let names: std::collections::BTreeMap<u32, String> =
                    nvml.devices().iter().map(|d| (d.index, d.name.clone())).collect();
                GpuPanel::Devices(
                    nvml.read()
                        .into_iter()
                        .map(|r| GpuDeviceNow {
                            index: r.index,
                            name: names.get(&r.index).cloned().unwrap_or_default(),
                            used_bytes: r.used_bytes,
                            total_bytes: r.total_bytes,
                            process_bytes: r.process_bytes,
                        })
                        .collect(),
                )
            }
        };
        m.now_unix_s = torchmem_core::clock::unix_time_s();
        m.clamp_selection();
    }
}

/// Why the full screen is not used, if it is not.
fn plain_reason() -> Option<&'static str> {
    if !std::io::stdout().is_terminal() {
        return Some("stdout is not a terminal");
    }
    match std::env::var("TERM") {
        Ok(t) if t == "dumb" => Some("TERM=dumb"),
        Ok(t) if t.is_empty() => Some("TERM is empty"),
        Err(_) => Some("TERM is not set"),
        _ => None,
    }
}

pub fn run(args: TopArgs) -> anyhow::Result<i32> {
    if args.interval_ms < 50 {
        bail!("--interval must be at least 50 ms (got {})", args.interval_ms);
    }
    let mut sources = Sources::new(args.profile.as_deref())?;
    let mut model = TopModel::new(sources.source.clone());
    let interval = Duration::from_millis(args.interval_ms);
    let reason = if args.once || args.plain { Some("") } else { plain_reason() };
    if let Some(reason) = reason {
        return run_plain(&mut sources, &mut model, interval, args.once, reason);
    }
    catch_stop_signals();
    let mut terminal = ratatui::try_init().context("cannot set up the terminal (raw mode, alternate screen)")?;
    let result = full_screen(&mut terminal, &mut sources, &mut model, interval);
    ratatui::restore();
    let _ = crossterm::execute!(std::io::stdout(), crossterm::cursor::Show);
    result.map(|_| 0)
}

fn run_plain(
    sources: &mut Sources,
    model: &mut TopModel,
    interval: Duration,
    once: bool,
    reason: &str,
) -> anyhow::Result<i32> {
    let mut out = std::io::stdout().lock();
    if !once && !reason.is_empty() {
        writeln!(
            out,
            "torchmem top: {reason}, so a plain table every {:.1} s (Ctrl-C to stop; `--once` for one)",
            interval.as_secs_f64()
        )?;
    }
    catch_stop_signals();
    loop {
        sources.refresh(model);
        // A closed pipe (`torchmem top | head`) ends it quietly.
        if write!(out, "{}", plain_top(model)).and_then(|_| out.flush()).is_err() || once {
            return Ok(0);
        }
        let _ = writeln!(out);
        let until = Instant::now() + interval;
        while Instant::now() < until {
            if STOP.load(Ordering::SeqCst) {
                return Ok(0);
            }
            std::thread::sleep(Duration::from_millis(50).min(until.saturating_duration_since(Instant::now())));
        }
    }
}

fn full_screen(
    terminal: &mut ratatui::DefaultTerminal,
    sources: &mut Sources,
    model: &mut TopModel,
    interval: Duration,
) -> anyhow::Result<()> {
    let mut next_refresh = Instant::now();
    loop {
        if Instant::now() >= next_refresh {
            sources.refresh(model);
            next_refresh = Instant::now() + interval;
        }
        terminal.draw(|f| render_top(f.area(), f.buffer_mut(), model))?;
        // Wake at the next refresh, or every 100 ms to notice SIGTERM.
        let wait = next_refresh.saturating_duration_since(Instant::now()).min(Duration::from_millis(100));
        if event::poll(wait)? {
            match event::read()? {
                Event::Key(k) if k.kind != KeyEventKind::Release => {
                    let ctrl = k.modifiers.contains(KeyModifiers::CONTROL);
                    match k.code {
                        KeyCode::Char('c') | KeyCode::Char('d') if ctrl => return Ok(()),
                        KeyCode::Esc => return Ok(()),
                        KeyCode::Up => model.move_selection(-1),
                        KeyCode::Down => model.move_selection(1),
                        KeyCode::PageUp => model.move_selection(-10),
                        KeyCode::PageDown => model.move_selection(10),
                        KeyCode::Char(c) if !ctrl && !model.key(c) => return Ok(()),
                        _ => {}
                    }
                }
                _ => {}
            }
        }
        if STOP.load(Ordering::SeqCst) {
            return Ok(());
        }
    }
}
