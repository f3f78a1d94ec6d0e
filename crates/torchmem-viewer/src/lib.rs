//! torchmem-viewer: `torchmem view`, one interactive memory viewer for allocator snapshots, estimate and
//! simulation traces (the same pickle format) and `torchmem run` profiles. No PyO3, no clap: the CLI parses
//! arguments and calls [`load`], then [`server::Server`] (a page on 127.0.0.1 behind a random token, data
//! fetched as JSON on demand) or [`offline::render`] (one self-contained page with bounded detail).
//!
//! One file per concern: `trace` (allocations as bands, packed layout, segments at a moment, search),
//! `lod` (the level-of-detail index), `profile` (a run's series and lanes), `api` (the JSON endpoints, shared
//! by the server and the offline page's builder), `server` (HTTP, token, CSP), `offline`, `sha256`.

pub mod api;
pub mod lod;
pub mod offline;
pub mod profile;
pub mod server;
pub mod sha256;
pub mod trace;

use std::io::Read;
use std::path::{Path, PathBuf};

use lod::LodIndex;
use profile::ProfileView;
use trace::Trace;

/// The page's template, script and style (served as files; inlined with hashes by the offline page).
pub const PAGE_HTML: &str = include_str!("../assets/viewer.html");
pub const PAGE_JS: &str = include_str!("../assets/viewer.js");
pub const PAGE_CSS: &str = include_str!("../assets/viewer.css");

/// The Content-Security-Policy of the served page: nothing from outside, scripts and styles only from the
/// server's own files, data only from its own JSON endpoints.
pub const SERVED_CSP: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// One loaded file.
pub enum Doc {
    /// An allocator trace (snapshot, estimate or simulation) with its index.
    Memory { name: String, kind: &'static str, trace: Box<Trace>, index: LodIndex },
    /// A `torchmem run` profile.
    Profile { name: String, view: ProfileView },
}

impl Doc {
    pub fn name(&self) -> &str {
        match self {
            Doc::Memory { name, .. } | Doc::Profile { name, .. } => name,
        }
    }
}

/// What kind of file `path` holds, from its first bytes (SQLite magic → profile; else a snapshot).
fn is_sqlite(path: &Path) -> bool {
    let mut head = [0u8; 16];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head)).is_ok() && head.starts_with(b"SQLite format 3")
}

/// How a trace names itself: the estimator and the simulator write the same format as PyTorch.
fn trace_kind(path: &Path) -> &'static str {
    let n = path.file_name().map(|s| s.to_string_lossy().to_lowercase()).unwrap_or_default();
    if n.contains("estimat") {
        "estimate trace"
    } else if n.contains("replay") || n.contains("simul") {
        "simulation trace"
    } else {
        "allocator snapshot"
    }
}

/// Loads one file: a profile (SQLite) or an allocator trace (pickle or JSON, gzipped or not).
pub fn load(path: &Path, device: Option<usize>) -> Result<Doc, String> {
    let name = path.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string());
    if !path.exists() {
        return Err(format!("{}: no such file", path.display()));
    }
    if is_sqlite(path) {
        let p = torchmem_core::model::Profile::open(path).map_err(|e| e.to_string())?;
        return Ok(Doc::Profile { name, view: ProfileView::build(&p) });
    }
    let snap = torchmem_snapshot::read_path(path).map_err(|e| e.to_string())?;
    if let Some(d) = device {
        if d >= snap.device_traces.len() {
            return Err(format!(
                "{}: no trace for device {d} (it has {} device traces)",
                path.display(),
                snap.device_traces.len()
            ));
        }
    }
    let mut trace = Trace::build(snap, device);
    let index = LodIndex::build(&trace.allocs, std::mem::take(&mut trace.active_bytes));
    Ok(Doc::Memory { name, kind: trace_kind(path), trace: Box::new(trace), index })
}

/// Loads every file; the first error names its file. A profile given with traces of the same run puts its
/// epoch / step / phase lanes above their bands (lined up by wall clock).
pub fn load_all(paths: &[PathBuf], device: Option<usize>) -> Result<Vec<Doc>, String> {
    let mut docs: Vec<Doc> = paths.iter().map(|p| load(p, device)).collect::<Result<_, _>>()?;
    let (profiles, mut traces): (Vec<_>, Vec<_>) = docs.iter_mut().partition(|d| matches!(d, Doc::Profile { .. }));
    for p in &profiles {
        let Doc::Profile { view, .. } = &**p else { continue };
        for t in traces.iter_mut() {
            if let Doc::Memory { trace, .. } = &mut **t {
                trace.add_profile_lanes(view);
            }
        }
    }
    Ok(docs)
}

/// Fills the page template: `csp` (a meta tag or nothing), `head` (the style), `data` (the offline data
/// block or nothing), `script`.
pub fn page(csp: &str, head: &str, data: &str, script: &str) -> String {
    // The data goes in last, so nothing in it is ever taken for a placeholder.
    PAGE_HTML
        .replacen("{{CSP}}", csp, 1)
        .replacen("{{HEAD}}", head, 1)
        .replacen("{{SCRIPT}}", script, 1)
        .replacen("{{DATA}}", data, 1)
}
