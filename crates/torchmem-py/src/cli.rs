//! `cli_main`: the `torchmem` console script of the wheel runs the Rust CLI with this interpreter's argv.

use pyo3::prelude::*;

#[pyfunction]
fn cli_main(py: Python<'_>) -> PyResult<i32> {
    let sys = py.import("sys")?;
    let argv: Vec<String> = sys.getattr("argv")?.extract()?;
    let exe: String = sys.getattr("executable")?.extract()?;
    if std::env::var_os("TORCHMEM_PYTHON").is_none() && !exe.is_empty() {
        // SAFETY: set before any thread of ours starts; Python threads do not read this variable.
        unsafe { std::env::set_var("TORCHMEM_PYTHON", &exe) };
    }
    let args: Vec<std::ffi::OsString> = argv.into_iter().map(Into::into).collect();
    let code = py.detach(|| torchmem_cli::run(args));
    // The console script wrapper passes our return value to sys.exit.
    Ok(code)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    Ok(())
}
