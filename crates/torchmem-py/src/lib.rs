//! `torchmem._native`: the thin PyO3 layer. Each file mirrors one concern of the core and registers its
//! functions here; `errors` is the one place core errors become Python exceptions.

use pyo3::prelude::*;

mod convert;
mod errors;
mod estimate;
mod events;
mod leaks;
mod ledger;
mod line;
mod marker_log;
mod nvml;
mod proc;
mod profile;
mod record_macro;
mod sampler;
mod simulate;
mod snapshot;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Learn the exec-inherited maxrss bound while the process is young (see sources::self_proc::self_memory).
    let _ = torchmem_core::sources::self_proc::exec_maxrss_bound();
    errors::register(m)?;
    // The names a breakdown entry carries as `<name>_bytes` (core's `breakdown::Category`, one list).
    let categories: Vec<&str> = torchmem_core::breakdown::Category::ALL.iter().map(|c| c.as_str()).collect();
    m.add("BREAKDOWN_CATEGORIES", pyo3::types::PyTuple::new(m.py(), categories)?)?;
    proc::register(m)?;
    nvml::register(m)?;
    ledger::register(m)?;
    sampler::register(m)?;
    events::register(m)?;
    leaks::register(m)?;
    line::register(m)?;
    marker_log::register(m)?;
    snapshot::register(m)?;
    profile::register(m)?;
    simulate::register(m)?;
    estimate::register(m)?;
    Ok(())
}
