//! Turns core errors into Python exceptions. `TorchmemError` is the base class users catch.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(torchmem, TorchmemError, PyException, "Base class of torchmem's errors.");
create_exception!(
    torchmem,
    ProfileError,
    TorchmemError,
    "A profile file is missing, damaged or not a torchmem profile."
);
create_exception!(
    torchmem,
    SnapshotError,
    TorchmemError,
    "An allocator snapshot cannot be read (truncated, malicious or not a snapshot)."
);

pub fn to_py(e: torchmem_core::CoreError) -> PyErr {
    use torchmem_core::CoreError::*;
    match e {
        NotAProfile { .. } | DamagedProfile { .. } | ProfileMissing { .. } => ProfileError::new_err(e.to_string()),
        other => TorchmemError::new_err(other.to_string()),
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TorchmemError", py.get_type::<TorchmemError>())?;
    m.add("ProfileError", py.get_type::<ProfileError>())?;
    m.add("SnapshotError", py.get_type::<SnapshotError>())?;
    Ok(())
}
