//! The one place Rust errors become Python exceptions. Bindings return `Result<T, Error>` (or `PyResult`) and
//! write `?`; the `From` impls below sort every core, profile, snapshot, simulator and I/O error into a class:
//!
//! - `TorchmemError(Exception)`: the base users catch (alone: NVML unavailable, other tool failures);
//! - `InputError(TorchmemError, ValueError)`: a bad argument (malformed JSON, unknown kind, bad settings);
//! - `OomParseError(InputError)`: text that is not a PyTorch out-of-memory message;
//! - `ProfileError(TorchmemError, ValueError)`: a file that is not a readable torchmem profile;
//! - `SnapshotError(TorchmemError, ValueError)`: an allocator snapshot that cannot be read;
//! - I/O: the matching `OSError` subclass (`FileNotFoundError`, `PermissionError`, `IsADirectoryError`, …);
//!   a missing profile or snapshot is `FileNotFoundError` with the CLI's message.
//!
//! The bad-input classes are `ValueError`s, so code written against the old `except ValueError` keeps working.

use std::io::ErrorKind;
use std::path::PathBuf;

use pyo3::create_exception;
use pyo3::exceptions::{self as exc, PyException};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};
use torchmem_core::CoreError;

create_exception!(torchmem, TorchmemError, PyException, "Base class of torchmem's errors.");

/// Every failure a binding can report, before it becomes a Python exception (`From<Error> for PyErr`).
#[derive(Debug)]
pub enum Error {
    /// A core error outside reading a profile (JSON of markers, NVML, …).
    Core(CoreError),
    /// Opening or reading a profile file: the message is the one `torchmem report` prints.
    Profile(CoreError),
    Snapshot(torchmem_snapshot::SnapshotError),
    /// A bad argument value.
    Input(String),
    OomParse(String),
    /// An I/O failure, with the file it concerned when known.
    Io {
        path: Option<PathBuf>,
        source: std::io::Error,
    },
    /// A tool failure that is not the caller's input (NVML unavailable, a thread that cannot start).
    Tool(String),
    /// The binding is in the wrong state for the call (e.g. the line profiler is busy).
    Runtime(String),
    Python(PyErr),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io_at(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io { path: Some(path.into()), source }
    }
}

impl From<CoreError> for Error {
    fn from(e: CoreError) -> Error {
        match e {
            CoreError::NotAProfile { .. } | CoreError::DamagedProfile { .. } | CoreError::ProfileMissing { .. } => {
                Error::Profile(e)
            }
            CoreError::Io(source) => Error::Io { path: None, source },
            other => Error::Core(other),
        }
    }
}

impl From<torchmem_snapshot::SnapshotError> for Error {
    fn from(e: torchmem_snapshot::SnapshotError) -> Error {
        Error::Snapshot(e)
    }
}

impl From<torchmem_sim::SimError> for Error {
    fn from(e: torchmem_sim::SimError) -> Error {
        match e {
            torchmem_sim::SimError::Snapshot(e) => Error::Snapshot(e),
            other => Error::Input(other.to_string()),
        }
    }
}

impl From<torchmem_sim::ConfError> for Error {
    fn from(e: torchmem_sim::ConfError) -> Error {
        Error::Input(e.to_string())
    }
}

impl From<std::io::Error> for Error {
    fn from(source: std::io::Error) -> Error {
        Error::Io { path: None, source }
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Error {
        Error::Input(format!("JSON: {e}"))
    }
}

impl From<PyErr> for Error {
    fn from(e: PyErr) -> Error {
        Error::Python(e)
    }
}

/// The classes with two bases (`create_exception!` takes one), made once with `type(name, bases, ns)`.
struct Classes {
    input: Py<PyType>,
    oom_parse: Py<PyType>,
    profile: Py<PyType>,
    snapshot: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

fn make_class(py: Python<'_>, name: &str, doc: &str, bases: &Bound<'_, PyTuple>) -> PyResult<Py<PyType>> {
    let ns = PyDict::new(py);
    ns.set_item("__module__", "torchmem")?;
    ns.set_item("__doc__", doc)?;
    let ty = py.get_type::<PyType>().call1((name, bases, ns))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

fn classes(py: Python<'_>) -> PyResult<&Classes> {
    CLASSES.get_or_try_init(py, || {
        let base = py.get_type::<TorchmemError>();
        let value = py.get_type::<exc::PyValueError>();
        let two = PyTuple::new(py, [base.as_any(), value.as_any()])?;
        let input =
            make_class(py, "InputError", "A bad argument value (malformed JSON, unknown kind, bad settings).", &two)?;
        let one = PyTuple::new(py, [input.bind(py).as_any()])?;
        Ok(Classes {
            oom_parse: make_class(py, "OomParseError", "Text that is not a PyTorch out-of-memory message.", &one)?,
            profile: make_class(
                py,
                "ProfileError",
                "A file that is not a readable torchmem profile (not a profile, damaged, truncated, too new).",
                &two,
            )?,
            snapshot: make_class(
                py,
                "SnapshotError",
                "An allocator snapshot cannot be read (truncated, malicious or not a snapshot).",
                &two,
            )?,
            input,
        })
    })
}

fn raise(py: Python<'_>, ty: &Py<PyType>, msg: String) -> PyErr {
    PyErr::from_type(ty.bind(py).clone(), msg)
}

/// The `OSError` subclass Python itself would raise for this kind of failure.
fn os_error(kind: ErrorKind, args: impl pyo3::PyErrArguments + 'static) -> PyErr {
    match kind {
        ErrorKind::NotFound => exc::PyFileNotFoundError::new_err(args),
        ErrorKind::PermissionDenied => exc::PyPermissionError::new_err(args),
        ErrorKind::AlreadyExists => exc::PyFileExistsError::new_err(args),
        ErrorKind::IsADirectory => exc::PyIsADirectoryError::new_err(args),
        ErrorKind::NotADirectory => exc::PyNotADirectoryError::new_err(args),
        ErrorKind::Interrupted => exc::PyInterruptedError::new_err(args),
        ErrorKind::BrokenPipe => exc::PyBrokenPipeError::new_err(args),
        ErrorKind::TimedOut => exc::PyTimeoutError::new_err(args),
        ErrorKind::WouldBlock => exc::PyBlockingIOError::new_err(args),
        _ => exc::PyOSError::new_err(args),
    }
}

impl From<Error> for PyErr {
    fn from(e: Error) -> PyErr {
        Python::attach(|py| {
            let c = match classes(py) {
                Ok(c) => c,
                Err(err) => return err,
            };
            match e {
                Error::Profile(CoreError::ProfileMissing { path }) => {
                    let msg = CoreError::ProfileMissing { path }.to_string();
                    exc::PyFileNotFoundError::new_err((libc::ENOENT, msg))
                }
                Error::Profile(e) => raise(py, &c.profile, e.to_string()),
                Error::Core(e @ (CoreError::Json(_) | CoreError::Invalid(_))) => raise(py, &c.input, e.to_string()),
                Error::Core(e) => TorchmemError::new_err(e.to_string()),
                Error::Snapshot(e @ torchmem_snapshot::SnapshotError::NotFound { .. }) => {
                    exc::PyFileNotFoundError::new_err((libc::ENOENT, e.to_string()))
                }
                Error::Snapshot(e) => raise(py, &c.snapshot, e.to_string()),
                Error::Input(msg) => raise(py, &c.input, msg),
                Error::OomParse(msg) => raise(py, &c.oom_parse, msg),
                Error::Tool(msg) => TorchmemError::new_err(msg),
                Error::Runtime(msg) => exc::PyRuntimeError::new_err(msg),
                Error::Io { path, source } => {
                    let errno = source.raw_os_error().unwrap_or(0);
                    let strerror = match source.raw_os_error() {
                        // "Permission denied (os error 13)" -> "Permission denied", as Python's own open() says.
                        Some(_) => source.to_string().split(" (os error").next().unwrap_or_default().to_string(),
                        None => source.to_string(),
                    };
                    match (source.raw_os_error(), path) {
                        (Some(_), Some(p)) => os_error(source.kind(), (errno, strerror, p.display().to_string())),
                        (Some(_), None) => os_error(source.kind(), (errno, strerror)),
                        // Our own message (it names the file already): no errno to show.
                        (None, _) => os_error(source.kind(), (strerror,)),
                    }
                }
                Error::Python(e) => e,
            }
        })
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let c = classes(py)?;
    m.add("TorchmemError", py.get_type::<TorchmemError>())?;
    m.add("InputError", c.input.bind(py))?;
    m.add("OomParseError", c.oom_parse.bind(py))?;
    m.add("ProfileError", c.profile.bind(py))?;
    m.add("SnapshotError", c.snapshot.bind(py))?;
    Ok(())
}
