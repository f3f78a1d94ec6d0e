//! This process's own memory for the Python API: RSS and peak RSS (/proc/self/status, statm), smaps_rollup,
//! malloc's free bytes and trim, torchmem's own peak-RSS period and its watcher thread, byte formatting.

use pyo3::prelude::*;
use torchmem_core::sources::self_proc;

use crate::record_macro::read_only_record;

/// This process's RSS and peak RSS, in bytes, from one read of /proc/self/status: core's `SelfMemory`
/// (read-only attributes) behind `self_memory`.
#[pyclass(frozen, eq, module = "torchmem._native", name = "SelfMemory")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PySelfMemory(self_proc::SelfMemory);

read_only_record!(PySelfMemory, "SelfMemory", rss_bytes, peak_rss_bytes);

/// RSS and peak RSS from one read of /proc/self/status; None where /proc is missing.
#[pyfunction]
fn self_memory() -> Option<PySelfMemory> {
    self_proc::self_memory().map(PySelfMemory)
}

/// RSS in bytes from /proc/self/statm (the cheapest read).
#[pyfunction]
fn self_rss_bytes() -> Option<u64> {
    self_proc::self_rss_bytes()
}

/// This process's /proc/self/smaps_rollup, in bytes: core's `procfs::Rollup` (read-only attributes) behind
/// `self_rollup`.
#[pyclass(frozen, eq, module = "torchmem._native", name = "SmapsRollup")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PySmapsRollup(torchmem_core::sources::procfs::Rollup);

read_only_record!(PySmapsRollup, "SmapsRollup", rss_bytes, pss_bytes, uss_bytes, swap_bytes);

/// RSS, PSS, USS and swap from /proc/self/smaps_rollup (milliseconds on big processes); None where missing.
#[pyfunction]
fn self_rollup(py: Python<'_>) -> Option<PySmapsRollup> {
    let pid = std::process::id();
    py.detach(|| torchmem_core::sources::procfs::smaps_rollup(pid)).map(PySmapsRollup)
}

/// What glibc's malloc keeps freed, for reuse (`mallinfo2().fordblks`); None where not glibc >= 2.33.
#[pyfunction]
fn malloc_free_bytes() -> Option<u64> {
    self_proc::malloc_free_bytes()
}

/// RSS now and the highest RSS since torchmem's peak period started (its own counter: the kernel's peak
/// is never reset); None where /proc is missing.
#[pyfunction]
fn rss_period_peak() -> Option<PySelfMemory> {
    self_proc::rss_period_peak().map(PySelfMemory)
}

/// Ends torchmem's peak period (returns `rss_period_peak()` read just before) and starts the next one.
#[pyfunction]
fn rss_period_restart() -> Option<PySelfMemory> {
    self_proc::rss_period_restart().map(PySelfMemory)
}

/// How many peak windows are open: while one is, a thread samples RSS every 5 ms into the period.
#[pyfunction]
fn watch_rss(open_windows: usize) -> bool {
    self_proc::watch_rss(open_windows)
}

/// glibc `malloc_trim(0)`: gives freed heap pages back to the kernel. True when something was released.
#[pyfunction]
fn malloc_trim(py: Python<'_>) -> bool {
    py.detach(self_proc::malloc_trim)
}

/// torchmem's byte formatter (`torchmem-units`): reports' style.
#[pyfunction]
fn format_bytes(bytes: u64) -> String {
    torchmem_core::units::format_bytes(bytes)
}

/// torchmem's byte formatter in PyTorch's style (two decimals in every unit: `32.00 MiB`).
#[pyfunction]
fn format_bytes_torch(bytes: u64) -> String {
    torchmem_core::units::format_bytes_torch(bytes)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySelfMemory>()?;
    m.add_class::<PySmapsRollup>()?;
    m.add_function(wrap_pyfunction!(self_memory, m)?)?;
    m.add_function(wrap_pyfunction!(self_rss_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(self_rollup, m)?)?;
    m.add_function(wrap_pyfunction!(malloc_free_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(rss_period_peak, m)?)?;
    m.add_function(wrap_pyfunction!(rss_period_restart, m)?)?;
    m.add_function(wrap_pyfunction!(watch_rss, m)?)?;
    m.add_function(wrap_pyfunction!(malloc_trim, m)?)?;
    m.add_function(wrap_pyfunction!(format_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(format_bytes_torch, m)?)?;
    Ok(())
}
