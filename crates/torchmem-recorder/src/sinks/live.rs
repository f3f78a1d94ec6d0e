//! The live sink: every `torchmem run` registers itself for `torchmem top` by keeping a small state file,
//! `<recorder pid>.json` (a `live_state::LiveSnapshot`), in the live directory: `$TORCHMEM_LIVE_DIR` when
//! set, else `$XDG_RUNTIME_DIR/torchmem/`, else `/tmp/torchmem-<uid>/` (made 0700 and checked to be ours).
//! The file is rewritten atomically (a temporary file renamed over it) a few times a second from the
//! record batches, and removed when the run ends. A recorder killed with SIGKILL leaves its file behind:
//! readers (`scan`) skip files whose recorder is gone (pid dead, or reused: its start time differs) and
//! remove them, and so does the next run's registration. The file is a view of the run's one live state
//! (`live_state::LiveHandle`, folded once per batch by `Sinks`), which `run --live` draws from too.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::{RecordBatch, Sink};
use crate::live_state::{LiveHandle, LiveSnapshot, FORMAT};

/// How often the state file is rewritten.
pub const WRITE_INTERVAL_MS: u64 = 250;
/// Overrides the live directory (tests, or runs that should be seen only by a `top` given the same value).
pub const LIVE_DIR_ENV: &str = "TORCHMEM_LIVE_DIR";
/// `TORCHMEM_LIVE=0`: the run is not registered for `torchmem top` (no state file is written; `run --live`
/// still draws from the in-memory state).
pub const LIVE_ENV: &str = "TORCHMEM_LIVE";

/// Whether runs register for `torchmem top` (`TORCHMEM_LIVE` is not `0`).
pub fn registration_enabled() -> bool {
    std::env::var_os(LIVE_ENV).is_none_or(|v| v != "0")
}

fn uid() -> u32 {
    // SAFETY: geteuid is always safe.
    unsafe { libc::geteuid() }
}

/// The directory this process registers its runs in.
pub fn live_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(LIVE_DIR_ENV).filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty() && Path::new(d).is_dir()) {
        Some(d) => Path::new(&d).join("torchmem"),
        None => PathBuf::from(format!("/tmp/torchmem-{}", uid())),
    }
}

/// Every directory `top` looks in: the one runs here would use, and the others a run of the same user may
/// have used (a run started without a login session has no `XDG_RUNTIME_DIR`, a `top` over SSH has one).
pub fn search_dirs() -> Vec<PathBuf> {
    if let Some(d) = std::env::var_os(LIVE_DIR_ENV).filter(|d| !d.is_empty()) {
        return vec![PathBuf::from(d)];
    }
    let mut dirs = vec![live_dir()];
    let tmp = PathBuf::from(format!("/tmp/torchmem-{}", uid()));
    let run_user = PathBuf::from(format!("/run/user/{}/torchmem", uid()));
    for d in [tmp, run_user] {
        if !dirs.contains(&d) {
            dirs.push(d);
        }
    }
    dirs
}

/// Creates the live directory (0700) if missing and checks that it is a directory of ours that others
/// cannot write to.
pub fn ensure_dir(dir: &Path) -> anyhow::Result<()> {
    if !dir.exists() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(|e| {
            anyhow::anyhow!("cannot create {} ({e}); set {LIVE_DIR_ENV} to a writable directory", dir.display())
        })?;
    }
    let m = std::fs::symlink_metadata(dir)?;
    if !m.is_dir() || m.uid() != uid() || m.permissions().mode() & 0o022 != 0 {
        anyhow::bail!(
            "{} is not a private directory of this user (a symlink, someone else's, or writable by others); \
             remove it or set {LIVE_DIR_ENV} to a directory of yours",
            dir.display()
        );
    }
    Ok(())
}

/// A process's start time in clock ticks since boot (/proc/PID/stat field 22).
pub fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command (field 2) is in parentheses and may hold spaces: count from the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether the recorder that wrote `snap` still runs (same pid, same start time).
pub fn recorder_alive(snap: &LiveSnapshot) -> bool {
    match (start_ticks(snap.recorder_pid), snap.recorder_start_ticks) {
        (Some(now), Some(then)) => now == then,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// Writes `text` to `path` atomically: a temporary file beside it (not `*.json`, so readers skip it),
/// renamed over it.
pub fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// The live runs registered in `dirs`, oldest first. Files of recorders that are gone are removed
/// (only `<pid>.json` files of our format, in directories we own); unreadable or foreign files are skipped.
pub fn scan(dirs: &[PathBuf]) -> Vec<LiveSnapshot> {
    let mut runs: Vec<LiveSnapshot> = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(pid) = name.strip_suffix(".json").and_then(|p| p.parse::<u32>().ok()) else { continue };
            let path = e.path();
            let Ok(text) = std::fs::read_to_string(&path) else { continue };
            let Ok(snap) = serde_json::from_str::<LiveSnapshot>(&text) else { continue };
            if snap.format != FORMAT || snap.recorder_pid != pid {
                continue;
            }
            if !recorder_alive(&snap) {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if !runs.iter().any(|r| r.recorder_pid == snap.recorder_pid) {
                runs.push(snap);
            }
        }
    }
    runs.sort_by(|a, b| a.started_unix_s.total_cmp(&b.started_unix_s).then(a.recorder_pid.cmp(&b.recorder_pid)));
    runs
}

/// Each process's RSS read now from /proc (statm, cheap): the recorder's per-process rows come with its
/// PSS reads, which a loaded machine or a large process spaces out to seconds, so a live view would lag.
pub fn refresh_process_rss(snap: &mut LiveSnapshot) {
    for p in &mut snap.processes {
        if let Some(rss) = torchmem_core::sources::procfs::rss_bytes(p.pid).filter(|b| *b > 0) {
            p.rss_bytes = Some(rss);
        }
    }
}

/// The run's state file: a view of the run's one live state (`LiveHandle`), which the recorder's `Sinks`
/// folds each batch into before this sink sees it; the sink only writes it out, a few times a second.
pub struct LiveSink {
    state: LiveHandle,
    /// The state file; None when registering failed (the run goes on, `run --live` still draws).
    path: Option<PathBuf>,
    last_write: Option<Instant>,
}

impl LiveSink {
    /// Registers the run's state in `dir`. A directory that cannot be used is said once, and the run goes
    /// on unregistered (`top` will not see it; nothing else changes).
    pub fn start(state: &LiveHandle, dir: &Path) -> LiveSink {
        let me = std::process::id();
        let path = match ensure_dir(dir) {
            Ok(()) => {
                // Files left by killed recorders go now too, not only when a `top` looks.
                scan(&[dir.to_path_buf()]);
                Some(dir.join(format!("{me}.json")))
            }
            Err(e) => {
                eprintln!("torchmem: warning: `torchmem top` will not see this run: {e:#}");
                None
            }
        };
        let mut sink = LiveSink { state: state.clone(), path, last_write: None };
        if let Err(e) = sink.write_now() {
            eprintln!("torchmem: warning: `torchmem top` will not see this run: {e:#}");
            sink.path = None;
        }
        // The first batch with readings is written at once.
        sink.last_write = None;
        sink
    }

    /// The state file (tests).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    fn write_now(&mut self) -> anyhow::Result<()> {
        if let Some(p) = &self.path {
            let snap = self.state.snapshot();
            write_atomically(p, &serde_json::to_string(&snap)?)
                .map_err(|e| anyhow::anyhow!("writing {}: {e}", p.display()))?;
            self.last_write = Some(Instant::now());
        }
        Ok(())
    }
}

impl Sink for LiveSink {
    /// The batch is already in the state (`Sinks` folded it): write the state out when due.
    fn consume(&mut self, _batch: &RecordBatch) -> anyhow::Result<()> {
        if self.last_write.is_none_or(|t| t.elapsed() >= Duration::from_millis(WRITE_INTERVAL_MS)) {
            self.write_now()?;
        }
        Ok(())
    }

    fn finish(&mut self, _t_ns: u64) -> anyhow::Result<()> {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "live view registration"
    }
}

impl Drop for LiveSink {
    fn drop(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::live_state::fixtures::{cpu, process};
    use crate::sinks::RunContext;

    #[test]
    fn a_run_registers_updates_and_unregisters() {
        let dir = tempfile::tempdir().unwrap();
        let live = dir.path().join("live");
        // The program's pid: one that has exited (a live pid's /proc RSS would replace the batch's reading).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let program = child.id();
        child.wait().unwrap();
        let ctx = RunContext { command: vec!["t.py".into()], started_unix_s: 5.0, ..Default::default() };
        let handle = LiveHandle::for_run(&ctx);
        handle.set_program(program, Path::new("/no/such/p.sqlite"));
        let mut sink = LiveSink::start(&handle, &live);
        let path = sink.path().unwrap().to_path_buf();
        assert_eq!(path, live.join(format!("{}.json", std::process::id())));
        assert_eq!(std::fs::metadata(&live).unwrap().permissions().mode() & 0o777, 0o700);
        let mut records = process(program, "python t.py", 64);
        records.push(cpu(64));
        let batch = RecordBatch { records, t_ns: 1, ..Default::default() };
        handle.fold(&batch);
        sink.consume(&batch).unwrap();
        let found = scan(std::slice::from_ref(&live));
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].program_pid, Some(program));
        assert_eq!(found[0].processes[0].rss_bytes, Some(64 << 20), "the first batch is written at once");
        assert_eq!(handle.snapshot().tree.rss_bytes, Some(64 << 20));
        assert_eq!(std::fs::read_dir(&live).unwrap().count(), 1, "no temporary file left");
        sink.finish(2).unwrap();
        assert!(!path.exists(), "removed at the end");
        assert!(scan(&[live]).is_empty());
    }

    #[test]
    fn files_of_dead_or_reused_pids_are_skipped_and_removed() {
        let dir = tempfile::tempdir().unwrap();
        // A child that has exited: its pid is dead (reaped).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let snap = |pid: u32, ticks: Option<u64>| LiveSnapshot {
            format: FORMAT.into(),
            recorder_pid: pid,
            recorder_start_ticks: ticks,
            ..Default::default()
        };
        let me = std::process::id();
        let write = |s: &LiveSnapshot| {
            write_atomically(&dir.path().join(format!("{}.json", s.recorder_pid)), &serde_json::to_string(s).unwrap())
                .unwrap()
        };
        write(&snap(dead, Some(1)));
        write(&snap(me, Some(start_ticks(me).unwrap() + 1)));
        std::fs::write(dir.path().join("notes.json"), "{}").unwrap();
        std::fs::write(dir.path().join("123.json"), "not json").unwrap();
        assert!(scan(&[dir.path().to_path_buf()]).is_empty());
        assert!(!dir.path().join(format!("{dead}.json")).exists(), "a dead recorder's file is removed");
        assert!(!dir.path().join(format!("{me}.json")).exists(), "a reused pid's too");
        assert!(dir.path().join("notes.json").exists(), "files that are not ours stay");
        write(&snap(me, start_ticks(me)));
        assert_eq!(scan(&[dir.path().to_path_buf()]).len(), 1);
    }

    #[test]
    fn process_rss_is_read_fresh_from_proc() {
        let me = std::process::id();
        let stale = crate::live_state::ProcessNow { pid: me, rss_bytes: Some(1), ..Default::default() };
        let mut snap = LiveSnapshot { processes: vec![stale], ..Default::default() };
        let before = torchmem_core::sources::procfs::rss_bytes(me).unwrap();
        refresh_process_rss(&mut snap);
        let after = torchmem_core::sources::procfs::rss_bytes(me).unwrap();
        let shown = snap.processes[0].rss_bytes.unwrap();
        assert!(shown > 1 << 20, "this test process's real RSS, not the stale 1 B: {shown}");
        assert!(shown.abs_diff(before) < 64 << 20 || shown.abs_diff(after) < 64 << 20);
    }

    #[test]
    fn a_directory_others_can_write_is_refused_and_the_run_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let open = dir.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = ensure_dir(&open).unwrap_err().to_string();
        assert!(err.contains("not a private directory") && err.contains(LIVE_DIR_ENV), "{err}");
        let handle = LiveHandle::for_run(&RunContext::default());
        handle.set_program(1, Path::new("p.sqlite"));
        let sink = LiveSink::start(&handle, &open);
        assert!(sink.path().is_none());
        assert_eq!(handle.snapshot().program_pid, Some(1));
    }
}
