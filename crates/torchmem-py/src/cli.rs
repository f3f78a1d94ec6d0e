//! `cli_main`: the `torchmem` console script of the wheel runs the Rust CLI with this interpreter's argv.
//! Arguments travel as bytes (`os.fsencode`), so a non-UTF-8 file name reaches the CLI unchanged.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use pyo3::prelude::*;

/// `os.fsencode(s)` as an OsString: undoes Python's surrogateescape decoding of argv and paths.
fn fs_bytes(os: &Bound<'_, PyAny>, s: &Bound<'_, PyAny>) -> PyResult<OsString> {
    let b: Vec<u8> = os.call_method1("fsencode", (s,))?.extract()?;
    Ok(OsString::from_vec(b))
}

#[pyfunction]
fn cli_main(py: Python<'_>) -> PyResult<i32> {
    let sys = py.import("sys")?;
    let os = py.import("os")?;
    let argv = sys.getattr("argv")?;
    let mut args: Vec<OsString> = Vec::new();
    for (i, a) in argv.try_iter()?.enumerate() {
        // argv[0] is the console script or `…/torchmem/__main__.py` (python -m torchmem): usage
        // messages must say `torchmem`.
        args.push(if i == 0 { OsString::from("torchmem") } else { fs_bytes(&os, &a?)? });
    }
    if args.is_empty() {
        args.push(OsString::from("torchmem"));
    }
    let exe_obj = sys.getattr("executable")?;
    let exe = if exe_obj.is_none() { OsString::new() } else { fs_bytes(&os, &exe_obj)? };
    if std::env::var_os("TORCHMEM_PYTHON").is_none() && !exe.is_empty() {
        // SAFETY: set before any thread of ours starts; Python threads do not read this variable.
        unsafe { std::env::set_var("TORCHMEM_PYTHON", &exe) };
    }
    let code = py.detach(|| torchmem_cli::run(args));
    // The console script wrapper passes our return value to sys.exit.
    Ok(code)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    Ok(())
}
