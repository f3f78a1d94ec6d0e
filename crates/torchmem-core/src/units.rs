//! Byte, time and HTML-text formatting for every report: the `torchmem-units` crate, the one copy every
//! torchmem crate shares (the snapshot crate's `fmt` re-exports it too).

pub use torchmem_units::{
    escape_html, format_bytes, format_bytes_torch, format_delta, format_duration, format_opt_bytes, format_secs,
};
