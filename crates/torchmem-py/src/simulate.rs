//! The allocator simulator for Python: replay a snapshot (file or bytes) through the caching-allocator model
//! (the torchmem-sim crate) under its recorded settings or a what-if, returning the result as a dict (with
//! the text report inside). Bad snapshots raise `torchmem.SnapshotError`, bad settings `torchmem.InputError` (a
//! `ValueError`); errors.rs converts them. `whatif` is the what-if panel of on_oom's report and of the
//! snapshot page (the trace under the common settings; for an OOM snapshot, whether each avoids it).

use pyo3::prelude::*;
use torchmem_sim::{render, search, whatif, AllocConf, Prepared, SimOptions};

use crate::convert::to_py;
use crate::errors::Error;

/// Simulates a snapshot given as a path or as bytes; returns the dict of `torchmem simulate --json` plus
/// `text` (the text report) and, with `min_memory`, the smallest limit per setting.
#[pyfunction]
#[pyo3(signature = (path=None, data=None, alloc_conf=None, memory_limit_bytes=None, device_memory_bytes=None, min_memory=false, device_memory_recorded=false))]
#[allow(clippy::too_many_arguments)]
fn simulate(
    py: Python<'_>,
    path: Option<String>,
    data: Option<Vec<u8>>,
    alloc_conf: Option<String>,
    memory_limit_bytes: Option<u64>,
    device_memory_bytes: Option<u64>,
    min_memory: bool,
    device_memory_recorded: bool,
) -> Result<Bound<'_, PyAny>, Error> {
    let conf = match alloc_conf.as_deref() {
        Some(s) => Some(AllocConf::parse(s)?),
        None => None,
    };
    let v = py.detach(move || -> Result<serde_json::Value, Error> {
        let (snap, name) = match (&path, &data) {
            (Some(p), _) => (torchmem_sim::read_snapshot(std::path::Path::new(p))?, p.clone()),
            (None, Some(d)) => (torchmem_sim::read_snapshot_bytes(d, "<bytes>")?, "<bytes>".into()),
            (None, None) => return Err(Error::Input("give a snapshot path or its bytes".into())),
        };
        let opts = SimOptions {
            conf,
            memory_limit_bytes,
            device_memory_bytes,
            device_memory_from_oom: device_memory_recorded,
            detailed: true,
            ..Default::default()
        };
        let result = torchmem_sim::simulate(&snap, &name, &opts);
        let mut v = render::json(&result);
        v["text"] = serde_json::Value::String(render::text(&result));
        if min_memory {
            let mut rows = Vec::new();
            for d in result.devices.iter().map(|d| d.device) {
                let p = Prepared::new(&snap, d).map_err(Error::Input)?;
                let per = search::min_memory_settings(&p, &opts);
                rows.push(serde_json::json!({ "device": d, "settings": per }));
            }
            v["min_memory"] = serde_json::Value::Array(rows);
        }
        Ok(v)
    })?;
    to_py(py, &v)
}

/// The what-if panel of a snapshot file: `{"devices": [WhatIf...], "text": ...}` as a dict. `memory_limit_bytes`: the
/// per-process cap the run had (on_oom knows it); `device_total_bytes`: the device's total memory.
#[pyfunction]
#[pyo3(name = "whatif", signature = (path, memory_limit_bytes=None, device_total_bytes=None))]
fn whatif_panel(
    py: Python<'_>,
    path: String,
    memory_limit_bytes: Option<u64>,
    device_total_bytes: Option<u64>,
) -> Result<Bound<'_, PyAny>, Error> {
    let v = py.detach(move || -> Result<serde_json::Value, Error> {
        let snap = torchmem_sim::read_snapshot(std::path::Path::new(&path))?;
        let opts = whatif::WhatIfOptions { memory_limit_bytes, device_total_bytes };
        let panels = whatif::whatif(&snap, &opts);
        Ok(serde_json::json!({ "devices": panels, "text": whatif::text(&panels) }))
    })?;
    to_py(py, &v)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(whatif_panel, m)?)?;
    Ok(())
}
