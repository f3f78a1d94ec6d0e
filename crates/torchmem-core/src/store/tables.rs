//! The profile's tables, one row definition each: its columns (name, SQL type, the schema version that added
//! it), how a row is written and how it is read, side by side, so a column is spelled in one place. `SCHEMA`,
//! the `INSERT`s and the `SELECT`s are made from these definitions (`create`, `insert`, `select`); a column
//! newer than a file reads as NULL there (a v1 file has no identity columns).

use rusqlite::types::ToSql;
use rusqlite::{CachedStatement, Row};

use crate::breakdown::{Category, CategoryStat};
use crate::lines::LineProfile;
use crate::model::*;
use crate::record::Blob;

/// One column: its name, its SQL type and constraints, and the schema version that added it.
pub(super) struct Col {
    pub name: &'static str,
    pub sql: &'static str,
    pub since: i64,
}

const fn col(name: &'static str, sql: &'static str) -> Col {
    Col { name, sql, since: 1 }
}

const fn col_since(since: i64, name: &'static str, sql: &'static str) -> Col {
    Col { name, sql, since }
}

/// The identity columns (added by v2 where a table has them).
macro_rules! origin_cols {
    ($since:expr) => {
        [
            col_since($since, "pid", "INTEGER"),
            col_since($since, "rank", "INTEGER"),
            col_since($since, "local_rank", "INTEGER"),
            col_since($since, "world_size", "INTEGER"),
        ]
    };
}

/// One table: its name, columns, extra SQL after its `CREATE TABLE` (indexes), and its row's write and read.
pub(super) trait Table {
    /// What one row holds.
    type Row;
    const NAME: &'static str;
    const COLUMNS: &'static [Col];
    /// SQL run after the table is created (its indexes), or "".
    const AFTER_CREATE: &'static str = "";
    /// Appended to the `INSERT` (an upsert's `ON CONFLICT` clause), or "".
    const ON_CONFLICT: &'static str = "";

    fn write(st: &mut CachedStatement<'_>, row: &Self::Row) -> rusqlite::Result<()>;
    /// Reads a row of `select`'s columns (in `COLUMNS` order, from index 0).
    fn read(r: &Row<'_>) -> rusqlite::Result<Self::Row>;

    /// `CREATE TABLE …` (and `AFTER_CREATE`).
    fn create() -> String {
        let cols: Vec<String> = Self::COLUMNS.iter().map(|c| format!("{} {}", c.name, c.sql)).collect();
        format!("CREATE TABLE {} ({});\n{}", Self::NAME, cols.join(", "), Self::AFTER_CREATE)
    }

    /// `INSERT INTO … VALUES (?1, …)` with one parameter per column.
    fn insert() -> String {
        let params: Vec<String> = (1..=Self::COLUMNS.len()).map(|i| format!("?{i}")).collect();
        format!("INSERT INTO {} VALUES ({}){}", Self::NAME, params.join(","), Self::ON_CONFLICT)
    }

    /// `SELECT <every column> FROM …` for a file of schema `version` (NULL for a column it does not have),
    /// then `tail` (`ORDER BY …`; more columns go in `extra`, read after `COLUMNS`).
    fn select(version: i64, extra: &str, tail: &str) -> String {
        let cols: Vec<&str> = Self::COLUMNS.iter().map(|c| if c.since <= version { c.name } else { "NULL" }).collect();
        format!("SELECT {}{extra} FROM {} {tail}", cols.join(", "), Self::NAME)
    }
}

fn sql_u64(v: u64) -> i64 {
    v.min(i64::MAX as u64) as i64
}
fn sql_opt(v: Option<u64>) -> Option<i64> {
    v.map(sql_u64)
}
fn get_u64(row: &Row, i: usize) -> rusqlite::Result<u64> {
    Ok(row.get::<_, i64>(i)?.max(0) as u64)
}
fn get_opt(row: &Row, i: usize) -> rusqlite::Result<Option<u64>> {
    Ok(row.get::<_, Option<i64>>(i)?.map(|v| v.max(0) as u64))
}
fn get_origin(row: &Row, first: usize) -> rusqlite::Result<Origin> {
    Ok(Origin {
        pid: row.get(first)?,
        rank: row.get(first + 1)?,
        local_rank: row.get(first + 2)?,
        world_size: row.get(first + 3)?,
    })
}
fn json_column<T: serde::de::DeserializeOwned>(r: &Row, i: usize) -> rusqlite::Result<T> {
    let text: String = r.get(i)?;
    serde_json::from_str(&text)
        .map_err(|e| rusqlite::Error::FromSqlConversionFailure(i, rusqlite::types::Type::Text, Box::new(e)))
}
fn to_json_text<T: serde::Serialize>(v: &T) -> rusqlite::Result<String> {
    serde_json::to_string(v).map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))
}
fn exec(st: &mut CachedStatement<'_>, params: &[&dyn ToSql]) -> rusqlite::Result<()> {
    st.execute(params).map(|_| ())
}

/// The schema of a new file: every table, in this order.
pub(super) fn schema() -> String {
    [
        Meta::create(),
        CpuSamples::create(),
        ProcessSamples::create(),
        Processes::create(),
        GpuSamples::create(),
        TorchSamples::create(),
        Markers::create(),
        SpanAggregates::create(),
        LineProfiles::create(),
        Blobs::create(),
        Breakdowns::create(),
        ModuleActivations::create(),
        BreakdownAggregates::create(),
    ]
    .concat()
}

/// `meta`: the file's format marker, schema version and the run's metadata (`RunMeta` as JSON).
pub(super) struct Meta;
impl Table for Meta {
    type Row = (String, String);
    const NAME: &'static str = "meta";
    const COLUMNS: &'static [Col] = &[col("key", "TEXT PRIMARY KEY"), col("value", "TEXT NOT NULL")];
    const ON_CONFLICT: &'static str = " ON CONFLICT(key) DO UPDATE SET value = excluded.value";
    fn write(st: &mut CachedStatement<'_>, (k, v): &Self::Row) -> rusqlite::Result<()> {
        exec(st, &[k, v])
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<Self::Row> {
        Ok((r.get(0)?, r.get(1)?))
    }
}

pub(super) struct CpuSamples;
impl Table for CpuSamples {
    type Row = CpuSample;
    const NAME: &'static str = "cpu_samples";
    const COLUMNS: &'static [Col] = &[
        col("t_ns", "INTEGER NOT NULL"),
        col("rss_bytes", "INTEGER NOT NULL"),
        col("pss_bytes", "INTEGER"),
        col("uss_bytes", "INTEGER"),
        col("process_count", "INTEGER NOT NULL"),
    ];
    fn write(st: &mut CachedStatement<'_>, s: &CpuSample) -> rusqlite::Result<()> {
        exec(
            st,
            &[&sql_u64(s.t_ns), &sql_u64(s.rss_bytes), &sql_opt(s.pss_bytes), &sql_opt(s.uss_bytes), &s.process_count],
        )
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<CpuSample> {
        Ok(CpuSample {
            t_ns: get_u64(r, 0)?,
            rss_bytes: get_u64(r, 1)?,
            pss_bytes: get_opt(r, 2)?,
            uss_bytes: get_opt(r, 3)?,
            process_count: r.get(4)?,
        })
    }
}

pub(super) struct ProcessSamples;
impl Table for ProcessSamples {
    type Row = ProcessSample;
    const NAME: &'static str = "process_samples";
    const COLUMNS: &'static [Col] = &[
        col("t_ns", "INTEGER NOT NULL"),
        col("pid", "INTEGER NOT NULL"),
        col("rss_bytes", "INTEGER NOT NULL"),
        col("pss_bytes", "INTEGER"),
        col("uss_bytes", "INTEGER"),
        col("gpu_bytes", "INTEGER"),
    ];
    fn write(st: &mut CachedStatement<'_>, s: &ProcessSample) -> rusqlite::Result<()> {
        exec(
            st,
            &[
                &sql_u64(s.t_ns),
                &s.pid,
                &sql_u64(s.rss_bytes),
                &sql_opt(s.pss_bytes),
                &sql_opt(s.uss_bytes),
                &sql_opt(s.gpu_bytes),
            ],
        )
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<ProcessSample> {
        Ok(ProcessSample {
            t_ns: get_u64(r, 0)?,
            pid: r.get(1)?,
            rss_bytes: get_u64(r, 2)?,
            pss_bytes: get_opt(r, 3)?,
            uss_bytes: get_opt(r, 4)?,
            gpu_bytes: get_opt(r, 5)?,
        })
    }
}

/// `processes`: one row per process of the tree (an upsert: its last time moves, a late cmdline fills in).
pub(super) struct Processes;
impl Table for Processes {
    type Row = ProcessInfo;
    const NAME: &'static str = "processes";
    const COLUMNS: &'static [Col] = &[
        col("pid", "INTEGER PRIMARY KEY"),
        col("ppid", "INTEGER NOT NULL"),
        col("cmdline", "TEXT NOT NULL"),
        col("first_t_ns", "INTEGER NOT NULL"),
        col("last_t_ns", "INTEGER NOT NULL"),
    ];
    const ON_CONFLICT: &'static str = " ON CONFLICT(pid) DO UPDATE SET last_t_ns = excluded.last_t_ns, cmdline = CASE WHEN length(excluded.cmdline) > 0 THEN excluded.cmdline ELSE cmdline END";
    fn write(st: &mut CachedStatement<'_>, p: &ProcessInfo) -> rusqlite::Result<()> {
        exec(st, &[&p.pid, &p.ppid, &p.cmdline, &sql_u64(p.first_t_ns), &sql_u64(p.last_t_ns)])
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<ProcessInfo> {
        Ok(ProcessInfo {
            pid: r.get(0)?,
            ppid: r.get(1)?,
            cmdline: r.get(2)?,
            first_t_ns: get_u64(r, 3)?,
            last_t_ns: get_u64(r, 4)?,
        })
    }
}

pub(super) struct GpuSamples;
impl Table for GpuSamples {
    type Row = GpuSample;
    const NAME: &'static str = "gpu_samples";
    const COLUMNS: &'static [Col] = &[
        col("t_ns", "INTEGER NOT NULL"),
        col("device", "INTEGER NOT NULL"),
        col("used_bytes", "INTEGER NOT NULL"),
        col("total_bytes", "INTEGER NOT NULL"),
        col("process_bytes", "INTEGER"),
    ];
    fn write(st: &mut CachedStatement<'_>, s: &GpuSample) -> rusqlite::Result<()> {
        exec(
            st,
            &[&sql_u64(s.t_ns), &s.device, &sql_u64(s.used_bytes), &sql_u64(s.total_bytes), &sql_opt(s.process_bytes)],
        )
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<GpuSample> {
        Ok(GpuSample {
            t_ns: get_u64(r, 0)?,
            device: r.get(1)?,
            used_bytes: get_u64(r, 2)?,
            total_bytes: get_u64(r, 3)?,
            process_bytes: get_opt(r, 4)?,
        })
    }
}

const TORCH_COLUMNS: [Col; 12] = {
    let [pid, rank, local_rank, world_size] = origin_cols!(2);
    [
        col("t_ns", "INTEGER NOT NULL"),
        col("device", "INTEGER NOT NULL"),
        col("allocated_bytes", "INTEGER NOT NULL"),
        col("reserved_bytes", "INTEGER NOT NULL"),
        col("peak_allocated_bytes", "INTEGER NOT NULL"),
        col("peak_reserved_bytes", "INTEGER NOT NULL"),
        col("active_bytes", "INTEGER NOT NULL"),
        col("inactive_split_bytes", "INTEGER NOT NULL"),
        pid,
        rank,
        local_rank,
        world_size,
    ]
};

pub(super) struct TorchSamples;
impl Table for TorchSamples {
    type Row = TorchSample;
    const NAME: &'static str = "torch_samples";
    const COLUMNS: &'static [Col] = &TORCH_COLUMNS;
    fn write(st: &mut CachedStatement<'_>, s: &TorchSample) -> rusqlite::Result<()> {
        let o = &s.origin;
        exec(
            st,
            &[
                &sql_u64(s.t_ns),
                &s.device,
                &sql_u64(s.allocated_bytes),
                &sql_u64(s.reserved_bytes),
                &sql_u64(s.peak_allocated_bytes),
                &sql_u64(s.peak_reserved_bytes),
                &sql_u64(s.active_bytes),
                &sql_u64(s.inactive_split_bytes),
                &o.pid,
                &o.rank,
                &o.local_rank,
                &o.world_size,
            ],
        )
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<TorchSample> {
        Ok(TorchSample {
            t_ns: get_u64(r, 0)?,
            device: r.get(1)?,
            allocated_bytes: get_u64(r, 2)?,
            reserved_bytes: get_u64(r, 3)?,
            peak_allocated_bytes: get_u64(r, 4)?,
            peak_reserved_bytes: get_u64(r, 5)?,
            active_bytes: get_u64(r, 6)?,
            inactive_split_bytes: get_u64(r, 7)?,
            origin: get_origin(r, 8)?,
        })
    }
}

const MARKER_COLUMNS: [Col; 17] = {
    let [pid, rank, local_rank, world_size] = origin_cols!(2);
    [
        col("t_ns", "INTEGER NOT NULL"),
        col("kind", "TEXT NOT NULL"),
        col("edge", "TEXT NOT NULL"),
        col("name", "TEXT NOT NULL"),
        col("idx", "INTEGER"),
        col("rss_bytes", "INTEGER"),
        col("allocated_bytes", "INTEGER"),
        col("reserved_bytes", "INTEGER"),
        col("peak_allocated_bytes", "INTEGER"),
        col("peak_reserved_bytes", "INTEGER"),
        col("peak_rss_bytes", "INTEGER"),
        pid,
        rank,
        local_rank,
        world_size,
        col_since(2, "device", "INTEGER"),
        col_since(4, "held_rss_bytes", "INTEGER"),
    ]
};

/// `markers`: the kept markers; a marker's breakdown rows (`Breakdowns`, `ModuleActivations`) point at its
/// `rowid`, which a read selects after the columns.
pub(super) struct Markers;
impl Table for Markers {
    type Row = Marker;
    const NAME: &'static str = "markers";
    const COLUMNS: &'static [Col] = &MARKER_COLUMNS;
    fn write(st: &mut CachedStatement<'_>, m: &Marker) -> rusqlite::Result<()> {
        let (mm, o) = (&m.memory, &m.origin);
        exec(
            st,
            &[
                &sql_u64(m.t_ns),
                &m.kind.as_str(),
                &m.edge.as_str(),
                &m.name,
                &m.index,
                &sql_opt(mm.rss_bytes),
                &sql_opt(mm.allocated_bytes),
                &sql_opt(mm.reserved_bytes),
                &sql_opt(mm.peak_allocated_bytes),
                &sql_opt(mm.peak_reserved_bytes),
                &sql_opt(mm.peak_rss_bytes),
                &o.pid,
                &o.rank,
                &o.local_rank,
                &o.world_size,
                &m.device,
                &sql_opt(mm.held_rss_bytes),
            ],
        )
    }
    /// The marker without its breakdown (joined by the loader through the rowid).
    fn read(r: &Row<'_>) -> rusqlite::Result<Marker> {
        let kind = MarkerKind::parse(r.get_ref(1)?.as_str()?).unwrap_or(MarkerKind::Mark);
        let edge = Edge::parse(r.get_ref(2)?.as_str()?).unwrap_or(Edge::Point);
        Ok(Marker {
            t_ns: get_u64(r, 0)?,
            kind,
            edge,
            name: r.get(3)?,
            index: r.get(4)?,
            memory: MarkerMemory {
                rss_bytes: get_opt(r, 5)?,
                allocated_bytes: get_opt(r, 6)?,
                reserved_bytes: get_opt(r, 7)?,
                peak_allocated_bytes: get_opt(r, 8)?,
                peak_reserved_bytes: get_opt(r, 9)?,
                peak_rss_bytes: get_opt(r, 10)?,
                held_rss_bytes: get_opt(r, 16)?,
            },
            origin: get_origin(r, 11)?,
            device: r.get(15)?,
            breakdown: None,
            activations_by_module: None,
        })
    }
}

const AGGREGATE_COLUMNS: [Col; 22] = {
    let [pid, rank, local_rank, world_size] = origin_cols!(2);
    [
        pid,
        rank,
        local_rank,
        world_size,
        col("kind", "TEXT NOT NULL"),
        col("name", "TEXT NOT NULL"),
        col("epoch", "INTEGER"),
        col("device", "INTEGER"),
        col("count", "INTEGER NOT NULL"),
        col("open_count", "INTEGER NOT NULL"),
        col("total_ns", "INTEGER NOT NULL"),
        col("min_ns", "INTEGER"),
        col("max_ns", "INTEGER"),
        col("delta_allocated_sum_bytes", "INTEGER NOT NULL"),
        col("delta_allocated_count", "INTEGER NOT NULL"),
        col("delta_rss_sum_bytes", "INTEGER NOT NULL"),
        col("delta_rss_count", "INTEGER NOT NULL"),
        col("peak_allocated_bytes", "INTEGER"),
        col("peak_reserved_bytes", "INTEGER"),
        col("peak_rss_bytes", "INTEGER"),
        col("first_start_t_ns", "INTEGER NOT NULL"),
        col("last_end_t_ns", "INTEGER"),
    ]
};

/// `span_aggregates` (v2): one row per folded span key; a later row of the same key replaces it (`DELETE`).
pub(super) struct SpanAggregates;
impl SpanAggregates {
    pub const DELETE: &'static str = "DELETE FROM span_aggregates WHERE pid IS ?1 AND rank IS ?2 AND kind = ?3 AND name = ?4 AND epoch IS ?5 AND device IS ?6";
    pub fn delete(st: &mut CachedStatement<'_>, a: &SpanAggregate) -> rusqlite::Result<()> {
        exec(st, &[&a.origin.pid, &a.origin.rank, &a.kind.as_str(), &a.name, &a.epoch, &a.device])
    }
}
impl Table for SpanAggregates {
    type Row = SpanAggregate;
    const NAME: &'static str = "span_aggregates";
    const COLUMNS: &'static [Col] = &AGGREGATE_COLUMNS;
    const AFTER_CREATE: &'static str = "CREATE INDEX span_aggregates_by_name ON span_aggregates (kind, name);\n";
    fn write(st: &mut CachedStatement<'_>, a: &SpanAggregate) -> rusqlite::Result<()> {
        let o = &a.origin;
        exec(
            st,
            &[
                &o.pid,
                &o.rank,
                &o.local_rank,
                &o.world_size,
                &a.kind.as_str(),
                &a.name,
                &a.epoch,
                &a.device,
                &sql_u64(a.totals.count),
                &sql_u64(a.open_count),
                &sql_u64(a.totals.total_ns),
                &sql_opt(a.totals.min_ns),
                &sql_opt(a.totals.max_ns),
                &a.totals.delta_allocated_sum_bytes,
                &sql_u64(a.totals.delta_allocated_count),
                &a.totals.delta_rss_sum_bytes,
                &sql_u64(a.totals.delta_rss_count),
                &sql_opt(a.totals.peak_allocated_bytes),
                &sql_opt(a.totals.peak_reserved_bytes),
                &sql_opt(a.totals.peak_rss_bytes),
                &sql_u64(a.first_start_t_ns),
                &sql_opt(a.last_end_t_ns),
            ],
        )
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<SpanAggregate> {
        let kind: String = r.get(4)?;
        Ok(SpanAggregate {
            origin: get_origin(r, 0)?,
            kind: MarkerKind::parse(&kind).unwrap_or(MarkerKind::Phase),
            name: r.get(5)?,
            epoch: r.get(6)?,
            device: r.get(7)?,
            totals: SpanTotals {
                count: get_u64(r, 8)?,
                total_ns: get_u64(r, 10)?,
                min_ns: get_opt(r, 11)?,
                max_ns: get_opt(r, 12)?,
                delta_allocated_sum_bytes: r.get(13)?,
                delta_allocated_count: get_u64(r, 14)?,
                delta_rss_sum_bytes: r.get(15)?,
                delta_rss_count: get_u64(r, 16)?,
                peak_allocated_bytes: get_opt(r, 17)?,
                peak_reserved_bytes: get_opt(r, 18)?,
                peak_rss_bytes: get_opt(r, 19)?,
            },
            open_count: get_u64(r, 9)?,
            first_start_t_ns: get_u64(r, 20)?,
            last_end_t_ns: get_opt(r, 21)?,
        })
    }
}

/// One stored side record (`blobs`) or line profile (`line_profiles`): when, who sent it, and what. `what` is
/// None where the stored text is not JSON (or, for a line profile, not one): skipped by the loader.
pub(super) struct Sent<T> {
    pub t_ns: u64,
    pub origin: Origin,
    pub what: Option<T>,
}

const LINE_COLUMNS: [Col; 6] = {
    let [pid, rank, local_rank, world_size] = origin_cols!(2);
    [col("t_ns", "INTEGER NOT NULL"), col("data", "TEXT NOT NULL"), pid, rank, local_rank, world_size]
};

/// `line_profiles`: the line profiler's tables (`lines::LineProfile` as JSON) and who sent them.
pub(super) struct LineProfiles;
impl Table for LineProfiles {
    type Row = Sent<LineProfile>;
    const NAME: &'static str = "line_profiles";
    const COLUMNS: &'static [Col] = &LINE_COLUMNS;
    fn write(st: &mut CachedStatement<'_>, s: &Self::Row) -> rusqlite::Result<()> {
        let o = &s.origin;
        let data = to_json_text(&s.what)?;
        exec(st, &[&sql_u64(s.t_ns), &data, &o.pid, &o.rank, &o.local_rank, &o.world_size])
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<Self::Row> {
        let text: String = r.get(1)?;
        Ok(Sent { t_ns: get_u64(r, 0)?, origin: get_origin(r, 2)?, what: serde_json::from_str(&text).ok() })
    }
}

const BLOB_COLUMNS: [Col; 7] = {
    let [pid, rank, local_rank, world_size] = origin_cols!(3);
    [
        col("t_ns", "INTEGER NOT NULL"),
        col("name", "TEXT NOT NULL"),
        col("data", "TEXT NOT NULL"),
        pid,
        rank,
        local_rank,
        world_size,
    ]
};

/// `blobs`: the typed side records (`record::Blob`) as their name and JSON, and (v3) who sent them.
pub(super) struct Blobs;
impl Table for Blobs {
    type Row = Sent<Blob>;
    const NAME: &'static str = "blobs";
    const COLUMNS: &'static [Col] = &BLOB_COLUMNS;
    fn write(st: &mut CachedStatement<'_>, s: &Self::Row) -> rusqlite::Result<()> {
        let o = &s.origin;
        let (name, data) = match &s.what {
            Some(b) => (b.name(), b.data().to_string()),
            None => return Ok(()),
        };
        exec(st, &[&sql_u64(s.t_ns), &name, &data, &o.pid, &o.rank, &o.local_rank, &o.world_size])
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<Self::Row> {
        let (name, text): (String, String) = (r.get(1)?, r.get(2)?);
        let what = serde_json::from_str(&text).ok().map(|data| Blob::from_parts(name, data));
        Ok(Sent { t_ns: get_u64(r, 0)?, origin: get_origin(r, 3)?, what })
    }
}

/// `breakdowns` (later v2): one row per (kept marker, device), by the marker's rowid; the per-module and
/// per-param-group detail as JSON.
pub(super) struct Breakdowns;
impl Table for Breakdowns {
    type Row = (i64, DeviceBreakdown);
    const NAME: &'static str = "breakdowns";
    const COLUMNS: &'static [Col] = &[
        col("marker_rowid", "INTEGER NOT NULL"),
        col("device", "TEXT NOT NULL"),
        col("parameters_bytes", "INTEGER"),
        col("gradients_bytes", "INTEGER"),
        col("optimizer_state_bytes", "INTEGER"),
        col("activations_bytes", "INTEGER"),
        col("inputs_bytes", "INTEGER"),
        col("other_bytes", "INTEGER"),
        col("allocated_bytes", "INTEGER"),
        col("reserved_bytes", "INTEGER"),
        col("cache_bytes", "INTEGER"),
        col("non_torch_bytes", "INTEGER"),
        col("rss_bytes", "INTEGER"),
        col("by_module", "TEXT NOT NULL"),
        col("by_param_group", "TEXT NOT NULL"),
    ];
    const AFTER_CREATE: &'static str = "CREATE INDEX breakdowns_by_marker ON breakdowns (marker_rowid);\n";
    fn write(st: &mut CachedStatement<'_>, (rowid, b): &Self::Row) -> rusqlite::Result<()> {
        exec(
            st,
            &[
                rowid,
                &b.device,
                &sql_opt(b.parameters_bytes),
                &sql_opt(b.gradients_bytes),
                &sql_opt(b.optimizer_state_bytes),
                &sql_opt(b.activations_bytes),
                &sql_opt(b.inputs_bytes),
                &b.other_bytes,
                &sql_opt(b.allocated_bytes),
                &sql_opt(b.reserved_bytes),
                &sql_opt(b.cache_bytes),
                &b.non_torch_bytes,
                &sql_opt(b.rss_bytes),
                &to_json_text(&b.by_module)?,
                &to_json_text(&b.by_param_group)?,
            ],
        )
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<Self::Row> {
        let b = DeviceBreakdown {
            device: r.get(1)?,
            parameters_bytes: get_opt(r, 2)?,
            gradients_bytes: get_opt(r, 3)?,
            optimizer_state_bytes: get_opt(r, 4)?,
            activations_bytes: get_opt(r, 5)?,
            inputs_bytes: get_opt(r, 6)?,
            other_bytes: r.get(7)?,
            allocated_bytes: get_opt(r, 8)?,
            reserved_bytes: get_opt(r, 9)?,
            cache_bytes: get_opt(r, 10)?,
            non_torch_bytes: r.get(11)?,
            rss_bytes: get_opt(r, 12)?,
            by_module: json_column(r, 13)?,
            by_param_group: json_column(r, 14)?,
        };
        Ok((r.get(0)?, b))
    }
}

/// `module_activations` (later v2): one row per (kept marker, module) of the opt-in activations by module.
pub(super) struct ModuleActivations;
impl Table for ModuleActivations {
    type Row = (i64, String, u64);
    const NAME: &'static str = "module_activations";
    const COLUMNS: &'static [Col] = &[
        col("marker_rowid", "INTEGER NOT NULL"),
        col("module", "TEXT NOT NULL"),
        col("activations_bytes", "INTEGER NOT NULL"),
    ];
    fn write(st: &mut CachedStatement<'_>, (rowid, module, bytes): &Self::Row) -> rusqlite::Result<()> {
        exec(st, &[rowid, module, &sql_u64(*bytes)])
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<Self::Row> {
        Ok((r.get(0)?, r.get(1)?, get_u64(r, 2)?))
    }
}

/// One row of `breakdown_aggregates`: one category of one folded (pid, rank, boundary, device).
pub(super) struct BreakdownAggregateRow {
    pub origin: Origin,
    pub boundary: String,
    pub device: String,
    /// None for a category this torchmem does not know (skipped by the loader).
    pub category: Option<Category>,
    /// Boundaries folded into the row.
    pub boundaries: u64,
    pub stat: CategoryStat,
}

const BREAKDOWN_AGGREGATE_COLUMNS: [Col; 11] = {
    let [pid, rank, local_rank, world_size] = origin_cols!(2);
    [
        pid,
        rank,
        local_rank,
        world_size,
        col("boundary", "TEXT NOT NULL"),
        col("device", "TEXT NOT NULL"),
        col("category", "TEXT NOT NULL"),
        col("boundaries", "INTEGER NOT NULL"),
        col("count", "INTEGER NOT NULL"),
        col("sum_bytes", "INTEGER NOT NULL"),
        col("max_bytes", "INTEGER NOT NULL"),
    ]
};

/// `breakdown_aggregates` (later v2): the folded boundaries' count, sum and max per category; a later row of
/// the same (pid, rank, boundary, device) replaces its rows (`DELETE`).
pub(super) struct BreakdownAggregates;
impl BreakdownAggregates {
    pub const DELETE: &'static str =
        "DELETE FROM breakdown_aggregates WHERE pid IS ?1 AND rank IS ?2 AND boundary = ?3 AND device = ?4";
    pub fn delete(st: &mut CachedStatement<'_>, a: &BreakdownAggregate) -> rusqlite::Result<()> {
        exec(st, &[&a.origin.pid, &a.origin.rank, &a.boundary, &a.device])
    }
}
impl Table for BreakdownAggregates {
    type Row = BreakdownAggregateRow;
    const NAME: &'static str = "breakdown_aggregates";
    const COLUMNS: &'static [Col] = &BREAKDOWN_AGGREGATE_COLUMNS;
    fn write(st: &mut CachedStatement<'_>, a: &Self::Row) -> rusqlite::Result<()> {
        let Some(c) = a.category else { return Ok(()) };
        let o = &a.origin;
        exec(
            st,
            &[
                &o.pid,
                &o.rank,
                &o.local_rank,
                &o.world_size,
                &a.boundary,
                &a.device,
                &c.as_str(),
                &sql_u64(a.boundaries),
                &sql_u64(a.stat.count),
                &sql_u64(a.stat.sum_bytes),
                &sql_u64(a.stat.max_bytes),
            ],
        )
    }
    fn read(r: &Row<'_>) -> rusqlite::Result<Self::Row> {
        let category: String = r.get(6)?;
        Ok(BreakdownAggregateRow {
            origin: get_origin(r, 0)?,
            boundary: r.get(4)?,
            device: r.get(5)?,
            category: Category::parse(&category),
            boundaries: get_u64(r, 7)?,
            stat: CategoryStat { count: get_u64(r, 8)?, sum_bytes: get_u64(r, 9)?, max_bytes: get_u64(r, 10)? },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_is_made_from_the_row_definitions_and_old_files_read_null_for_newer_columns() {
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        conn.execute_batch(&schema()).unwrap();
        let cols = |t: &str| -> Vec<String> {
            let mut st = conn.prepare(&format!("SELECT name FROM pragma_table_info('{t}')")).unwrap();
            st.query_map([], |r| r.get(0)).unwrap().collect::<rusqlite::Result<_>>().unwrap()
        };
        assert_eq!(cols("blobs"), ["t_ns", "name", "data", "pid", "rank", "local_rank", "world_size"]);
        assert_eq!(cols("markers").len(), 17);
        assert_eq!(Markers::insert().matches('?').count(), 17);
        assert_eq!(
            Blobs::select(2, "", "ORDER BY t_ns"),
            "SELECT t_ns, name, data, NULL, NULL, NULL, NULL FROM blobs ORDER BY t_ns"
        );
        assert!(Markers::select(1, ", rowid", "").contains("peak_rss_bytes, NULL, NULL, NULL, NULL, NULL, NULL, rowid"));
        assert!(Markers::select(3, "", "").ends_with("device, NULL FROM markers "), "a v3 file has no held RSS");
    }
}
