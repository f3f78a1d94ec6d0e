//! torchmem-snapshot: a safe streaming reader for PyTorch allocator snapshots and their analysis.
//!
//! One file per concern: `pickle` (the unpickler, never executes anything), `decode` (pickle →
//! model), `json` (JSON form), `model`, `replay` (trace replay: live blocks and levels over time),
//! `summary` (totals, fragmentation, actions, ring buffer), `sites` (top allocation sites at a moment),
//! `diff`, `html` (offline report), `oom` (OOM message parsing and diagnosis), `fmt` (byte formatting).
//! Layering: model ← replay ← {summary, sites} ← {diff, html}.

pub mod decode;
pub mod diff;
pub mod error;
pub mod fmt;
pub mod html;
pub mod json;
pub mod model;
pub mod oom;
pub mod pickle;
pub mod replay;
pub mod sites;
pub mod summary;

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

pub use error::{PickleError, SnapshotError};
pub use model::Snapshot;

/// Reads a snapshot from bytes: pickle (starts with the PROTO opcode 0x80) or JSON (starts with `{`/`[`).
pub fn read_bytes(data: &[u8], name: &str) -> Result<Snapshot, SnapshotError> {
    read_from(data, name)
}

/// Reads a snapshot file (pickle or JSON, detected from the first byte).
pub fn read_path(path: &Path) -> Result<Snapshot, SnapshotError> {
    let name = path.display().to_string();
    let f = File::open(path).map_err(|e| SnapshotError::Io { path: name.clone(), msg: format!("cannot open: {e}") })?;
    read_from(BufReader::with_capacity(1 << 20, f), &name)
}

fn read_from<R: Read>(mut reader: R, name: &str) -> Result<Snapshot, SnapshotError> {
    let mut first = [0u8; 1];
    let n = loop {
        match reader.read(&mut first) {
            Ok(n) => break n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(SnapshotError::Io { path: name.into(), msg: e.to_string() }),
        }
    };
    if n == 0 {
        return Err(SnapshotError::Schema { path: name.into(), msg: "the file is empty".into() });
    }
    let chained = std::io::Cursor::new(first).take(1).chain(reader);
    match first[0] {
        b'{' | b'[' | b' ' | b'\n' | b'\r' | b'\t' => {
            json::read_json(chained).map_err(|msg| SnapshotError::Json { path: name.into(), msg })
        }
        _ => decode::read_pickle(chained).map_err(|e| match e {
            error::PickleOrSchema::Pickle(error) => SnapshotError::Pickle { path: name.into(), error },
            error::PickleOrSchema::Schema(msg) => SnapshotError::Schema { path: name.into(), msg },
        }),
    }
}
