//! Reading a profile file from Python (`torchmem.load_profile`): `open_profile` loads it once in Rust and
//! returns a `ProfileData` whose `summary()` is the dict of `torchmem report --format json` and whose tables
//! (`cpu_samples`, `markers`, `phases`, …) come out as column names plus row tuples, built as Python objects
//! (no JSON text crosses the boundary). A missing file raises `FileNotFoundError`, a directory
//! `IsADirectoryError`, anything else that is not a readable profile `torchmem.ProfileError`, each with the
//! CLI's message (errors.rs converts them).

use std::path::{Path, PathBuf};

use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use serde_json::Value;
use torchmem_core::analysis::Summary;
use torchmem_core::model::Profile;
use torchmem_core::report::json;

use crate::convert::to_py;
use crate::errors::{Error, Result};

/// One table as column names and rows of JSON values. A nested record (e.g. a sample's `origin`) becomes
/// columns `origin_pid`, `origin_rank`, …; columns are in the order they first appear.
struct Table {
    columns: Vec<String>,
    rows: Vec<Vec<Value>>,
}

fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let name = if prefix.is_empty() { k.clone() } else { format!("{prefix}_{k}") };
                match x {
                    Value::Object(_) => flatten(&name, x, out),
                    other => out.push((name, other.clone())),
                }
            }
        }
        other => out.push((if prefix.is_empty() { "value".into() } else { prefix.into() }, other.clone())),
    }
}

/// `table_of(records.iter().map(serde_json::to_value))`: one table from serialized records.
fn table_of(records: impl Iterator<Item = serde_json::Result<Value>>) -> Result<Table> {
    let mut columns: Vec<String> = Vec::new();
    let mut flat_rows = Vec::new();
    for r in records {
        let mut cells = Vec::new();
        flatten("", &r?, &mut cells);
        for (name, _) in &cells {
            if !columns.contains(name) {
                columns.push(name.clone());
            }
        }
        flat_rows.push(cells);
    }
    let rows = flat_rows
        .into_iter()
        .map(|cells| {
            columns
                .iter()
                .map(|c| cells.iter().find(|(n, _)| n == c).map(|(_, v)| v.clone()).unwrap_or(Value::Null))
                .collect()
        })
        .collect();
    Ok(Table { columns, rows })
}

/// The table names, in the order `tables()` lists them.
const TABLES: [&str; 13] = [
    "cpu_samples",
    "torch_samples",
    "gpu_samples",
    "processes",
    "process_samples",
    "markers",
    "aggregates",
    "phases",
    "epochs",
    "epoch_totals",
    "process_summary",
    "growth",
    "journey",
];

/// A loaded profile and its summary (computed once, at load).
#[pyclass(module = "torchmem._native", frozen)]
pub struct ProfileData {
    profile: Profile,
    summary: Summary,
}

impl ProfileData {
    fn rows_of(&self, name: &str) -> Result<Table> {
        let (p, s) = (&self.profile, &self.summary);
        match name {
            "cpu_samples" => table_of(p.cpu.iter().map(serde_json::to_value)),
            "torch_samples" => table_of(p.torch.iter().map(serde_json::to_value)),
            "gpu_samples" => table_of(p.gpu.iter().map(serde_json::to_value)),
            "processes" => table_of(p.processes.iter().map(serde_json::to_value)),
            "process_samples" => table_of(p.process_samples.iter().map(serde_json::to_value)),
            "markers" => table_of(p.markers.iter().map(serde_json::to_value)),
            "aggregates" => table_of(p.aggregates.iter().map(serde_json::to_value)),
            "phases" => table_of(s.phases.iter().map(serde_json::to_value)),
            "epochs" => table_of(s.epochs.iter().map(serde_json::to_value)),
            "epoch_totals" => table_of(s.epoch_totals.iter().map(serde_json::to_value)),
            "process_summary" => table_of(s.processes.iter().map(serde_json::to_value)),
            "growth" => table_of(s.growth.iter().map(serde_json::to_value)),
            "journey" => table_of(s.journey.iter().map(serde_json::to_value)),
            other => Err(Error::Input(format!("no table {other:?} in a profile: use one of {}", TABLES.join(", ")))),
        }
    }
}

#[pymethods]
impl ProfileData {
    /// The profile file's path, as given.
    #[getter]
    fn path(&self) -> String {
        self.profile.path.display().to_string()
    }

    /// The report of `torchmem report --format json` as a dict.
    fn summary<'py>(&self, py: Python<'py>) -> Result<Bound<'py, PyAny>> {
        to_py(py, &json::to_value(&self.profile, &self.summary))
    }

    /// The names `table()` accepts.
    fn tables(&self) -> Vec<&'static str> {
        TABLES.to_vec()
    }

    /// One table as `(columns, rows)`: a list of column names and a list of row tuples.
    fn table<'py>(&self, py: Python<'py>, name: &str) -> Result<(Vec<String>, Bound<'py, PyList>)> {
        let t = self.rows_of(name)?;
        let rows = t
            .rows
            .iter()
            .map(|r| {
                let cells = r.iter().map(|v| to_py(py, v)).collect::<Result<Vec<_>>>()?;
                Ok(PyTuple::new(py, cells)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((t.columns, PyList::new(py, rows)?))
    }
}

fn open(path: &Path) -> Result<ProfileData> {
    if path.is_dir() {
        // The message `torchmem report DIR` gives for one directory (cmd_report::open_profile).
        let msg = format!(
            "{}: is a directory, not a profile file. Give the .sqlite file `torchmem run -o PROFILE` wrote",
            path.display()
        );
        return Err(Error::io_at(path, std::io::Error::new(std::io::ErrorKind::IsADirectory, msg)));
    }
    let profile = Profile::open(path)?;
    let summary = Summary::from_profile(&profile);
    Ok(ProfileData { profile, summary })
}

/// Opens and loads a profile file written by `torchmem run`.
#[pyfunction]
fn open_profile(py: Python<'_>, path: PathBuf) -> Result<ProfileData> {
    py.detach(|| open(&path))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ProfileData>()?;
    m.add_function(wrap_pyfunction!(open_profile, m)?)?;
    Ok(())
}
