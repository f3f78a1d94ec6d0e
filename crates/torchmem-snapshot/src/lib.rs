//! torchmem-snapshot: a safe streaming reader for PyTorch allocator snapshots and their analysis.
//!
//! One file per concern: `pickle` (the generic unpickler, never executes anything), `direct` (the fast
//! schema-directed decoder: the main read path), `decode` (pickle → model through the generic reader),
//! `json` (JSON form), `model`, `replay` (trace replay: live blocks and levels over time), `summary`
//! (totals, fragmentation, actions, ring buffer), `sites` (top allocation sites at a moment), `diff`, `html`
//! (offline report), `oom` (OOM message parsing and diagnosis), `fmt` (re-exports torchmem-units' formatters).
//! Layering: model ← replay ← {summary, sites} ← {diff, html}.

pub mod decode;
pub mod diff;
pub mod direct;
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

/// gzip's magic bytes: a gzipped snapshot (`.pickle.gz`, or any name) is recognised by them, not its name.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Inflates gzip data whole; a damaged stream is one clear error.
fn gunzip<R: Read>(reader: R, name: &str) -> Result<Vec<u8>, SnapshotError> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(reader).read_to_end(&mut out).map_err(|e| SnapshotError::Io {
        path: name.to_string(),
        msg: format!("gzip data is damaged ({e}); re-copy the file or gunzip it to check"),
    })?;
    if out.starts_with(&GZIP_MAGIC) {
        return Err(SnapshotError::Schema {
            path: name.to_string(),
            msg: "gzip inside gzip: gunzip it once and read the result".into(),
        });
    }
    Ok(out)
}

/// Reads a snapshot from bytes: pickle (starts with the PROTO opcode 0x80) or JSON (starts with `{`/`[`),
/// either of them gzipped.
pub fn read_bytes(data: &[u8], name: &str) -> Result<Snapshot, SnapshotError> {
    if data.starts_with(&GZIP_MAGIC) {
        return read_bytes(&gunzip(data, name)?, name);
    }
    match first_byte(data.first().copied(), name)? {
        Form::Json => read_json(data, name),
        Form::Pickle => direct::read(data).or_else(|_| read_pickle_generic(data, name)),
    }
}

/// Reads a snapshot file (pickle or JSON, detected from the first byte; gzipped, from gzip's magic bytes,
/// whatever the name). Pickles go through the fast
/// decoder ([`direct`]); when it gives up (an unusual shape, or a damaged or hostile file), the file is
/// read again by the generic decoder, which gives the result or the precise error.
pub fn read_path(path: &Path) -> Result<Snapshot, SnapshotError> {
    let name = path.display().to_string();
    let open = || File::open(path).map_err(|e| SnapshotError::open_failed(&name, &e));
    let mut f = open()?;
    let mut first = [0u8; 2];
    let mut n = 0;
    while n < first.len() {
        match f.read(&mut first[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(SnapshotError::Io { path: name.clone(), msg: e.to_string() }),
        }
    }
    if first[..n] == GZIP_MAGIC {
        return read_bytes(&gunzip(BufReader::with_capacity(1 << 20, open()?), &name)?, &name);
    }
    let form = first_byte((n > 0).then_some(first[0]), &name)?;
    let whole = || -> Result<BufReader<File>, SnapshotError> { Ok(BufReader::with_capacity(1 << 20, open()?)) };
    match form {
        Form::Json => read_json(whole()?, &name),
        Form::Pickle => match direct::read(open()?) {
            Ok(s) => Ok(s),
            Err(direct::Bail) => read_pickle_generic(whole()?, &name),
        },
    }
}

enum Form {
    Json,
    Pickle,
}

fn first_byte(b: Option<u8>, name: &str) -> Result<Form, SnapshotError> {
    match b {
        None => Err(SnapshotError::Schema { path: name.into(), msg: "the file is empty".into() }),
        // JSON starts with these; none of them begins a pickle (`n`, `"`, `f`, `-` are no opcodes).
        Some(b'{' | b'[' | b' ' | b'\n' | b'\r' | b'\t' | b'n' | b'"' | b'f' | b'-') => Ok(Form::Json),
        Some(_) => Ok(Form::Pickle),
    }
}

fn read_json<R: Read>(reader: R, name: &str) -> Result<Snapshot, SnapshotError> {
    json::read_json(reader).map_err(|e| match e {
        json::JsonError::Syntax(msg) => SnapshotError::Json { path: name.into(), msg },
        json::JsonError::NotASnapshot(msg) => SnapshotError::Schema { path: name.into(), msg },
    })
}

/// Reads a pickle with the generic decoder (`pickle` + `decode`), the reference the fast one follows.
pub fn read_pickle_generic<R: Read>(reader: R, name: &str) -> Result<Snapshot, SnapshotError> {
    decode::read_pickle(reader).map_err(|e| match e {
        error::PickleOrSchema::Pickle(error) => SnapshotError::Pickle { path: name.into(), error },
        error::PickleOrSchema::Schema(msg) => SnapshotError::Schema { path: name.into(), msg },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_or_null_json_is_not_a_snapshot_like_the_pickled_empty_dict() {
        for text in ["{}", "null", " {}\n"] {
            let e = read_bytes(text.as_bytes(), "e.json").unwrap_err();
            assert!(matches!(e, SnapshotError::Schema { .. }), "{text}: {e}");
            assert!(e.to_string().starts_with("e.json: not an allocator snapshot: "), "{e}");
        }
        // pickle.dumps({}, protocol=4)
        let e = read_bytes(b"\x80\x04}\x94.", "e.pickle").unwrap_err();
        assert!(e.to_string().starts_with("e.pickle: not an allocator snapshot: "), "{e}");
        let e = read_bytes(b"{ this is not json", "bad.json").unwrap_err();
        assert!(matches!(e, SnapshotError::Json { .. }), "{e}");
        let ok = read_bytes(br#"{"segments": [], "device_traces": [[]]}"#, "ok.json").unwrap();
        assert_eq!(ok.device_traces.len(), 1);
    }
}
