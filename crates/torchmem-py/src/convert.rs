//! The one way values cross the boundary: Rust records (anything serde writes) become Python dicts, lists,
//! ints and strings, and Python objects become Rust records (anything serde reads), through pythonize. No
//! binding passes JSON text; a Python value not in the expected form is an `InputError` naming the form.

use pyo3::prelude::*;
use pythonize::{depythonize, pythonize};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::errors::{Error, Result};

/// A Rust record as Python objects.
pub fn to_py<'py, T: Serialize + ?Sized>(py: Python<'py>, v: &T) -> Result<Bound<'py, PyAny>> {
    pythonize(py, v).map_err(|e| Error::Python(e.into()))
}

/// A Python object as a Rust record; `what` names the expected form in the error.
pub fn from_py<T: DeserializeOwned>(obj: &Bound<'_, PyAny>, what: &str) -> Result<T> {
    depythonize(obj).map_err(|e| Error::Input(format!("not {what}: {e}")))
}
