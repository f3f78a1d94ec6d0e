//! Allocator snapshots for Python: read a snapshot (file or bytes) into a summary (dicts), text or HTML,
//! and diagnose an out-of-memory failure from its numbers or its message. Bad snapshots raise
//! `torchmem.SnapshotError`, a failed write the matching `OSError`, text that is not an OOM message
//! `torchmem.OomParseError` (errors.rs converts them).

use pyo3::prelude::*;
use torchmem_snapshot::{html, oom, sites, summary, Snapshot};

use crate::convert::to_py;
use crate::errors::{Error, Result};

fn load(path: &str) -> Result<Snapshot> {
    Ok(torchmem_snapshot::read_path(std::path::Path::new(path))?)
}

fn summary_of<'py>(
    py: Python<'py>,
    snap: &Snapshot,
    name: &str,
    top: usize,
    at_time_us: Option<i64>,
) -> Result<Bound<'py, PyAny>> {
    let sum = summary::summarize(snap);
    let tops = sites::top_sites(snap, &sum.peaks(), top, at_time_us);
    to_py(py, &serde_json::json!({ "file": name, "summary": sum, "top": tops }))
}

/// Summary and top sites of a snapshot file (pickle or JSON): `{"file", "summary", "top"}`.
#[pyfunction]
#[pyo3(signature = (path, top=10, at_time_us=None))]
fn snapshot_summary<'py>(
    py: Python<'py>,
    path: String,
    top: usize,
    at_time_us: Option<i64>,
) -> Result<Bound<'py, PyAny>> {
    let snap = py.detach(|| load(&path))?;
    summary_of(py, &snap, &path, top, at_time_us)
}

/// The same for snapshot bytes (e.g. `pickle.dumps(torch.cuda.memory._snapshot())`).
#[pyfunction]
#[pyo3(signature = (data, top=10, at_time_us=None))]
fn snapshot_summary_bytes<'py>(
    py: Python<'py>,
    data: &[u8],
    top: usize,
    at_time_us: Option<i64>,
) -> Result<Bound<'py, PyAny>> {
    let snap = torchmem_snapshot::read_bytes(data, "<bytes>")?;
    summary_of(py, &snap, "<bytes>", top, at_time_us)
}

/// The text of `torchmem snapshot FILE` followed by `--top N`.
#[pyfunction]
#[pyo3(signature = (path, top=10))]
fn snapshot_text(py: Python<'_>, path: String, top: usize) -> Result<String> {
    let snap = py.detach(|| load(&path))?;
    let sum = summary::summarize(&snap);
    let tops = sites::top_sites(&snap, &sum.peaks(), top, None);
    Ok(format!("{}\n{}", summary::render_text(&sum, &path), sites::render_top_text(&tops)))
}

/// Writes the offline HTML report of a snapshot file to `out_path`, with the what-if panel (torchmem-sim).
#[pyfunction]
#[pyo3(signature = (path, out_path, memory_limit_bytes=None))]
fn snapshot_html(py: Python<'_>, path: String, out_path: String, memory_limit_bytes: Option<u64>) -> Result<()> {
    let snap = py.detach(|| load(&path))?;
    let sum = summary::summarize(&snap);
    let opts = torchmem_sim::whatif::WhatIfOptions { memory_limit_bytes, ..Default::default() };
    let whatif = py.detach(|| torchmem_sim::whatif::whatif(&snap, &opts));
    let page = html::render_with_whatif(&snap, &sum, &path, Some(&whatif));
    std::fs::write(&out_path, page).map_err(|e| Error::io_at(&out_path, e))?;
    Ok(())
}

fn diagnosis<'py>(py: Python<'py>, d: &oom::Diagnosis) -> Result<Bound<'py, PyAny>> {
    let mut v = serde_json::to_value(d)?;
    v["text"] = serde_json::Value::String(oom::render_text(d));
    to_py(py, &v)
}

/// Diagnoses an out-of-memory failure from the allocator's numbers (bytes): a dict with the verdict,
/// explanation, next steps and a `text` rendering.
#[pyfunction]
#[pyo3(signature = (requested_bytes, allocated_bytes, reserved_bytes, total_bytes=None, free_bytes=None, process_bytes=None, device=None))]
#[allow(clippy::too_many_arguments)]
fn oom_diagnosis(
    py: Python<'_>,
    requested_bytes: u64,
    allocated_bytes: u64,
    reserved_bytes: u64,
    total_bytes: Option<u64>,
    free_bytes: Option<u64>,
    process_bytes: Option<u64>,
    device: Option<i64>,
) -> Result<Bound<'_, PyAny>> {
    let n = oom::OomNumbers {
        device,
        requested_bytes,
        total_bytes,
        free_bytes,
        process_bytes,
        allocated_bytes: Some(allocated_bytes),
        reserved_unallocated_bytes: Some(reserved_bytes.saturating_sub(allocated_bytes)),
        ..Default::default()
    };
    diagnosis(py, &oom::diagnose(&n))
}

/// Parses a PyTorch OOM message and diagnoses it (the dict of `torchmem explain-oom --json`).
#[pyfunction]
fn explain_oom<'py>(py: Python<'py>, message: &str) -> Result<Bound<'py, PyAny>> {
    let n = oom::parse_message(message).map_err(Error::OomParse)?;
    diagnosis(py, &oom::diagnose(&n))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(snapshot_summary, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot_summary_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot_text, m)?)?;
    m.add_function(wrap_pyfunction!(snapshot_html, m)?)?;
    m.add_function(wrap_pyfunction!(oom_diagnosis, m)?)?;
    m.add_function(wrap_pyfunction!(explain_oom, m)?)?;
    Ok(())
}
