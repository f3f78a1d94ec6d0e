//! `MarkerLog`: the Monitor's record of its run, held in Rust (`analysis::MarkerLog`). The Python hooks push
//! each marker (a dict in `model::Marker` form) as it is made; the log keeps the first occurrences' markers
//! and folds the rest into exact aggregates by the recorder's rule, and every view of the Monitor (summary
//! as data and text, journey, the epoch line) is computed from it here. Markers cross as Python objects
//! (`convert.rs`), not JSON text.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use torchmem_core::analysis::MarkerLog as CoreLog;
use torchmem_core::model::{Edge, Marker, MarkerKind, MarkerMemory, CACHE_EMPTIED_MARK};
use torchmem_core::report::monitor;

use crate::convert::{from_py, to_py};
use crate::errors::{Error, Result};

/// The hot path (every phase and step boundary): a marker dict of the six plain keys read field by field,
/// ~2× faster than going through serde. None for anything else (a breakdown, an origin, a bad value): serde
/// then reads it, or says what is wrong.
fn plain_marker(obj: &Bound<'_, PyAny>) -> Option<Marker> {
    let d = obj.cast::<PyDict>().ok()?;
    if d.len() != 6 {
        return None;
    }
    let get = |k: &str| d.get_item(k).ok().flatten();
    let memory = get("memory")?;
    let memory = memory.cast::<PyDict>().ok()?;
    let mut mem = MarkerMemory::default();
    for (k, v) in memory.iter() {
        let v: Option<u64> = if v.is_none() { None } else { Some(v.extract().ok()?) };
        match k.extract::<&str>().ok()? {
            "rss_bytes" => mem.rss_bytes = v,
            "allocated_bytes" => mem.allocated_bytes = v,
            "reserved_bytes" => mem.reserved_bytes = v,
            "peak_allocated_bytes" => mem.peak_allocated_bytes = v,
            "peak_reserved_bytes" => mem.peak_reserved_bytes = v,
            "peak_rss_bytes" => mem.peak_rss_bytes = v,
            "held_rss_bytes" => mem.held_rss_bytes = v,
            _ => return None,
        }
    }
    let index = get("index")?;
    Some(Marker {
        t_ns: get("t_ns")?.extract().ok()?,
        kind: MarkerKind::parse(get("kind")?.extract::<&str>().ok()?)?,
        edge: Edge::parse(get("edge")?.extract::<&str>().ok()?)?,
        name: get("name")?.extract().ok()?,
        index: if index.is_none() { None } else { Some(index.extract().ok()?) },
        memory: mem,
        origin: Default::default(),
        device: None,
        breakdown: None,
        activations_by_module: None,
    })
}

/// The Monitor's markers and aggregates.
#[pyclass(module = "torchmem._native", name = "MarkerLog")]
pub struct MarkerLog {
    log: CoreLog,
}

#[pymethods]
impl MarkerLog {
    /// `keep_markers`: how many occurrences of each step and phase name keep their markers (None: all).
    #[new]
    #[pyo3(signature = (keep_markers=None))]
    fn new(keep_markers: Option<u64>) -> MarkerLog {
        MarkerLog { log: CoreLog::new(keep_markers) }
    }

    /// Takes one marker; True when it is kept as a marker (else it is folded into an aggregate).
    fn push(&mut self, marker: &Bound<'_, PyAny>) -> Result<bool> {
        let m = match plain_marker(marker) {
            Some(m) => m,
            None => from_py(marker, "a marker in model::Marker form")?,
        };
        Ok(self.log.push(m))
    }

    /// Steps started so far (finished or not, kept or folded).
    #[getter]
    fn steps_started(&self) -> u64 {
        self.log.steps_started()
    }

    /// How many markers are kept.
    fn __len__(&self) -> usize {
        self.log.markers().len()
    }

    /// `analysis::Summary` as a dict (epochs, steps, phases, breakdown, growth, journey) over every marker
    /// pushed.
    #[pyo3(signature = (capacity_bytes=None))]
    fn summary<'py>(&self, py: Python<'py>, capacity_bytes: Option<u64>) -> Result<Bound<'py, PyAny>> {
        let s = py.detach(|| {
            let s = self.log.summary(capacity_bytes);
            let mut v = serde_json::to_value(&s).unwrap_or_default();
            // Each growth finding with its sentence, as the profile's JSON report has it.
            v["growth"] = s.growth.iter().map(torchmem_core::report::findings::growth_json).collect();
            v
        });
        to_py(py, &s)
    }

    /// The per-epoch and per-phase tables, the breakdown and growth warnings, as text.
    #[pyo3(signature = (capacity_bytes=None))]
    fn summary_text(&self, py: Python<'_>, capacity_bytes: Option<u64>) -> String {
        py.detach(|| monitor::summary_text(&self.log, capacity_bytes))
    }

    /// The same tables as HTML, for the Monitor's `_repr_html_` (Jupyter): one self-contained `<div>`.
    #[pyo3(signature = (capacity_bytes=None))]
    fn summary_html(&self, py: Python<'_>, capacity_bytes: Option<u64>) -> String {
        py.detach(|| monitor::summary_html(&self.log, capacity_bytes))
    }

    /// The memory journey as "text" or "mermaid" (InputError for another format).
    #[pyo3(signature = (capacity_bytes=None, format="text", title="torchmem memory journey"))]
    fn journey(&self, capacity_bytes: Option<u64>, format: &str, title: &str) -> Result<String> {
        let mermaid = match format {
            "text" => false,
            "mermaid" => true,
            other => return Err(Error::Input(format!("journey format {other:?}: use \"text\" or \"mermaid\""))),
        };
        Ok(monitor::journey_render(&self.log, capacity_bytes, mermaid, title))
    }

    /// `{"line", "row", "growth", "growth_per_epoch_bytes"}` for the last finished epoch.
    fn epoch_report<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyAny>> {
        // The epochs and the "Cache emptied" marks between them (the series the growth warning judges).
        let epochs: Vec<Marker> = self
            .log
            .markers()
            .iter()
            .filter(|m| m.kind == MarkerKind::Epoch || (m.kind == MarkerKind::Mark && m.name == CACHE_EMPTIED_MARK))
            .cloned()
            .collect();
        to_py(py, &monitor::epoch_report(&epochs))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MarkerLog>()?;
    Ok(())
}
