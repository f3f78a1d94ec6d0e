//! Bindings of the leak finder (`torchmem_core::analysis::leaks`) for `python/torchmem/_leaks.py`: the
//! step-level growth detector the Monitor feeds at every step end (O(1), no allocation on the healthy path),
//! the findings of a probe, and their table as text for `Monitor.summary()`.

use pyo3::prelude::*;
use torchmem_core::analysis::leaks::{self, Leak, ProbeData};
use torchmem_core::report::{cells, table};

use crate::errors::{Error, Result};

/// Step-level growth detection: `push(allocated_bytes, rss_bytes)` at each step end; the growth (JSON of
/// `leaks::StepGrowth`) when memory rose over most of the last `window_steps` steps after `warmup_steps`.
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

    /// One step's end; None, or the growth as JSON.
    #[pyo3(signature = (allocated_bytes, rss_bytes))]
    fn push(&mut self, allocated_bytes: Option<u64>, rss_bytes: Option<u64>) -> Result<Option<String>> {
        match self.inner.push(allocated_bytes, rss_bytes) {
            None => Ok(None),
            Some(g) => Ok(Some(serde_json::to_string(&g)?)),
        }
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

/// The findings of one probe (`leaks::ProbeData` JSON in, `leaks::LeakReport` JSON out).
#[pyfunction]
fn leak_findings_json(probe_json: &str) -> Result<String> {
    let probe: ProbeData = serde_json::from_str(probe_json)?;
    Ok(serde_json::to_string(&leaks::leak_findings(&probe))?)
}

/// One `LEAK:` line per finding, then the "Leaks" table, of a JSON list of findings, as aligned text (empty
/// for an empty list).
#[pyfunction]
fn leaks_text(findings_json: &str) -> Result<String> {
    let found: Vec<Leak> = serde_json::from_str(findings_json)?;
    if found.is_empty() {
        return Ok(String::new());
    }
    Ok(table::render_leaks(&found) + &table::render_table(&cells::leaks_table(&found)))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<StepGrowthDetector>()?;
    m.add_function(wrap_pyfunction!(leak_findings_json, m)?)?;
    m.add_function(wrap_pyfunction!(leaks_text, m)?)?;
    Ok(())
}
