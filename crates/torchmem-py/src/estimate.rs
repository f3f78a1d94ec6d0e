//! The estimate use case for Python (`torchmem.estimate()`), in-process: the report of a traced run
//! (`estimate_report`: the tracer's trace file and summary dict in, `torchmem estimate --json`'s dict plus
//! `text` out), the GPU catalogue and its one alias rule (`gpu_catalogue`, `find_gpu`), all from the
//! torchmem-estimator crate the CLI calls, so both report the same way and no CLI process is started. And
//! the one size parser (`parse_size`, torchmem-units) that `--memory-limit 14g` uses.

use pyo3::prelude::*;
use torchmem_estimator::{estimate_trace, gpus, EstimateError, Summary, Target};

use crate::convert::{from_py, to_py};
use crate::errors::Error;

impl From<EstimateError> for Error {
    fn from(e: EstimateError) -> Error {
        match e {
            EstimateError::Sim(e) => e.into(),
            EstimateError::Io { path, source } => Error::io_at(path, source),
            other => Error::Input(other.to_string()),
        }
    }
}

/// Bytes from a size as the CLI's flags take it: `14g`, `14GiB`, `24GB` (1000-based), `512MiB`, `100 B`,
/// or a bare byte count of at least 1 MiB. Raises InputError (a ValueError) naming the accepted forms.
#[pyfunction]
fn parse_size(text: &str) -> Result<u64, Error> {
    torchmem_units::parse_size(text).map_err(Error::Input)
}

/// The GPU catalogue as a list of dicts (`torchmem estimate --list-gpus --json`).
#[pyfunction]
fn gpu_catalogue(py: Python<'_>) -> Result<Bound<'_, PyAny>, Error> {
    to_py(py, &gpus::catalogue())
}

/// The catalogue entry for `name` (case-insensitive; `_`, spaces and `-` alike; "H100" is the 80 GB SXM), or
/// InputError naming the known keys.
#[pyfunction]
fn find_gpu<'py>(py: Python<'py>, name: &str) -> Result<Bound<'py, PyAny>, Error> {
    let t = Target::new(name, None)?;
    to_py(py, &t.gpu)
}

/// The estimate report of a traced run: `trace` (the tracer's allocator snapshot), `summary` (the tracer's
/// summary dict), on `gpu` with `device_memory_bytes` instead of its memory when given, under `alloc_conf`
/// when given. Returns the dict of `torchmem estimate --trace ... --json` plus `text`.
#[pyfunction]
#[pyo3(signature = (trace, summary, gpu="H200", device_memory_bytes=None, alloc_conf=None))]
fn estimate_report<'py>(
    py: Python<'py>,
    trace: String,
    summary: &Bound<'py, PyAny>,
    gpu: &str,
    device_memory_bytes: Option<u64>,
    alloc_conf: Option<String>,
) -> Result<Bound<'py, PyAny>, Error> {
    let summary: Summary = from_py(summary, "the tracer's summary dict")?;
    let target = Target::new(gpu, device_memory_bytes)?;
    let report =
        py.detach(|| estimate_trace(std::path::Path::new(&trace), &summary, &target, alloc_conf.as_deref()))?;
    let mut v = serde_json::to_value(&report)?;
    v["text"] = serde_json::Value::String(report.text());
    to_py(py, &v)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_catalogue, m)?)?;
    m.add_function(wrap_pyfunction!(find_gpu, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_report, m)?)?;
    Ok(())
}
