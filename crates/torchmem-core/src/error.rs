//! The core's error type. The CLI wraps it with context; the Python binding turns it into exceptions.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    #[error("{path}: is not a torchmem profile ({reason}). Record one with `torchmem run -o PROFILE -- COMMAND`")]
    NotAProfile { path: PathBuf, reason: String },
    #[error("{path}: is not a torchmem profile that can be read: it is damaged ({reason}). A profile whose run was killed stays readable, so this file was cut or overwritten afterwards; record the run again with `torchmem run -o PROFILE -- COMMAND`")]
    DamagedProfile { path: PathBuf, reason: String },
    #[error("{path}: no such profile file. Check the path, or record one with `torchmem run -o PROFILE -- COMMAND`")]
    ProfileMissing { path: PathBuf },
    #[error("profile store: {0}")]
    Store(#[from] rusqlite::Error),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("NVML unavailable: {0}")]
    Nvml(String),
    #[error("{0}")]
    Invalid(String),
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

pub type Result<T> = std::result::Result<T, CoreError>;
