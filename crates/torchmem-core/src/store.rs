//! The profile file: one SQLite database per run (bundled SQLite, WAL journal).
//!
//! Crash safety: the recorder commits a batch every `flush` (about every 50 ms). A committed batch survives
//! the profiled program being killed, and the recorder itself being SIGKILLed: SQLite replays the WAL on the
//! next open. The file is plain SQLite, so `pandas.read_sql("select * from cpu_samples", sqlite3.connect(p))`
//! reads it as it is. Table and column names carry their unit (`_bytes`, `_ns`).

use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OpenFlags, OptionalExtension};

use crate::error::{CoreError, Result};
use crate::model::*;

pub const FORMAT_NAME: &str = "torchmem-profile";
pub const SCHEMA_VERSION: i64 = 1;

const SCHEMA: &str = "
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE cpu_samples (t_ns INTEGER NOT NULL, rss_bytes INTEGER NOT NULL, pss_bytes INTEGER,
    uss_bytes INTEGER, process_count INTEGER NOT NULL);
CREATE TABLE process_samples (t_ns INTEGER NOT NULL, pid INTEGER NOT NULL, rss_bytes INTEGER NOT NULL,
    pss_bytes INTEGER, uss_bytes INTEGER, gpu_bytes INTEGER);
CREATE TABLE processes (pid INTEGER PRIMARY KEY, ppid INTEGER NOT NULL, cmdline TEXT NOT NULL,
    first_t_ns INTEGER NOT NULL, last_t_ns INTEGER NOT NULL);
CREATE TABLE gpu_samples (t_ns INTEGER NOT NULL, device INTEGER NOT NULL, used_bytes INTEGER NOT NULL,
    total_bytes INTEGER NOT NULL, process_bytes INTEGER);
CREATE TABLE torch_samples (t_ns INTEGER NOT NULL, device INTEGER NOT NULL, allocated_bytes INTEGER NOT NULL,
    reserved_bytes INTEGER NOT NULL, peak_allocated_bytes INTEGER NOT NULL, peak_reserved_bytes INTEGER NOT NULL,
    active_bytes INTEGER NOT NULL, inactive_split_bytes INTEGER NOT NULL);
CREATE TABLE markers (t_ns INTEGER NOT NULL, kind TEXT NOT NULL, edge TEXT NOT NULL, name TEXT NOT NULL,
    idx INTEGER, rss_bytes INTEGER, allocated_bytes INTEGER, reserved_bytes INTEGER,
    peak_allocated_bytes INTEGER, peak_reserved_bytes INTEGER, peak_rss_bytes INTEGER);
CREATE TABLE line_profiles (t_ns INTEGER NOT NULL, data TEXT NOT NULL);
CREATE TABLE blobs (t_ns INTEGER NOT NULL, name TEXT NOT NULL, data TEXT NOT NULL);
";

/// Everything the recorder writes, in one enum so one channel carries it.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Cpu(CpuSample),
    Process(ProcessSample),
    ProcessSeen(ProcessInfo),
    Gpu(GpuSample),
    Torch(TorchSample),
    Marker(Marker),
    LineProfile { t_ns: u64, data: serde_json::Value },
    Blob { t_ns: u64, name: String, data: serde_json::Value },
}

pub struct ProfileWriter {
    conn: Connection,
    pending: Vec<Record>,
    path: PathBuf,
}

fn sql_u64(v: u64) -> i64 {
    v.min(i64::MAX as u64) as i64
}
fn sql_opt(v: Option<u64>) -> Option<i64> {
    v.map(sql_u64)
}

impl ProfileWriter {
    /// Creates a new profile (replacing a file of the same name) and writes the run's metadata.
    pub fn create(path: &Path, meta: &RunMeta) -> Result<Self> {
        for suffix in ["", "-wal", "-shm"] {
            let p = PathBuf::from(format!("{}{suffix}", path.display()));
            if p.exists() {
                std::fs::remove_file(&p)?;
            }
        }
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(SCHEMA)?;
        let w = ProfileWriter { conn, pending: Vec::new(), path: path.to_path_buf() };
        w.put_meta("format", FORMAT_NAME)?;
        w.put_meta("schema_version", &SCHEMA_VERSION.to_string())?;
        w.put_meta("run", &serde_json::to_string(meta)?)?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn put_meta(&self, key: &str, value: &str) -> Result<()> {
        self.conn.execute(
            "INSERT INTO meta(key, value) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            params![key, value],
        )?;
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
            let mut cpu = tx.prepare_cached("INSERT INTO cpu_samples VALUES (?1,?2,?3,?4,?5)")?;
            let mut proc_s = tx.prepare_cached("INSERT INTO process_samples VALUES (?1,?2,?3,?4,?5,?6)")?;
            let mut seen = tx.prepare_cached(
                "INSERT INTO processes VALUES (?1,?2,?3,?4,?5) ON CONFLICT(pid) DO UPDATE SET last_t_ns = excluded.last_t_ns, cmdline = CASE WHEN length(excluded.cmdline) > 0 THEN excluded.cmdline ELSE cmdline END",
            )?;
            let mut gpu = tx.prepare_cached("INSERT INTO gpu_samples VALUES (?1,?2,?3,?4,?5)")?;
            let mut torch = tx.prepare_cached("INSERT INTO torch_samples VALUES (?1,?2,?3,?4,?5,?6,?7,?8)")?;
            let mut marker = tx.prepare_cached("INSERT INTO markers VALUES (?1,?2,?3,?4,?5,?6,?7,?8,?9,?10,?11)")?;
            let mut lines = tx.prepare_cached("INSERT INTO line_profiles VALUES (?1,?2)")?;
            let mut blob = tx.prepare_cached("INSERT INTO blobs VALUES (?1,?2,?3)")?;
            for r in self.pending.drain(..) {
                match r {
                    Record::Cpu(s) => {
                        cpu.execute(params![
                            sql_u64(s.t_ns),
                            sql_u64(s.rss_bytes),
                            sql_opt(s.pss_bytes),
                            sql_opt(s.uss_bytes),
                            s.process_count
                        ])?;
                    }
                    Record::Process(s) => {
                        proc_s.execute(params![
                            sql_u64(s.t_ns),
                            s.pid,
                            sql_u64(s.rss_bytes),
                            sql_opt(s.pss_bytes),
                            sql_opt(s.uss_bytes),
                            sql_opt(s.gpu_bytes)
                        ])?;
                    }
                    Record::ProcessSeen(p) => {
                        seen.execute(params![p.pid, p.ppid, p.cmdline, sql_u64(p.first_t_ns), sql_u64(p.last_t_ns)])?;
                    }
                    Record::Gpu(s) => {
                        gpu.execute(params![
                            sql_u64(s.t_ns),
                            s.device,
                            sql_u64(s.used_bytes),
                            sql_u64(s.total_bytes),
                            sql_opt(s.process_bytes)
                        ])?;
                    }
                    Record::Torch(s) => {
                        torch.execute(params![
                            sql_u64(s.t_ns),
                            s.device,
                            sql_u64(s.allocated_bytes),
                            sql_u64(s.reserved_bytes),
                            sql_u64(s.peak_allocated_bytes),
                            sql_u64(s.peak_reserved_bytes),
                            sql_u64(s.active_bytes),
                            sql_u64(s.inactive_split_bytes)
                        ])?;
                    }
                    Record::Marker(m) => {
                        let mm = &m.memory;
                        marker.execute(params![
                            sql_u64(m.t_ns),
                            m.kind.as_str(),
                            m.edge.as_str(),
                            m.name,
                            m.index,
                            sql_opt(mm.rss_bytes),
                            sql_opt(mm.allocated_bytes),
                            sql_opt(mm.reserved_bytes),
                            sql_opt(mm.peak_allocated_bytes),
                            sql_opt(mm.peak_reserved_bytes),
                            sql_opt(mm.peak_rss_bytes)
                        ])?;
                    }
                    Record::LineProfile { t_ns, data } => {
                        lines.execute(params![sql_u64(t_ns), data.to_string()])?;
                    }
                    Record::Blob { t_ns, name, data } => {
                        blob.execute(params![sql_u64(t_ns), name, data.to_string()])?;
                    }
                }
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// Flushes and records how the run ended.
    pub fn finish(mut self, exit_code: Option<i32>, duration_ns: u64) -> Result<()> {
        self.flush()?;
        let mut meta = read_meta(&self.conn, &self.path)?;
        meta.exit_code = exit_code;
        meta.duration_ns = Some(duration_ns);
        self.put_meta("run", &serde_json::to_string(&meta)?)?;
        self.conn.pragma_update(None, "wal_checkpoint", "TRUNCATE").ok();
        Ok(())
    }
}

fn read_meta(conn: &Connection, path: &Path) -> Result<RunMeta> {
    let run: Option<String> =
        conn.query_row("SELECT value FROM meta WHERE key = 'run'", [], |r| r.get(0)).optional()?;
    let run = run.ok_or_else(|| CoreError::NotAProfile { path: path.into(), reason: "no run metadata".into() })?;
    serde_json::from_str(&run)
        .map_err(|e| CoreError::NotAProfile { path: path.into(), reason: format!("bad run metadata: {e}") })
}

/// A whole profile, loaded into memory for analysis and reports.
#[derive(Debug, Clone, Default)]
pub struct Profile {
    pub path: PathBuf,
    pub meta: RunMeta,
    pub cpu: Vec<CpuSample>,
    pub processes: Vec<ProcessInfo>,
    pub process_samples: Vec<ProcessSample>,
    pub gpu: Vec<GpuSample>,
    pub torch: Vec<TorchSample>,
    pub markers: Vec<Marker>,
    pub line_profiles: Vec<serde_json::Value>,
    pub blobs: Vec<(String, serde_json::Value)>,
}

fn get_u64(row: &rusqlite::Row, i: usize) -> rusqlite::Result<u64> {
    Ok(row.get::<_, i64>(i)?.max(0) as u64)
}
fn get_opt(row: &rusqlite::Row, i: usize) -> rusqlite::Result<Option<u64>> {
    Ok(row.get::<_, Option<i64>>(i)?.map(|v| v.max(0) as u64))
}

impl Profile {
    /// Opens and loads a profile. A missing file, a file that is not SQLite, and an SQLite file that is not a
    /// torchmem profile each get their own clear error. A profile whose recorder was killed opens fine.
    pub fn open(path: &Path) -> Result<Profile> {
        if !path.exists() {
            return Err(CoreError::ProfileMissing { path: path.into() });
        }
        let not_profile = |reason: String| CoreError::NotAProfile { path: path.into(), reason };
        let conn =
            Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX)
                .map_err(|e| not_profile(e.to_string()))?;
        let has_meta: i64 = conn
            .query_row("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'meta'", [], |r| r.get(0))
            .map_err(|e| not_profile(format!("{e}; the file is damaged or not SQLite")))?;
        if has_meta == 0 {
            return Err(not_profile("SQLite file without torchmem's format marker".into()));
        }
        let format: Option<String> = conn
            .query_row("SELECT value FROM meta WHERE key = 'format'", [], |r| r.get(0))
            .optional()
            .map_err(|e| CoreError::DamagedProfile { path: path.into(), reason: e.to_string() })?;
        if format.as_deref() != Some(FORMAT_NAME) {
            return Err(not_profile("SQLite file without torchmem's format marker".into()));
        }
        let meta = read_meta(&conn, path)?;
        let load = || -> rusqlite::Result<Profile> {
            let mut p = Profile { path: path.into(), meta: meta.clone(), ..Default::default() };
            let mut st = conn.prepare(
                "SELECT t_ns, rss_bytes, pss_bytes, uss_bytes, process_count FROM cpu_samples ORDER BY t_ns",
            )?;
            p.cpu = st
                .query_map([], |r| {
                    Ok(CpuSample {
                        t_ns: get_u64(r, 0)?,
                        rss_bytes: get_u64(r, 1)?,
                        pss_bytes: get_opt(r, 2)?,
                        uss_bytes: get_opt(r, 3)?,
                        process_count: r.get(4)?,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            let mut st = conn
                .prepare("SELECT pid, ppid, cmdline, first_t_ns, last_t_ns FROM processes ORDER BY first_t_ns, pid")?;
            p.processes = st
                .query_map([], |r| {
                    Ok(ProcessInfo {
                        pid: r.get(0)?,
                        ppid: r.get(1)?,
                        cmdline: r.get(2)?,
                        first_t_ns: get_u64(r, 3)?,
                        last_t_ns: get_u64(r, 4)?,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            let mut st = conn.prepare(
                "SELECT t_ns, pid, rss_bytes, pss_bytes, uss_bytes, gpu_bytes FROM process_samples ORDER BY t_ns, pid",
            )?;
            p.process_samples = st
                .query_map([], |r| {
                    Ok(ProcessSample {
                        t_ns: get_u64(r, 0)?,
                        pid: r.get(1)?,
                        rss_bytes: get_u64(r, 2)?,
                        pss_bytes: get_opt(r, 3)?,
                        uss_bytes: get_opt(r, 4)?,
                        gpu_bytes: get_opt(r, 5)?,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            let mut st = conn.prepare(
                "SELECT t_ns, device, used_bytes, total_bytes, process_bytes FROM gpu_samples ORDER BY t_ns, device",
            )?;
            p.gpu = st
                .query_map([], |r| {
                    Ok(GpuSample {
                        t_ns: get_u64(r, 0)?,
                        device: r.get(1)?,
                        used_bytes: get_u64(r, 2)?,
                        total_bytes: get_u64(r, 3)?,
                        process_bytes: get_opt(r, 4)?,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            let mut st = conn.prepare(
                "SELECT t_ns, device, allocated_bytes, reserved_bytes, peak_allocated_bytes, peak_reserved_bytes, active_bytes, inactive_split_bytes FROM torch_samples ORDER BY t_ns, device",
            )?;
            p.torch = st
                .query_map([], |r| {
                    Ok(TorchSample {
                        t_ns: get_u64(r, 0)?,
                        device: r.get(1)?,
                        allocated_bytes: get_u64(r, 2)?,
                        reserved_bytes: get_u64(r, 3)?,
                        peak_allocated_bytes: get_u64(r, 4)?,
                        peak_reserved_bytes: get_u64(r, 5)?,
                        active_bytes: get_u64(r, 6)?,
                        inactive_split_bytes: get_u64(r, 7)?,
                    })
                })?
                .collect::<rusqlite::Result<_>>()?;
            let mut st = conn.prepare(
                "SELECT t_ns, kind, edge, name, idx, rss_bytes, allocated_bytes, reserved_bytes, peak_allocated_bytes, peak_reserved_bytes, peak_rss_bytes FROM markers ORDER BY t_ns, rowid",
            )?;
            // Sized up front: a million-step run has millions of markers, and a growing Vec would briefly
            // hold two copies of them.
            let count: i64 = conn.query_row("SELECT count(*) FROM markers", [], |r| r.get(0))?;
            p.markers = Vec::with_capacity(count.max(0) as usize);
            let rows = st.query_map([], |r| {
                let kind: String = r.get(1)?;
                let edge: String = r.get(2)?;
                Ok(Marker {
                    t_ns: get_u64(r, 0)?,
                    kind: MarkerKind::parse(&kind).unwrap_or(MarkerKind::Mark),
                    edge: Edge::parse(&edge).unwrap_or(Edge::Point),
                    name: r.get(3)?,
                    index: r.get(4)?,
                    memory: MarkerMemory {
                        rss_bytes: get_opt(r, 5)?,
                        allocated_bytes: get_opt(r, 6)?,
                        reserved_bytes: get_opt(r, 7)?,
                        peak_allocated_bytes: get_opt(r, 8)?,
                        peak_reserved_bytes: get_opt(r, 9)?,
                        peak_rss_bytes: get_opt(r, 10)?,
                    },
                })
            })?;
            for row in rows {
                p.markers.push(row?);
            }
            let mut st = conn.prepare("SELECT data FROM line_profiles ORDER BY t_ns, rowid")?;
            let texts: Vec<String> = st.query_map([], |r| r.get(0))?.collect::<rusqlite::Result<_>>()?;
            p.line_profiles = texts.iter().filter_map(|t| serde_json::from_str(t).ok()).collect();
            let mut st = conn.prepare("SELECT name, data FROM blobs ORDER BY t_ns, rowid")?;
            let rows: Vec<(String, String)> =
                st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<rusqlite::Result<_>>()?;
            p.blobs = rows.into_iter().filter_map(|(n, t)| Some((n, serde_json::from_str(&t).ok()?))).collect();
            Ok(p)
        };
        load().map_err(|e| CoreError::DamagedProfile { path: path.into(), reason: e.to_string() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        }));
        w.push(Record::Marker(Marker {
            t_ns: 3,
            kind: MarkerKind::Epoch,
            edge: Edge::Start,
            name: "epoch".into(),
            index: Some(0),
            memory: MarkerMemory { rss_bytes: Some(7), ..Default::default() },
        }));
        w.push(Record::Blob { t_ns: 4, name: "x".into(), data: serde_json::json!({"a": 1}) });
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
        assert_eq!(p.blobs[0].1["a"], 1);
    }

    #[test]
    fn unfinished_profile_is_readable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.sqlite");
        let mut w = ProfileWriter::create(&path, &meta()).unwrap();
        w.push(Record::Cpu(CpuSample { t_ns: 1, rss_bytes: 100, pss_bytes: None, uss_bytes: None, process_count: 1 }));
        w.flush().unwrap();
        std::mem::forget(w); // as if the recorder died: no finish, WAL not checkpointed
        let p = Profile::open(&path).unwrap();
        assert_eq!(p.cpu.len(), 1);
        assert_eq!(p.meta.exit_code, None);
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
}
