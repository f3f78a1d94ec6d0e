//! The profile file: one SQLite database per run (bundled SQLite, WAL journal).
//!
//! Crash safety: the recorder commits a batch every `flush` (about every 50 ms). A committed batch survives
//! the profiled program being killed, and the recorder itself being SIGKILLed: SQLite replays the WAL on the
//! next open. The file is plain SQLite, so `pandas.read_sql("select * from cpu_samples", sqlite3.connect(p))`
//! reads it as it is. Table and column names carry their unit (`_bytes`, `_ns`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags, OptionalExtension};

use crate::error::{CoreError, Result};
use crate::model::*;
pub use crate::record::{Blob, Record};

mod tables;
use tables::{
    Blobs, BreakdownAggregates, Breakdowns, CpuSamples, GpuSamples, LineProfiles, Markers, Meta, ModuleActivations,
    ProcessSamples, Processes, Sent, SpanAggregates, Table, TorchSamples,
};

pub const FORMAT_NAME: &str = "torchmem-profile";
/// The schema this code writes. v2 added identity (pid, rank, local_rank, world_size) to markers, torch
/// samples and line profiles, the marker's device, and `span_aggregates`; v3 made the side records typed
/// (`record::Blob`: a closed set of kinds, each a serde struct, stored as its name and JSON; the line profile a
/// `lines::LineProfile`) and gave `blobs` the sender's identity; v4 keeps the Monitor's end-of-epoch RSS less
/// malloc's free bytes (`markers.held_rss_bytes`), so a profile's growth warning judges the series the Monitor
/// judges (a v3 file reads it as NULL and falls back to raw RSS). v1, v2 and v3 files still load (their blobs read
/// into the same kinds; a name this torchmem does not know stays `Blob::Other`). Later v2 files add the
/// breakdown tables (`breakdowns`, `module_activations`, `breakdown_aggregates`, below): a file without them
/// reads as "no breakdown recorded", and older readers ignore them.
///
/// The breakdown ("what is the memory?", `crate::breakdown`): `breakdowns` holds one row per (kept marker,
/// device), linked by the marker's `rowid`, with one column per category (`parameters_bytes` …
/// `rss_bytes`, NULL where not measured) and the per-module and per-param-group detail as JSON (`by_module`:
/// `{"parameters": {module: bytes}, "gradients": {...}}`, `by_param_group`: `[bytes, ...]`);
/// `module_activations` one row per (kept marker, module) of the opt-in activations by module;
/// `breakdown_aggregates` one row per (pid, rank, boundary, device, category) of the boundaries the
/// recorder folded (every step after the first `keep_spans`): count, sum and max, so the mean and max
/// over all steps are exact while the file grows by the first `keep_spans` steps' rows only.
pub const SCHEMA_VERSION: i64 = 4;

pub struct ProfileWriter {
    conn: Connection,
    pending: Vec<Record>,
    path: PathBuf,
    /// Space held on the profile's filesystem for the end of a run whose disk fills up (`make_room`): an
    /// unnamed file (`O_TMPFILE`) of `RESERVE_BYTES`, so nothing is left behind even when the recorder is
    /// SIGKILLed. None where it could not be made (no `O_TMPFILE`, already too little space).
    reserve: Option<std::fs::File>,
    /// The file, held with an exclusive `flock` for the writer's life: a live recorder's profile is never
    /// replaced by another run, and readers can tell "still recording" from "the recorder was killed".
    /// Declared last so it is released after the connection closes.
    _lock: std::fs::File,
}

/// The space held back for a full disk: enough to move the WAL's pages into the database (the WAL is
/// checkpointed every `WAL_CHECKPOINT_PAGES`) and to write the run's end.
const RESERVE_BYTES: i64 = 512 << 10;
/// The WAL is checkpointed into the database every this many pages (SQLite's default is 1000), so that a
/// full disk never holds more un-checkpointed pages than `RESERVE_BYTES` can take.
const WAL_CHECKPOINT_PAGES: i64 = 32;

/// Whether a store error means the filesystem (or quota) is full.
pub fn is_disk_full(e: &CoreError) -> bool {
    let io_full = |raw: Option<i32>| matches!(raw, Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG));
    match e {
        CoreError::Store(e) => e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull),
        CoreError::Io(e) => io_full(e.raw_os_error()),
        _ => false,
    }
}

/// An unnamed file of `bytes` allocated in `dir` (freed when closed), or None.
fn reserve_space(dir: &Path, bytes: i64) -> Option<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let f =
        std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_TMPFILE).mode(0o600).open(dir).ok()?;
    // SAFETY: fallocate on a file descriptor we own.
    (unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, bytes) } == 0).then_some(f)
}

impl ProfileWriter {
    /// Creates a new profile at `path` (which must not exist) and writes the run's metadata. The file is
    /// born locked (see `_lock`): it is made as an unnamed file, locked, then linked to `path`, so another
    /// run never finds it unlocked, and two runs racing for one path cannot both win.
    pub fn create(path: &Path, meta: &RunMeta) -> Result<Self> {
        let lock = create_locked(path)?;
        let made = (move || -> Result<Self> {
            let conn = Connection::open(path)?;
            conn.pragma_update(None, "journal_mode", "WAL")?;
            conn.pragma_update(None, "synchronous", "NORMAL")?;
            conn.pragma_update(None, "wal_autocheckpoint", WAL_CHECKPOINT_PAGES)?;
            // The schema and the run's metadata in one transaction: a checkpoint never sees one without
            // the other (a live profile's main file copied alone then still reads as a profile).
            conn.execute_batch("BEGIN")?;
            conn.execute_batch(&tables::schema())?;
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            let reserve = reserve_space(dir, RESERVE_BYTES);
            let w = ProfileWriter { conn, pending: Vec::new(), path: path.to_path_buf(), reserve, _lock: lock };
            w.put_meta("format", FORMAT_NAME)?;
            w.put_meta("schema_version", &SCHEMA_VERSION.to_string())?;
            w.put_meta("run", &serde_json::to_string(meta)?)?;
            w.conn.execute_batch("COMMIT")?;
            Ok(w)
        })();
        if made.is_err() {
            remove_profile_files(path);
        }
        made
    }

    /// Like `create`, but first replaces what is at `path` when that is a torchmem profile that no live
    /// recorder holds, or an empty file; anything else is refused and left as it is.
    pub fn create_replacing(path: &Path, meta: &RunMeta) -> Result<Self> {
        if std::fs::symlink_metadata(path).is_ok() {
            let old = std::fs::File::open(path)?;
            if !try_flock(&old, libc::LOCK_EX) {
                return Err(CoreError::Invalid(format!(
                    "{} is being recorded by another `torchmem run`; choose another path",
                    path.display()
                )));
            }
            if old.metadata()?.len() > 0 && !is_empty_database(path) {
                check_profile(path).map_err(|why| {
                    CoreError::Invalid(format!(
                        "{} is not a torchmem profile ({why}); it is left as it is",
                        path.display()
                    ))
                })?;
            }
            remove_profile_files(path);
        }
        Self::create(path, meta)
    }

    /// After a write failed because the disk is full: drops what was not written, frees the space held
    /// in reserve and moves the WAL into the database file, emptying the WAL. What was committed is then
    /// safe in the one file, and `finish_with` has room to write how the run ended.
    pub fn make_room(&mut self) -> Result<()> {
        self.pending.clear();
        self.reserve = None;
        self.conn.busy_timeout(std::time::Duration::from_secs(2)).ok();
        let busy: i64 = self.conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
        if busy != 0 {
            return Err(CoreError::Invalid("the WAL could not be checkpointed (a reader holds it)".into()));
        }
        Ok(())
    }

    /// Whether space is held in reserve for a full disk (see `make_room`).
    pub fn has_reserve(&self) -> bool {
        self.reserve.is_some()
    }

    /// Leaves the file as a SIGKILLed recorder would: nothing after the last commit, no finish, the WAL
    /// not checkpointed, and the lock released (its process is gone). For tests of killed runs.
    pub fn abandon(self) {
        let ProfileWriter { conn, _lock, reserve, .. } = self;
        drop(reserve);
        drop(_lock);
        std::mem::forget(conn);
    }

    /// Gives up a profile whose run never started: closes it and removes the file with its `-wal`/`-shm`.
    pub fn discard(self) {
        let ProfileWriter { conn, path, _lock, .. } = self;
        drop(conn);
        remove_profile_files(&path);
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn put_meta(&self, key: &str, value: &str) -> Result<()> {
        Meta::write(&mut self.conn.prepare_cached(&Meta::insert())?, &(key.to_string(), value.to_string()))?;
        Ok(())
    }

    pub fn push(&mut self, record: Record) {
        self.pending.push(record);
    }

    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Commits everything pushed so far in one transaction.
    pub fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let tx = self.conn.transaction()?;
        {
            let mut cpu = tx.prepare_cached(&CpuSamples::insert())?;
            let mut proc_s = tx.prepare_cached(&ProcessSamples::insert())?;
            let mut seen = tx.prepare_cached(&Processes::insert())?;
            let mut gpu = tx.prepare_cached(&GpuSamples::insert())?;
            let mut torch = tx.prepare_cached(&TorchSamples::insert())?;
            let mut marker = tx.prepare_cached(&Markers::insert())?;
            let mut agg_del = tx.prepare_cached(SpanAggregates::DELETE)?;
            let mut agg = tx.prepare_cached(&SpanAggregates::insert())?;
            let mut lines = tx.prepare_cached(&LineProfiles::insert())?;
            let mut blob = tx.prepare_cached(&Blobs::insert())?;
            let mut breakdown = tx.prepare_cached(&Breakdowns::insert())?;
            let mut activation = tx.prepare_cached(&ModuleActivations::insert())?;
            let mut bagg_del = tx.prepare_cached(BreakdownAggregates::DELETE)?;
            let mut bagg = tx.prepare_cached(&BreakdownAggregates::insert())?;
            for r in self.pending.drain(..) {
                match r {
                    Record::Cpu(s) => CpuSamples::write(&mut cpu, &s)?,
                    Record::Process(s) => ProcessSamples::write(&mut proc_s, &s)?,
                    Record::ProcessSeen(p) => Processes::write(&mut seen, &p)?,
                    Record::Gpu(s) => GpuSamples::write(&mut gpu, &s)?,
                    Record::Torch(s) => TorchSamples::write(&mut torch, &s)?,
                    Record::Marker(m) => {
                        Markers::write(&mut marker, &m)?;
                        if m.breakdown.is_some() || m.activations_by_module.is_some() {
                            let rowid = tx.last_insert_rowid();
                            for b in m.breakdown.into_iter().flatten() {
                                Breakdowns::write(&mut breakdown, &(rowid, b))?;
                            }
                            for (module, bytes) in m.activations_by_module.into_iter().flatten() {
                                ModuleActivations::write(&mut activation, &(rowid, module, bytes))?;
                            }
                        }
                    }
                    Record::BreakdownAggregate(a) => {
                        BreakdownAggregates::delete(&mut bagg_del, &a)?;
                        for (c, stat) in &a.categories {
                            let row = tables::BreakdownAggregateRow {
                                origin: a.origin,
                                boundary: a.boundary.clone(),
                                device: a.device.clone(),
                                category: Some(*c),
                                boundaries: a.count,
                                stat: *stat,
                            };
                            BreakdownAggregates::write(&mut bagg, &row)?;
                        }
                    }
                    Record::Aggregate(a) => {
                        SpanAggregates::delete(&mut agg_del, &a)?;
                        SpanAggregates::write(&mut agg, &a)?;
                    }
                    Record::LineProfile { t_ns, origin, profile } => {
                        LineProfiles::write(&mut lines, &Sent { t_ns, origin, what: Some(profile) })?;
                    }
                    Record::Blob { t_ns, origin, blob: b } => {
                        Blobs::write(&mut blob, &Sent { t_ns, origin, what: Some(b) })?;
                    }
                }
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Flushes, records how the run ended, and returns the profile as read back through this writer's own
    /// connection (the run's summary never re-opens a path that another run may have taken).
    pub fn finish(self, exit_code: Option<i32>, duration_ns: u64) -> Result<Profile> {
        self.finish_with(|m| m.exit_code = exit_code, duration_ns)
    }

    /// `finish`, with `end` filling in how the run ended (exit code, the signal that killed it, the OOM
    /// killer's doing). The finished file is switched from WAL to `journal_mode=DELETE`: one self-contained
    /// file, no `-wal`/`-shm`, readable from a read-only directory and by `sqlite3.connect` as it is.
    pub fn finish_with(mut self, end: impl FnOnce(&mut RunMeta), duration_ns: u64) -> Result<Profile> {
        self.flush()?;
        let mut meta = read_meta(&self.conn, &self.path)?;
        meta.duration_ns = Some(duration_ns);
        end(&mut meta);
        self.put_meta("run", &serde_json::to_string(&meta)?)?;
        // A reader (`torchmem report` on the live file) may hold a read lock for a moment: wait for it.
        self.conn.busy_timeout(std::time::Duration::from_secs(2)).ok();
        self.conn.pragma_update(None, "wal_checkpoint", "TRUNCATE").ok();
        let _mode: rusqlite::Result<String> = self.conn.query_row("PRAGMA journal_mode=DELETE", [], |r| r.get(0));
        load(&self.conn, &self.path, meta)
    }
}

/// `flock(op | LOCK_NB)`, retried for up to 200 ms (a reader's brief shared lock is not a recorder).
fn try_flock(f: &std::fs::File, op: libc::c_int) -> bool {
    use std::os::fd::AsRawFd;
    for _ in 0..20 {
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), op | libc::LOCK_NB) } == 0 {
            return true;
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EWOULDBLOCK) {
            return true; // no flock here (some network filesystems): do not claim a holder we cannot see
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

/// A new, locked file at `path`, which must not exist: an unnamed `O_TMPFILE` in the directory, locked,
/// then linked to the name (fails if the name exists). Where `O_TMPFILE` is missing, `O_EXCL` then lock.
fn create_locked(path: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let exists = || {
        CoreError::Io(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{} exists already (another run created it a moment ago?)", path.display()),
        ))
    };
    if let Ok(f) =
        std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_TMPFILE).mode(0o644).open(dir)
    {
        // SAFETY: flock on the fresh file we own (nobody else can reach it yet).
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        let from = std::ffi::CString::new(format!("/proc/self/fd/{}", f.as_raw_fd())).expect("no NUL");
        let to = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()))
            .map_err(|_| CoreError::Invalid(format!("{}: a path with a NUL byte", path.display())))?;
        // SAFETY: linkat on NUL-terminated paths we own; AT_SYMLINK_FOLLOW resolves the /proc link.
        if unsafe { libc::linkat(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), libc::AT_SYMLINK_FOLLOW) }
            == 0
        {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            return Err(exists());
        }
        // linkat through /proc unavailable: fall through to O_EXCL.
    }
    let f =
        std::fs::OpenOptions::new().read(true).write(true).create_new(true).mode(0o644).open(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                exists()
            } else {
                CoreError::Io(e)
            }
        })?;
    // SAFETY: flock on the file we just created.
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    Ok(f)
}

/// Removes a profile's file and SQLite's companions (`-wal`, `-shm`, `-journal`); missing ones are fine.
pub fn remove_profile_files(path: &Path) {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

/// True while a live `torchmem run` holds this profile (its exclusive lock).
pub fn is_being_recorded(path: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(f) = std::fs::File::open(path) else { return false };
    // SAFETY: flock on a descriptor we own; the shared lock is dropped with the file.
    (unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } != 0)
        && std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK)
}

/// Checks that `path` is a torchmem profile (SQLite with torchmem's format marker) without loading it; the
/// error says why not.
pub fn check_profile(path: &Path) -> std::result::Result<(), String> {
    match connect(path) {
        Ok(_) => Ok(()),
        Err(CoreError::NotAProfile { reason, .. }) | Err(CoreError::DamagedProfile { reason, .. }) => Err(reason),
        Err(e) => Err(e.to_string()),
    }
}

/// True for an SQLite database that holds no table at all (a run killed while it was creating its profile):
/// replacing it loses nothing.
pub fn is_empty_database(path: &Path) -> bool {
    header_journal(path).is_some()
        && Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX)
            .and_then(|c| c.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get::<_, i64>(0)))
            .is_ok_and(|n| n == 0)
}

/// Whether an SQLite error means "cannot open this way" (a read-only directory or filesystem, no `-shm`)
/// rather than "this is not a database".
fn cannot_open(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::CannotOpen | rusqlite::ErrorCode::ReadOnly | rusqlite::ErrorCode::PermissionDenied)
    )
}

/// The journal mode written in an SQLite file's header (bytes 18–19: 1 rollback, 2 WAL), if it is SQLite.
fn header_journal(path: &Path) -> Option<u8> {
    use std::io::Read;
    let mut head = [0u8; 20];
    std::fs::File::open(path).ok()?.read_exact(&mut head).ok()?;
    head.starts_with(b"SQLite format 3\0").then_some(head[18])
}

/// Opens a profile's database and checks torchmem's format marker. Read-write first (a killed run's
/// write-ahead log is then folded into the file); where that cannot work (a read-only directory or
/// filesystem: SQLite cannot create `-shm`), read-only, then `immutable`.
fn connect(path: &Path) -> Result<Connection> {
    let not_profile = |reason: String| CoreError::NotAProfile { path: path.into(), reason };
    let probe = |conn: &Connection| -> rusqlite::Result<i64> {
        conn.query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'meta'", [], |r| r.get(0))
    };
    let attempts: [(OpenFlags, bool); 3] = [
        (OpenFlags::SQLITE_OPEN_READ_WRITE, false),
        (OpenFlags::SQLITE_OPEN_READ_ONLY, false),
        (OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_URI, true),
    ];
    // Before SQLite opens it (opening a WAL-mode file creates an empty `-wal`).
    let wal = PathBuf::from(format!("{}-wal", path.display()));
    let wal_bytes = std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0);
    let mut last: Option<rusqlite::Error> = None;
    let mut found: Option<(Connection, i64, bool)> = None;
    for (flags, immutable) in attempts {
        let flags = flags | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let opened = if immutable {
            let uri = format!("file:{}?immutable=1", uri_path(path));
            Connection::open_with_flags(uri, flags)
        } else {
            Connection::open_with_flags(path, flags)
        };
        match opened.and_then(|c| probe(&c).map(|n| (c, n))) {
            Ok((c, n)) => {
                found = Some((c, n, immutable));
                break;
            }
            Err(e) if cannot_open(&e) => last = Some(e),
            Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::NotADatabase) => {
                return Err(not_profile("not an SQLite database, or not a whole one".into()));
            }
            Err(e) => return Err(not_profile(e.to_string())),
        }
    }
    let Some((conn, has_meta, immutable)) = found else {
        let e = last.map(|e| e.to_string()).unwrap_or_default();
        return Err(not_profile(format!("SQLite cannot open it ({e}): check that the file is readable")));
    };
    if has_meta == 0 {
        let wal_mode = header_journal(path) == Some(2);
        let reason = if wal_mode && wal_bytes == 0 {
            format!(
                "an SQLite file whose data all sits in its write-ahead log {}, which is not here: this is the main file of a profile copied while its run was still recording, or after its recorder was killed. Copy {} along with it; or, once the run has ended (or after a killed run, once `torchmem report` has read the original: that folds the log into the file), copy the file again",
                wal.display(),
                wal.display()
            )
        } else if wal_mode && immutable {
            format!(
                "its data sits in {}, which cannot be read here (the directory is read-only and SQLite's -shm file is missing): copy the file and its -wal to a writable directory",
                wal.display()
            )
        } else {
            "SQLite file without torchmem's format marker".into()
        };
        return Err(not_profile(reason));
    }
    let format: Option<String> = conn
        .query_row("SELECT value FROM meta WHERE key = 'format'", [], |r| r.get(0))
        .optional()
        .map_err(|e| CoreError::DamagedProfile { path: path.into(), reason: e.to_string() })?;
    if format.as_deref() != Some(FORMAT_NAME) {
        return Err(not_profile("SQLite file without torchmem's format marker".into()));
    }
    Ok(conn)
}

/// A path for an SQLite `file:` URI (absolute, with `%`, `?` and `#` escaped).
fn uri_path(path: &Path) -> String {
    let abs = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let mut out = String::new();
    for c in abs.display().to_string().chars() {
        match c {
            '%' => out.push_str("%25"),
            '?' => out.push_str("%3f"),
            '#' => out.push_str("%23"),
            c => out.push(c),
        }
    }
    out
}

fn read_meta(conn: &Connection, path: &Path) -> Result<RunMeta> {
    let run: Option<String> =
        conn.query_row("SELECT value FROM meta WHERE key = 'run'", [], |r| r.get(0)).optional()?;
    let run = run.ok_or_else(|| CoreError::NotAProfile { path: path.into(), reason: "no run metadata".into() })?;
    serde_json::from_str(&run)
        .map_err(|e| CoreError::NotAProfile { path: path.into(), reason: format!("bad run metadata: {e}") })
}

/// The loaded profile is plain data in `model`; `Profile::open` below reads it from a file.
impl Profile {
    /// Opens and loads a profile. A missing file, a file that is not SQLite, and an SQLite file that is not a
    /// torchmem profile each get their own clear error. A profile whose recorder was killed opens fine.
    pub fn open(path: &Path) -> Result<Profile> {
        if !path.exists() {
            return Err(CoreError::ProfileMissing { path: path.into() });
        }
        let recording = is_being_recorded(path);
        // Before SQLite opens it (that creates an empty `-wal`): a file in WAL mode with no log beside it.
        let wal_bytes = std::fs::metadata(format!("{}-wal", path.display())).map(|m| m.len()).unwrap_or(0);
        let without_wal = header_journal(path) == Some(2) && wal_bytes == 0;
        let conn = connect(path)?;
        let mut meta = RunMeta { recording, ..read_meta(&conn, path)? };
        // Unfinished, in WAL mode, without its log: the main file of a live profile, copied alone (a killed
        // recorder leaves its log beside the file).
        meta.copied_without_wal = without_wal && !recording && meta.duration_ns.is_none();
        load(&conn, path, meta)
    }
}

/// Reads every table. Markers are streamed through the keep-or-fold rule (`fold`), never collected whole: a
/// v1 file of millions of markers loads in bounded memory, and the folded ones join the file's aggregates.
fn load(conn: &Connection, path: &Path, meta: RunMeta) -> Result<Profile> {
    let damaged = |e: rusqlite::Error| CoreError::DamagedProfile { path: path.into(), reason: e.to_string() };
    let version: i64 = conn
        .query_row("SELECT value FROM meta WHERE key = 'schema_version'", [], |r| r.get::<_, String>(0))
        .optional()
        .map_err(damaged)?
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1);
    if version > SCHEMA_VERSION {
        return Err(CoreError::Invalid(format!(
            "{}: this profile has schema version {version}, newer than this torchmem reads (up to {SCHEMA_VERSION}): upgrade torchmem (`pip install -U torchmem`) to read it",
            path.display()
        )));
    }
    load_tables(conn, path, meta, version).map_err(damaged)
}

/// Every row of table `T` (through its row definition) in a file of schema `version`, in `order`.
fn rows<T: Table>(conn: &Connection, version: i64, order: &str) -> rusqlite::Result<Vec<T::Row>> {
    let mut st = conn.prepare(&T::select(version, "", order))?;
    let rows = st.query_map([], |r| T::read(r))?;
    rows.collect()
}

fn load_tables(conn: &Connection, path: &Path, meta: RunMeta, version: i64) -> rusqlite::Result<Profile> {
    let keep_spans = meta.keep_spans.unwrap_or(crate::fold::DEFAULT_KEEP_SPANS).min(crate::fold::MAX_KEEP_SPANS_READ);
    let mut p = Profile { path: path.into(), meta, schema_version: version, ..Default::default() };
    p.cpu = rows::<CpuSamples>(conn, version, "ORDER BY t_ns")?;
    p.processes = rows::<Processes>(conn, version, "ORDER BY first_t_ns, pid")?;
    p.process_samples = rows::<ProcessSamples>(conn, version, "ORDER BY t_ns, pid")?;
    p.gpu = rows::<GpuSamples>(conn, version, "ORDER BY t_ns, device")?;
    p.torch = rows::<TorchSamples>(conn, version, "ORDER BY t_ns, device")?;
    let has_breakdowns = version >= 2 && has_table(conn, Breakdowns::NAME)?;
    let mut breakdowns = if has_breakdowns { load_breakdowns(conn, version)? } else { HashMap::new() };
    let mut activations = if has_breakdowns { load_module_activations(conn, version)? } else { HashMap::new() };
    let mut st = conn.prepare(&Markers::select(version, ", rowid", "ORDER BY t_ns, rowid"))?;
    let rowid_at = Markers::COLUMNS.len();
    let mut rows_of = st.query([])?;
    let mut folder = crate::fold::SpanFolder::new(keep_spans);
    while let Some(r) = rows_of.next()? {
        let rowid: i64 = r.get(rowid_at)?;
        let m = Marker {
            breakdown: breakdowns.remove(&rowid),
            activations_by_module: activations.remove(&rowid),
            ..Markers::read(r)?
        };
        if let Some(kept) = folder.push(m) {
            p.markers.push(kept);
        }
    }
    folder.finish();
    let mut breakdown_aggregates =
        if has_breakdowns { load_breakdown_aggregates(conn, version)? } else { Vec::<BreakdownAggregate>::new() };
    let mut at: HashMap<crate::breakdown::BreakdownKey, usize> =
        breakdown_aggregates.iter().enumerate().map(|(i, a)| (a.key(), i)).collect();
    for folded in folder.breakdown_aggregates() {
        match at.get(&folded.key()) {
            Some(&i) => breakdown_aggregates[i].merge(&folded),
            None => {
                at.insert(folded.key(), breakdown_aggregates.len());
                breakdown_aggregates.push(folded);
            }
        }
    }
    p.breakdown_aggregates = breakdown_aggregates;
    let mut aggregates: Vec<SpanAggregate> = if version >= 2 {
        rows::<SpanAggregates>(conn, version, "ORDER BY first_start_t_ns, rowid")?
    } else {
        Vec::new()
    };
    let mut at: HashMap<AggregateKey, usize> = aggregates.iter().enumerate().map(|(i, a)| (a.key(), i)).collect();
    for folded in folder.into_aggregates() {
        match at.get(&folded.key()) {
            Some(&i) => aggregates[i].merge(&folded),
            None => {
                at.insert(folded.key(), aggregates.len());
                aggregates.push(folded);
            }
        }
    }
    p.aggregates = aggregates;
    // A payload that is not a line profile, or a blob whose text is not JSON (no writer made either), is
    // skipped, as the reports always did; a blob of a name this torchmem does not know is `Blob::Other`.
    for s in rows::<LineProfiles>(conn, version, "ORDER BY t_ns, rowid")? {
        if let Some(profile) = s.what {
            p.line_profiles.push(profile);
            p.line_profile_origins.push(s.origin);
        }
    }
    for s in rows::<Blobs>(conn, version, "ORDER BY t_ns, rowid")? {
        if let Some(blob) = s.what {
            p.blobs.push(blob);
            p.blob_origins.push(s.origin);
        }
    }
    Ok(p)
}

fn has_table(conn: &Connection, name: &str) -> rusqlite::Result<bool> {
    conn.query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1", [name], |r| {
        r.get::<_, i64>(0)
    })
    .map(|n| n > 0)
}

/// The breakdown rows, by the rowid of the marker they belong to.
fn load_breakdowns(conn: &Connection, version: i64) -> rusqlite::Result<HashMap<i64, Vec<DeviceBreakdown>>> {
    let mut out: HashMap<i64, Vec<DeviceBreakdown>> = HashMap::new();
    for (rowid, b) in rows::<Breakdowns>(conn, version, "ORDER BY marker_rowid, rowid")? {
        out.entry(rowid).or_default().push(b);
    }
    Ok(out)
}

fn load_module_activations(conn: &Connection, version: i64) -> rusqlite::Result<HashMap<i64, BTreeMap<String, u64>>> {
    let mut out: HashMap<i64, BTreeMap<String, u64>> = HashMap::new();
    for (rowid, module, bytes) in rows::<ModuleActivations>(conn, version, "ORDER BY rowid")? {
        out.entry(rowid).or_default().insert(module, bytes);
    }
    Ok(out)
}

/// The folded breakdowns: one `BreakdownAggregate` per (pid, rank, boundary, device), from its category rows.
fn load_breakdown_aggregates(conn: &Connection, version: i64) -> rusqlite::Result<Vec<BreakdownAggregate>> {
    let mut out: Vec<BreakdownAggregate> = Vec::new();
    let mut at: HashMap<crate::breakdown::BreakdownKey, usize> = HashMap::new();
    for row in rows::<BreakdownAggregates>(conn, version, "ORDER BY rowid")? {
        let agg = BreakdownAggregate::new(row.origin, row.boundary, row.device);
        let i = *at.entry(agg.key()).or_insert_with(|| {
            out.push(agg);
            out.len() - 1
        });
        let Some(c) = row.category else { continue };
        out[i].count = out[i].count.max(row.boundaries);
        out[i].categories.insert(c, row.stat);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rusqlite::params;

    fn meta() -> RunMeta {
        RunMeta { command: vec!["python".into(), "x.py".into()], interval_ms: 10.0, ..Default::default() }
    }

    #[test]
    fn round_trips_every_record_kind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sqlite");
        let mut w = ProfileWriter::create(&path, &meta()).unwrap();
        w.push(Record::Cpu(CpuSample {
            t_ns: 1,
            rss_bytes: 100,
            pss_bytes: Some(90),
            uss_bytes: None,
            process_count: 2,
        }));
        w.push(Record::ProcessSeen(ProcessInfo {
            pid: 5,
            ppid: 1,
            cmdline: "python x.py".into(),
            first_t_ns: 1,
            last_t_ns: 1,
        }));
        w.push(Record::ProcessSeen(ProcessInfo {
            pid: 5,
            ppid: 1,
            cmdline: String::new(),
            first_t_ns: 9,
            last_t_ns: 9,
        }));
        w.push(Record::Torch(TorchSample {
            t_ns: 2,
            device: 0,
            allocated_bytes: 3,
            reserved_bytes: 4,
            peak_allocated_bytes: 5,
            peak_reserved_bytes: 6,
            active_bytes: 3,
            inactive_split_bytes: 0,
            origin: Default::default(),
        }));
        w.push(Record::Marker(Marker {
            index: Some(0),
            memory: MarkerMemory { rss_bytes: Some(7), ..Default::default() },
            ..Marker::new(3, MarkerKind::Epoch, Edge::Start, "epoch")
        }));
        let origin = Origin { pid: Some(12), rank: Some(1), local_rank: None, world_size: Some(2) };
        w.push(Record::Blob { t_ns: 4, origin, blob: Blob::from_parts("x".into(), serde_json::json!({"a": 1})) });
        let oom = Blob::from_parts("oom".into(), serde_json::json!({"pid": 12, "requested_bytes": 5, "x": 1}));
        w.push(Record::Blob { t_ns: 5, origin, blob: oom });
        let outlived = Blob::Outlived(crate::record::Outlived { t_ns: 6, pids: vec![7, 8] });
        w.push(Record::Blob { t_ns: 6, origin: Origin::default(), blob: outlived.clone() });
        w.flush().unwrap();
        w.finish(Some(3), 10).unwrap();
        let p = Profile::open(&path).unwrap();
        assert_eq!(p.meta.exit_code, Some(3));
        assert_eq!(p.cpu[0].pss_bytes, Some(90));
        assert_eq!(p.processes.len(), 1);
        assert_eq!(p.processes[0].cmdline, "python x.py");
        assert_eq!(p.processes[0].last_t_ns, 9);
        assert_eq!(p.torch[0].peak_reserved_bytes, 6);
        assert_eq!(p.markers[0].memory.rss_bytes, Some(7));
        assert_eq!(p.blobs[0], Blob::Other { name: "x".into(), data: serde_json::json!({"a": 1}) });
        let Blob::Oom(o) = &p.blobs[1] else { panic!("{:?}", p.blobs[1]) };
        assert_eq!((o.pid, o.requested_bytes, o.allocated_bytes), (12, Some(5), None));
        assert_eq!(p.blobs[2], outlived);
        assert_eq!(p.blob_origins, [origin, origin, Origin::default()], "v3: each blob's sender");
        assert_eq!(crate::report::cells::outlived_program(&p), [7, 8].into());
    }

    #[test]
    fn unfinished_profile_is_readable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sqlite");
        let mut w = ProfileWriter::create(&path, &meta()).unwrap();
        w.push(Record::Cpu(CpuSample { t_ns: 1, rss_bytes: 100, pss_bytes: None, uss_bytes: None, process_count: 1 }));
        w.flush().unwrap();
        w.abandon(); // as if the recorder died: no finish, WAL not checkpointed
        let p = Profile::open(&path).unwrap();
        assert_eq!(p.cpu.len(), 1);
        assert_eq!(p.meta.exit_code, None);
        assert!(!p.meta.recording, "nobody holds it any more");
    }

    #[test]
    fn a_live_profile_is_locked_and_a_finished_one_is_one_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sqlite");
        let mut w = ProfileWriter::create(&path, &meta()).unwrap();
        w.push(Record::Cpu(CpuSample { t_ns: 1, rss_bytes: 100, pss_bytes: None, uss_bytes: None, process_count: 1 }));
        w.flush().unwrap();
        assert!(is_being_recorded(&path));
        let live = Profile::open(&path).unwrap();
        assert!(live.meta.recording && live.meta.exit_code.is_none());
        // Another run can neither create nor replace it while it is held.
        assert!(ProfileWriter::create(&path, &meta()).is_err());
        let e = ProfileWriter::create_replacing(&path, &meta()).err().unwrap().to_string();
        assert!(e.contains("being recorded"), "{e}");
        let p = w
            .finish_with(
                |m| {
                    m.exit_code = Some(137);
                    m.signal = Some(9);
                },
                10,
            )
            .unwrap();
        assert_eq!((p.meta.exit_code, p.meta.signal, p.cpu.len()), (Some(137), Some(9), 1));
        assert!(!is_being_recorded(&path));
        for companion in ["-wal", "-shm", "-journal"] {
            assert!(!PathBuf::from(format!("{}{companion}", path.display())).exists(), "{companion} left behind");
        }
        assert_eq!(header_journal(&path), Some(1), "a finished profile is in rollback-journal mode");
        let again = Profile::open(&path).unwrap();
        assert_eq!(again.meta.signal, Some(9));
        assert!(!again.meta.recording);
    }

    #[test]
    fn replacing_refuses_what_is_not_a_profile() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("train.py");
        std::fs::write(&script, "print('hi')\n").unwrap();
        assert!(ProfileWriter::create(&script, &meta()).is_err());
        assert!(ProfileWriter::create_replacing(&script, &meta()).is_err());
        assert_eq!(std::fs::read_to_string(&script).unwrap(), "print('hi')\n");
        let old = dir.path().join("old.sqlite");
        ProfileWriter::create(&old, &meta()).unwrap().finish(Some(0), 1).unwrap();
        let w = ProfileWriter::create_replacing(&old, &meta()).unwrap();
        w.discard();
        assert!(!old.exists(), "a discarded profile leaves nothing");
        assert!(!PathBuf::from(format!("{}-wal", old.display())).exists());
    }

    #[test]
    fn a_copied_main_file_without_its_wal_says_where_the_data_is() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("live.sqlite");
        let mut w = ProfileWriter::create(&path, &meta()).unwrap();
        w.push(Record::Cpu(CpuSample { t_ns: 1, rss_bytes: 100, pss_bytes: None, uss_bytes: None, process_count: 1 }));
        w.flush().unwrap();
        let copy = dir.path().join("copy.sqlite");
        std::fs::copy(&path, &copy).unwrap();
        let e = Profile::open(&copy).unwrap_err().to_string();
        assert!(e.contains("copy.sqlite-wal") && e.contains("write-ahead log"), "{e}");
        // The WAL is checkpointed every WAL_CHECKPOINT_PAGES: a copy taken after that holds the data up to
        // then, and says it is a copy without its log.
        for t_ns in 2..6000 {
            w.push(Record::Cpu(CpuSample { t_ns, rss_bytes: 100, pss_bytes: None, uss_bytes: None, process_count: 1 }));
        }
        w.flush().unwrap();
        std::fs::remove_file(&copy).unwrap();
        std::fs::copy(&path, &copy).unwrap();
        let p = Profile::open(&copy).unwrap();
        assert!(p.meta.copied_without_wal && p.meta.duration_ns.is_none() && !p.cpu.is_empty());
        let ended = crate::report::cells::meta_lines(&p, &crate::analysis::Summary::from_profile(&p))
            .into_iter()
            .find(|(k, _)| k == "ended")
            .unwrap()
            .1;
        assert!(ended.contains("copy.sqlite-wal") && ended.contains("write-ahead log"), "{ended}");
        w.finish(Some(0), 1).unwrap();
        // The original, once finished, is one file: not a copy without its log.
        assert!(!Profile::open(&path).unwrap().meta.copied_without_wal);
    }

    #[test]
    fn bad_files_get_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = Profile::open(&dir.path().join("nope.sqlite")).unwrap_err();
        assert!(missing.to_string().contains("no such profile"), "{missing}");
        let junk = dir.path().join("junk.sqlite");
        std::fs::write(&junk, vec![b'x'; 5000]).unwrap();
        let e = Profile::open(&junk).unwrap_err();
        assert!(e.to_string().contains("is not a torchmem profile"), "{e}");
        let other = dir.path().join("other.sqlite");
        Connection::open(&other).unwrap().execute_batch("CREATE TABLE t(x)").unwrap();
        let e = Profile::open(&other).unwrap_err();
        assert!(e.to_string().contains("format marker"), "{e}");
    }

    fn v1_fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/profile_v1.sqlite")
    }

    /// Σ end − Σ start of a phase's markers, straight from SQL (the spans of one name never overlap there).
    fn sql_phase_total_ns(path: &Path, name: &str) -> (i64, i64) {
        let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
        conn.query_row(
            "SELECT sum(CASE edge WHEN 'end' THEN t_ns ELSE -t_ns END), sum(edge = 'end') FROM markers WHERE kind = 'phase' AND name = ?1",
            [name],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap()
    }

    #[test]
    fn reads_the_v1_fixture_made_before_identity() {
        // A copy: opening may replay the WAL into the file.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.sqlite");
        std::fs::copy(v1_fixture(), &path).unwrap();
        let p = Profile::open(&path).unwrap();
        assert_eq!(p.schema_version, 1);
        assert!(p.markers.iter().all(|m| m.origin == Origin::default() && m.device.is_none()));
        assert!(p.aggregates.is_empty(), "6 occurrences of each phase are under the default keep");
        let s = crate::analysis::Summary::from_profile(&p);
        assert_eq!(s.epochs.len(), 2);
        assert_eq!(s.epochs.iter().map(|e| e.steps).collect::<Vec<_>>(), [Some(3), Some(3)]);
        assert_eq!(s.steps, 6);
        let forward = s.phases.iter().find(|r| r.name == "forward").unwrap();
        let (total, count) = sql_phase_total_ns(&path, "forward");
        assert_eq!((forward.total_ns as i64, forward.count as i64), (total, count));
    }

    fn v2_fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/profile_v2.sqlite")
    }

    #[test]
    fn reads_the_v2_fixture_with_every_blob_kind_of_a_cpu_run() {
        // Made by the last v2 writer (tests/fixtures/profile_v2.py): identity, vmhwm, leaks, oom, a blob name
        // no torchmem knows, and a line profile.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v2.sqlite");
        std::fs::copy(v2_fixture(), &path).unwrap();
        let p = Profile::open(&path).unwrap();
        assert_eq!(p.schema_version, 2);
        let pid = p.markers[0].origin.pid.expect("v2 markers carry their identity");
        assert!(p.markers.iter().all(|m| m.origin.pid == Some(pid)));
        let s = crate::analysis::Summary::from_profile(&p);
        assert_eq!(s.epochs.iter().map(|e| e.steps).collect::<Vec<_>>(), [Some(20), Some(20)]);
        assert_eq!(s.leaks.len(), 1, "the leak probe's finding: {:?}", s.leaks);
        assert_eq!((s.leaks[0].line, s.leaks[0].kind.as_str()), (23, "CPU tensor"));
        let peaks = crate::report::cells::kernel_peaks(&p);
        assert!(peaks[&pid] > 100 << 20, "{peaks:?}");
        let lines = &p.line_profiles;
        assert_eq!(lines[0].functions[0].name, "train_step");
        assert!(lines[0].functions[0].lines.iter().any(|l| l.hits == 23));
        let names: Vec<&str> = p.blobs.iter().map(|b| b.name()).collect();
        assert!(names.contains(&"oom") && names.contains(&"identity"), "{names:?}");
        assert!(names.contains(&"future_kind"), "an unknown blob stays readable: {names:?}");
        // Every blob of a known name reads as its kind; the unknown one stays as it was.
        for b in &p.blobs {
            match b {
                Blob::Other { name, data } => {
                    assert_eq!((name.as_str(), data), ("future_kind", &serde_json::json!({"anything": [1, 2]})))
                }
                Blob::Oom(o) => assert_eq!((o.pid, o.requested_bytes), (pid, Some(2 << 30))),
                Blob::Identity(i) => assert!(i.origin.pid.is_some()),
                Blob::Leaks(l) => assert_eq!((l.pid, l.report.findings.len()), (Some(pid), 1)),
                Blob::Vmhwm(v) => assert!(v.pids.contains_key(&pid)),
                other => panic!("not in the fixture: {other:?}"),
            }
        }
        assert_eq!(p.blob_origins.len(), p.blobs.len());
        assert!(p.blob_origins.iter().all(|o| *o == Origin::default()), "v2 blobs have no sender columns");
        assert_eq!(lines[0].python.as_deref().map(|v| v.starts_with('3')), Some(true));
    }

    #[test]
    fn a_v1_file_of_many_markers_loads_folded_with_exact_totals() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.sqlite");
        std::fs::copy(v1_fixture(), &path).unwrap();
        {
            let conn = Connection::open(&path).unwrap();
            let t0: i64 = conn.query_row("SELECT max(t_ns) FROM markers", [], |r| r.get(0)).unwrap();
            let tx = conn.unchecked_transaction().unwrap();
            for i in 0..5000i64 {
                let t = t0 + 1000 + i * 100;
                for (dt, edge, rss) in [(0, "start", 1000 + i), (7 + i % 5, "end", 1010 + i)] {
                    tx.execute(
                        "INSERT INTO markers (t_ns, kind, edge, name, rss_bytes) VALUES (?1, 'phase', ?2, 'late', ?3)",
                        params![t + dt, edge, rss],
                    )
                    .unwrap();
                }
            }
            tx.commit().unwrap();
        }
        let p = Profile::open(&path).unwrap();
        let late = p.markers.iter().filter(|m| m.name == "late").count() as u64;
        assert_eq!(late, 2 * crate::fold::DEFAULT_KEEP_SPANS, "only the first occurrences stay markers");
        let s = crate::analysis::Summary::from_profile(&p);
        let row = s.phases.iter().find(|r| r.name == "late").unwrap();
        let (total, count) = sql_phase_total_ns(&path, "late");
        assert_eq!((row.total_ns as i64, row.count as i64), (total, count));
        assert_eq!(row.mean_delta_rss_bytes, Some(10));
    }

    #[test]
    fn identity_devices_and_aggregates_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sqlite");
        let mut w = ProfileWriter::create(&path, &meta()).unwrap();
        let origin = Origin { pid: Some(41), rank: Some(1), local_rank: Some(0), world_size: Some(2) };
        w.push(Record::Marker(Marker {
            memory: MarkerMemory { rss_bytes: Some(900 << 20), held_rss_bytes: Some(700 << 20), ..Default::default() },
            origin,
            device: Some(1),
            ..Marker::new(3, MarkerKind::Phase, Edge::Start, "forward")
        }));
        let mut row = SpanAggregate {
            origin,
            kind: MarkerKind::Phase,
            name: "forward".into(),
            epoch: Some(2),
            device: Some(1),
            totals: SpanTotals {
                count: 5,
                total_ns: 50,
                min_ns: Some(9),
                max_ns: Some(11),
                delta_allocated_sum_bytes: -4,
                delta_allocated_count: 5,
                peak_allocated_bytes: Some(1 << 30),
                ..Default::default()
            },
            open_count: 0,
            first_start_t_ns: 10,
            last_end_t_ns: Some(99),
        };
        w.push(Record::Aggregate(row.clone()));
        w.flush().unwrap();
        // A later commit replaces the row's totals.
        row.totals.count = 7;
        row.totals.total_ns = 70;
        w.push(Record::Aggregate(row.clone()));
        w.push(Record::LineProfile { t_ns: 4, origin, profile: Default::default() });
        w.flush().unwrap();
        drop(w);
        let p = Profile::open(&path).unwrap();
        assert_eq!(p.schema_version, SCHEMA_VERSION);
        assert_eq!((p.markers[0].origin, p.markers[0].device), (origin, Some(1)));
        // v4: the Monitor's RSS less malloc's free bytes is kept, so a profile's growth judges what it judged.
        assert_eq!(p.markers[0].memory.held_rss_bytes, Some(700 << 20));
        assert_eq!(p.aggregates, vec![row]);
        assert_eq!(p.line_profile_origins, vec![origin]);
    }

    #[test]
    fn the_reader_keeps_at_most_its_own_cap_of_markers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sqlite");
        let meta = RunMeta { keep_spans: Some(u64::MAX), ..meta() };
        let mut w = ProfileWriter::create(&path, &meta).unwrap();
        let n = crate::fold::MAX_KEEP_SPANS_READ + 500;
        for i in 0..n {
            for (dt, edge) in [(0, Edge::Start), (3, Edge::End)] {
                w.push(Record::Marker(Marker {
                    index: Some(i as i64),
                    ..Marker::new(i * 10 + dt, MarkerKind::Step, edge, "step")
                }));
            }
        }
        w.flush().unwrap();
        drop(w);
        let p = Profile::open(&path).unwrap();
        assert_eq!(p.markers.len() as u64, 2 * crate::fold::MAX_KEEP_SPANS_READ);
        let s = crate::analysis::Summary::from_profile(&p);
        assert_eq!(s.steps as u64, n);
    }

    #[test]
    fn a_newer_schema_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sqlite");
        drop(ProfileWriter::create(&path, &meta()).unwrap());
        Connection::open(&path)
            .unwrap()
            .execute("UPDATE meta SET value = '9' WHERE key = 'schema_version'", [])
            .unwrap();
        let e = Profile::open(&path).unwrap_err().to_string();
        assert!(e.contains("schema version 9") && e.contains("upgrade torchmem"), "{e}");
    }
}

#[cfg(test)]
mod breakdown_tests {
    //! The breakdown tables: round trip, files without them, and a long run folded to bounded size.
    use super::*;
    use crate::breakdown::Category;

    const MIB: u64 = 1 << 20;

    fn meta(keep: u64) -> RunMeta {
        RunMeta { command: vec!["python".into(), "t.py".into()], keep_spans: Some(keep), ..Default::default() }
    }

    fn cpu_entry(step: u64) -> DeviceBreakdown {
        DeviceBreakdown {
            device: "cpu".into(),
            parameters_bytes: Some(4 * MIB),
            gradients_bytes: Some(4 * MIB),
            optimizer_state_bytes: Some(8 * MIB),
            activations_bytes: Some(step * 1000),
            inputs_bytes: Some(64 * 1024),
            rss_bytes: Some(300 * MIB + step),
            by_module: crate::breakdown::ModuleBytes {
                parameters: [("encoder".to_string(), 3 * MIB), ("head".to_string(), MIB)].into(),
                gradients: [("encoder".to_string(), 3 * MIB)].into(),
            },
            by_param_group: vec![6 * MIB, 2 * MIB],
            ..Default::default()
        }
    }

    fn marker(t: u64, kind: MarkerKind, edge: Edge, name: &str, index: Option<i64>) -> Marker {
        Marker {
            index,
            memory: MarkerMemory { rss_bytes: Some(300 * MIB), ..Default::default() },
            origin: Origin { pid: Some(7), ..Default::default() },
            ..Marker::new(t, kind, edge, name)
        }
    }

    /// One step: start (with a breakdown), forward (its end with a breakdown and activations by module).
    fn step(i: u64) -> Vec<Marker> {
        let t = i * 100;
        let mut start = marker(t, MarkerKind::Step, Edge::Start, "step", Some(i as i64));
        start.breakdown = Some(vec![cpu_entry(i)]);
        let mut fwd_end = marker(t + 50, MarkerKind::Phase, Edge::End, "forward", None);
        fwd_end.breakdown = Some(vec![cpu_entry(i + 1)]);
        fwd_end.activations_by_module = Some([("encoder.0".to_string(), 1000 * (i + 1))].into());
        vec![
            start,
            marker(t + 1, MarkerKind::Phase, Edge::Start, "forward", None),
            fwd_end,
            marker(t + 60, MarkerKind::Step, Edge::End, "step", Some(i as i64)),
        ]
    }

    fn rows(path: &Path, table: &str) -> i64 {
        let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
        conn.query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0)).unwrap()
    }

    #[test]
    fn breakdowns_and_module_activations_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sqlite");
        let mut w = ProfileWriter::create(&path, &meta(100)).unwrap();
        let mut cuda = cpu_entry(0);
        cuda.device = "cuda:0".into();
        cuda.other_bytes = Some(-5);
        cuda.allocated_bytes = Some(40 * MIB);
        cuda.non_torch_bytes = Some(500 * MIB as i64);
        cuda.rss_bytes = None;
        cuda.activations_bytes = None; // not measured (a compiled model)
        let mut markers = step(0);
        markers[2].breakdown.as_mut().unwrap().push(cuda);
        for m in &markers {
            w.push(Record::Marker(m.clone()));
        }
        w.finish(Some(0), 1000).unwrap();
        let p = Profile::open(&path).unwrap();
        assert_eq!(p.markers, markers, "every field of every entry comes back");
        assert_eq!((rows(&path, "breakdowns"), rows(&path, "module_activations")), (3, 1));
        assert!(p.breakdown_aggregates.is_empty());
    }

    #[test]
    fn files_without_the_tables_read_as_no_breakdown() {
        // The v1 fixture (made before identity) and a v2 file written before the breakdown tables existed.
        let dir = tempfile::tempdir().unwrap();
        let v1 = dir.path().join("v1.sqlite");
        std::fs::copy(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/profile_v1.sqlite"), &v1)
            .unwrap();
        let old = dir.path().join("old_v2.sqlite");
        let mut w = ProfileWriter::create(&old, &meta(100)).unwrap();
        for m in step(0) {
            w.push(Record::Marker(Marker { breakdown: None, activations_by_module: None, ..m }));
        }
        w.finish(Some(0), 1000).unwrap();
        Connection::open(&old)
            .unwrap()
            .execute_batch("DROP TABLE breakdowns; DROP TABLE module_activations; DROP TABLE breakdown_aggregates;")
            .unwrap();
        for path in [v1, old] {
            let p = Profile::open(&path).unwrap();
            assert!(!p.markers.is_empty());
            assert!(p.markers.iter().all(|m| m.breakdown.is_none()) && p.breakdown_aggregates.is_empty());
            let s = crate::analysis::Summary::from_profile(&p);
            assert!(!s.breakdown.recorded, "{}", path.display());
            assert!(s.breakdown.hint.as_deref().unwrap().contains("torchmem.Monitor(model, optimizer)"));
        }
    }

    #[test]
    fn a_long_run_keeps_the_first_steps_rows_and_exact_aggregates() {
        // 10 000 steps through the recorder's path (fold, then write), 5 kept.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("long.sqlite");
        let keep = 5;
        let mut w = ProfileWriter::create(&path, &meta(keep)).unwrap();
        let mut folder = crate::fold::SpanFolder::new(keep);
        let n = 10_000u64;
        for i in 0..n {
            for m in step(i) {
                if let Some(kept) = folder.push(m) {
                    w.push(Record::Marker(kept));
                }
            }
            if i % 1000 == 999 {
                for row in folder.take_dirty_breakdowns() {
                    w.push(Record::BreakdownAggregate(row));
                }
                w.flush().unwrap();
            }
        }
        folder.finish();
        for row in folder.take_dirty_breakdowns() {
            w.push(Record::BreakdownAggregate(row));
        }
        w.finish(Some(0), n * 100).unwrap();
        // Bounded: 2 breakdown rows per kept step, one activation row per kept step, and per (boundary,
        // category) one aggregate row, however many times the recorder rewrote it.
        assert_eq!(rows(&path, "breakdowns"), 2 * keep as i64);
        assert_eq!(rows(&path, "module_activations"), keep as i64);
        let categories = 6; // parameters, gradients, optimizer state, activations, inputs, rss
        assert_eq!(rows(&path, "breakdown_aggregates"), 2 * categories);
        let p = Profile::open(&path).unwrap();
        let s = crate::analysis::Summary::from_profile(&p);
        let b = &s.breakdown;
        assert_eq!(b.folded_boundaries, 2 * (n - keep));
        let start = b.boundaries.iter().find(|r| r.boundary == "step start").unwrap();
        let fwd = b.boundaries.iter().find(|r| r.boundary == "end of forward").unwrap();
        assert_eq!((start.count, fwd.count), (n, n));
        // activations at step start = 1000·i, at the end of forward 1000·(i+1): exact means and maxes.
        let mean = |lo: u64| (lo..lo + n).map(|i| i * 1000).sum::<u64>() / n;
        assert_eq!(start.mean(Category::Activations), Some(mean(0)));
        assert_eq!(start.max(Category::Activations), Some((n - 1) * 1000));
        assert_eq!(fwd.mean(Category::Activations), Some(mean(1)));
        assert_eq!(fwd.max(Category::Rss), Some(300 * MIB + n));
        assert_eq!(start.mean(Category::Parameters), Some(4 * MIB));
        assert_eq!(b.timeline.len() as u64, 2 * keep, "the timeline holds the kept steps");
        assert_eq!(b.param_groups.len(), 2);
    }
}
