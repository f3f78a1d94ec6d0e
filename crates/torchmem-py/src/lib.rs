//! `torchmem._native`: the thin PyO3 layer. Each file mirrors one concern of the core and registers its
//! functions here; `errors` is the one place core errors become Python exceptions.

use pyo3::prelude::*;

mod api;
mod cli;
mod convert;
mod errors;
mod estimate;
mod events;
mod leaks;
mod line;
mod marker_log;
mod profile;
mod simulate;
mod snapshot;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Learn the exec-inherited maxrss bound while the process is young (see sources::self_proc::self_memory).
    let _ = torchmem_core::sources::self_proc::exec_maxrss_bound();
    errors::register(m)?;
    cli::register(m)?;
    api::register(m)?;
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
