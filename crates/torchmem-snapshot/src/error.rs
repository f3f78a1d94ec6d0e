//! Errors of the snapshot reader: pickle-level problems (with byte offsets) and schema problems.

use thiserror::Error;

/// A problem in the pickle byte stream. Every variant names the byte offset of the opcode.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum PickleError {
    #[error("refusing opcode {opcode} (0x{byte:02x}) at byte offset {offset}: it would import or call Python code, and a memory snapshot never needs it. This file is not a plain allocator snapshot (or it was tampered with); torchmem never executes pickled code")]
    Forbidden { opcode: &'static str, byte: u8, offset: u64 },
    #[error("unknown pickle opcode 0x{byte:02x} at byte offset {offset}: the file is damaged or not a pickle")]
    UnknownOpcode { byte: u8, offset: u64 },
    #[error("pickle protocol {version} at byte offset {offset} is newer than 5, the highest torchmem reads")]
    Protocol { version: u8, offset: u64 },
    #[error("the file ends at byte offset {offset} in the middle of {what} (opcode at byte offset {op_offset}): it is truncated. Was it still being written, or copied partly?")]
    Truncated { offset: u64, what: &'static str, op_offset: u64 },
    #[error("malformed pickle at byte offset {offset}: {msg}")]
    Malformed { offset: u64, msg: String },
    #[error("read error at byte offset {offset}: {msg}")]
    Io { offset: u64, msg: String },
}

/// Any problem reading a snapshot file.
#[derive(Debug, Error)]
pub enum SnapshotError {
    #[error("{path}: {error}")]
    Pickle { path: String, error: PickleError },
    #[error("{path}: not an allocator snapshot: {msg}")]
    Schema { path: String, msg: String },
    #[error("{path}: invalid JSON snapshot: {msg}")]
    Json { path: String, msg: String },
    /// The file does not exist (Python gets `FileNotFoundError`, the CLI the same words).
    #[error("{path}: no such snapshot file. Check the path")]
    NotFound { path: String },
    #[error("{path}: {msg}")]
    Io { path: String, msg: String },
}

impl SnapshotError {
    /// A failure to open snapshot file `path`: [`SnapshotError::NotFound`] when it does not exist.
    pub fn open_failed(path: &str, e: &std::io::Error) -> SnapshotError {
        match e.kind() {
            std::io::ErrorKind::NotFound => SnapshotError::NotFound { path: path.to_string() },
            _ => SnapshotError::Io { path: path.to_string(), msg: format!("cannot open: {e}") },
        }
    }
}

/// Internal: a pickle-level or schema-level failure, before the path is attached.
#[derive(Debug)]
pub enum PickleOrSchema {
    Pickle(PickleError),
    Schema(String),
}
