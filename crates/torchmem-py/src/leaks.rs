//! Bindings of the leak finder (`torchmem_core::analysis::leaks`) for `python/torchmem/_leaks.py`: the
//! step-level growth detector the Monitor feeds at every step end (O(1), no allocation on the healthy path),
//! the epoch ends' RSS less malloc's free bytes (`HeldRss`, judged by the epoch growth warning), the findings
//! of a probe, and their table as text for `Monitor.summary()`.

use pyo3::prelude::*;
use torchmem_core::analysis::leaks::{self, Leak, ProbeData};
use torchmem_core::report::{cells, table};
use torchmem_core::sources::self_proc;

use crate::convert::{from_py, to_py};
use crate::errors::{Error, Result};

/// Step-level growth detection: `push(allocated_bytes, rss_bytes, malloc_free_bytes)` at each step end; the
/// growth (a dict of `leaks::StepGrowth`) when memory rose over most of the last `window_steps` steps after
/// `warmup_steps` (RSS less what malloc keeps freed).
#[pyclass(module = "torchmem._native")]
pub struct StepGrowthDetector {
    inner: leaks::StepGrowthDetector,
}

#[pymethods]
impl StepGrowthDetector {
    #[new]
    #[pyo3(signature = (warmup_steps=5, window_steps=8))]
    fn new(warmup_steps: u64, window_steps: usize) -> Result<Self> {
        if window_steps < 2 {
            return Err(Error::Input(format!(
                "window_steps={window_steps}: growth needs a window of at least 2 steps (e.g. 8)"
            )));
        }
        Ok(StepGrowthDetector { inner: leaks::StepGrowthDetector::new(warmup_steps, window_steps) })
    }

    /// One step's end; None, or the growth (`leaks::StepGrowth` as a dict).
    #[pyo3(signature = (allocated_bytes, rss_bytes, malloc_free_bytes=None))]
    fn push<'py>(
        &mut self,
        py: Python<'py>,
        allocated_bytes: Option<u64>,
        rss_bytes: Option<u64>,
        malloc_free_bytes: Option<u64>,
    ) -> Result<Option<Bound<'py, PyAny>>> {
        let end =
            leaks::StepEnd { allocated_bytes, rss_bytes, malloc_free_bytes, malloc_trims: self_proc::malloc_trims() };
        self.inner.push(end).map(|g| to_py(py, &g)).transpose()
    }

    /// Forgets the window: growth must be seen again over fresh steps.
    fn rearm(&mut self) {
        self.inner.rearm();
    }

    /// Step ends pushed so far.
    #[getter]
    fn steps_seen(&self) -> u64 {
        self.inner.steps_seen()
    }
}

/// RSS less what glibc's malloc keeps freed, carried over torchmem's own `malloc_trim`s: `push(rss_bytes,
/// malloc_free_bytes)` at each epoch end gives the value the epoch growth warning judges (`leaks::HeldRss`,
/// the step detector's series).
#[pyclass(module = "torchmem._native")]
pub struct HeldRss {
    inner: leaks::HeldRss,
}

#[pymethods]
impl HeldRss {
    #[new]
    fn new() -> Self {
        HeldRss { inner: leaks::HeldRss::new() }
    }

    /// The next value (None without RSS).
    #[pyo3(signature = (rss_bytes, malloc_free_bytes=None))]
    fn push(&mut self, rss_bytes: Option<u64>, malloc_free_bytes: Option<u64>) -> Option<u64> {
        self.inner.push(rss_bytes, malloc_free_bytes, self_proc::malloc_trims())
    }
}

/// The findings of one probe (`leaks::ProbeData` as a dict in, `leaks::LeakReport` as a dict out).
#[pyfunction]
fn leak_findings<'py>(py: Python<'py>, probe: &Bound<'py, PyAny>) -> Result<Bound<'py, PyAny>> {
    let probe: ProbeData = from_py(probe, "a leak probe in leaks::ProbeData form")?;
    let mut report = leaks::leak_findings(&probe);
    torchmem_core::report::findings::describe_leaks(&mut report);
    to_py(py, &report)
}

/// One `LEAK:` line per finding, then the "Leaks" table, of a list of findings (`leaks::Leak` dicts), as
/// aligned text (empty for an empty list).
#[pyfunction]
fn leaks_text(findings: &Bound<'_, PyAny>) -> Result<String> {
    let found: Vec<Leak> = from_py(findings, "a list of leak findings in leaks::Leak form")?;
    if found.is_empty() {
        return Ok(String::new());
    }
    Ok(table::render_leaks(&found) + &table::render_table(&cells::leaks_table(&found)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StepGrowthDetector>()?;
    m.add_class::<HeldRss>()?;
    m.add_function(wrap_pyfunction!(leak_findings, m)?)?;
    m.add_function(wrap_pyfunction!(leaks_text, m)?)?;
    Ok(())
}
