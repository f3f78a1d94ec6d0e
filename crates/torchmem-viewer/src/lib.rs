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

use std::collections::HashMap;

use lod::LodIndex;
use profile::ProfileView;
use torchmem_snapshot::direct::{self, EntrySink};
use torchmem_snapshot::model::TraceEntry;
use trace::{Trace, TraceBuilder};

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
    let t_start = std::time::Instant::now();
    let mut trace = load_trace(path, device)?;
    let t_bands = t_start.elapsed();
    let index = LodIndex::build(&trace.allocs, std::mem::take(&mut trace.active_bytes));
    if std::env::var_os("TORCHMEM_VIEW_TIMING").is_some() {
        eprintln!("read + bands {t_bands:?}, LOD index {:?}", t_start.elapsed() - t_bands);
    }
    Ok(Doc::Memory { name, kind: trace_kind(path), trace: Box::new(trace), index })
}

/// Sends the decoder's batches of trace entries to the thread that builds the bands.
struct ChannelSink(std::sync::mpsc::SyncSender<(u32, Vec<TraceEntry>)>);

impl EntrySink for ChannelSink {
    fn append(&mut self, list: u32, entries: &[TraceEntry]) {
        let _ = self.0.send((list, entries.to_vec()));
    }
}

fn no_device(path: &Path, d: usize, n: usize) -> String {
    format!("{}: no trace for device {d} (it has {n} device traces)", path.display())
}

/// Reads an allocator trace into the viewer's model. A pickle (gzipped or not) streams: the decoder
/// hands each batch of trace entries to a second thread that builds the bands while it reads on, and the
/// entries are never kept. Any other form (JSON), or a pickle the fast decoder does not take, is read
/// whole by `torchmem_snapshot::read_path` (which gives the precise error for a bad file), then built.
fn load_trace(path: &Path, device: Option<usize>) -> Result<Trace, String> {
    if let Some((snap, builder, d)) = stream_pickle(path, device)? {
        let t = std::time::Instant::now();
        let trace = builder.finish(snap, d);
        if std::env::var_os("TORCHMEM_VIEW_TIMING").is_some() {
            eprintln!("finish {:?}", t.elapsed());
        }
        return Ok(trace);
    }
    let snap = torchmem_snapshot::read_path(path).map_err(|e| e.to_string())?;
    if let Some(d) = device {
        if d >= snap.device_traces.len() {
            return Err(no_device(path, d, snap.device_traces.len()));
        }
    }
    Ok(Trace::build(snap, device))
}

/// The streaming read of a pickle: the snapshot (without entries), the chosen device's builder and the
/// device; None when the file is no pickle the fast decoder takes.
fn stream_pickle(
    path: &Path,
    device: Option<usize>,
) -> Result<Option<(torchmem_snapshot::Snapshot, TraceBuilder, usize)>, String> {
    let mut head = [0u8; 2];
    let Ok(mut f) = std::fs::File::open(path) else { return Ok(None) };
    if f.read_exact(&mut head).is_err() {
        return Ok(None);
    }
    let gz = head == [0x1f, 0x8b];
    if !gz && head[0] != 0x80 {
        return Ok(None);
    }
    let Ok(f) = std::fs::File::open(path) else { return Ok(None) };
    let (tx, rx) = std::sync::mpsc::sync_channel::<(u32, Vec<TraceEntry>)>(64);
    let builder = std::thread::spawn(move || {
        let mut lists: HashMap<u32, TraceBuilder> = HashMap::new();
        let mut busy = std::time::Duration::ZERO;
        for (list, batch) in rx {
            let t = std::time::Instant::now();
            lists.entry(list).or_default().push(&batch);
            busy += t.elapsed();
        }
        if std::env::var_os("TORCHMEM_VIEW_TIMING").is_some() {
            eprintln!("bands thread busy {busy:?}");
        }
        lists
    });
    let sink = Box::new(ChannelSink(tx));
    let t_read = std::time::Instant::now();
    let read = if gz {
        direct::read_streaming(flate2::read::GzDecoder::new(std::io::BufReader::with_capacity(1 << 20, f)), sink)
    } else {
        direct::read_streaming(f, sink)
    };
    if std::env::var_os("TORCHMEM_VIEW_TIMING").is_some() {
        eprintln!("decoded in {:?}", t_read.elapsed());
    }
    let mut lists = builder.join().map_err(|_| "the thread building the bands panicked".to_string())?;
    let Ok((snap, device_lists)) = read else { return Ok(None) };
    let events = |d: usize| device_lists[d].and_then(|l| lists.get(&l)).map_or(0, TraceBuilder::events);
    let d = match device {
        Some(d) if d >= device_lists.len() => return Err(no_device(path, d, device_lists.len())),
        Some(d) => d,
        None => (0..device_lists.len()).max_by_key(|&d| (events(d), usize::MAX - d)).unwrap_or(0),
    };
    let b = device_lists.get(d).copied().flatten().and_then(|l| lists.remove(&l)).unwrap_or_default();
    drop(lists);
    Ok(Some((snap, b, d)))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed read (entries handed to the bands thread, never kept) builds the same model as the
    /// whole read on real H200 snapshots and replays, plain and gzipped.
    #[test]
    fn the_streamed_read_builds_what_the_whole_read_builds() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        for name in [
            "snapshots/snapshot_mlp_adam_pystacks.pickle",
            "snapshots/snapshot_gpt2_bs8_amp_cppstacks.pickle",
            "sim-h200/gpt2_adamw_amp__recorded.pickle.gz",
            "sim-h200/gpt2_adamw_amp__replay__cap_oom.pickle.gz",
        ] {
            let path = dir.join(name);
            let (snap, builder, d) = stream_pickle(&path, None).unwrap().expect("the fast decoder takes it");
            let streamed = builder.finish(snap, d);
            let whole = Trace::build(torchmem_snapshot::read_path(&path).unwrap(), None);
            assert!(streamed.allocs.len() > 10, "{name}");
            assert_eq!(streamed.device, whole.device, "{name}");
            assert_eq!(streamed.allocs, whole.allocs, "{name}");
            assert_eq!(streamed.n_before, whole.n_before, "{name}");
            assert_eq!(streamed.active_bytes, whole.active_bytes, "{name}");
            assert_eq!(streamed.sites, whole.sites, "{name}");
            assert_eq!((streamed.peak_bytes, streamed.peak_event), (whole.peak_bytes, whole.peak_event), "{name}");
            assert_eq!(streamed.layout_bytes, whole.layout_bytes, "{name}");
            assert_eq!(streamed.ooms, whole.ooms, "{name}");
            assert_eq!(streamed.annotations, whole.annotations, "{name}");
            assert_eq!(streamed.segment_events, whole.segment_events, "{name}");
            assert!(streamed.snap.device_traces.is_empty());
        }
    }

    #[test]
    fn a_device_without_a_trace_is_a_clear_error() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/snapshots/snapshot_mlp_adam_pystacks.pickle");
        let e = load_trace(&path, Some(7)).err().expect("no device 7");
        assert!(e.contains("no trace for device 7"), "{e}");
    }
}
