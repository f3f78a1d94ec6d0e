//! The line-by-line memory profiler's native side: hooks (`line/hooks.rs`), per-line accounting
//! (`line/state.rs`), the clock and memory readers (`line/sampler.rs`), and the bindings that
//! `python/torchmem/line_profiler.py` drives. Rendering is `torchmem_core::lines`.

use pyo3::prelude::*;
use pyo3::types::PyDict;

mod hooks;
mod sampler;
mod state;

use state::{Gpu, Profiler, PROFILER};

use crate::convert::{from_py, to_py};
use crate::errors::{Error, Result};

/// Start (or restart) the profiler. `hook` is "settrace" or "monitoring"; `gate_ns` overrides the
/// calibrated gate (0 reads memory at every event); `gpu_probe()` returns `None` until CUDA is
/// initialised, then `(device, stats, reset)`: the allocator's own `_cuda_memoryStats` and the peak ledger's
/// reset for the line profiler.
#[pyfunction]
#[pyo3(signature = (hook, gate_ns=None, gpu_probe=None))]
fn line_start<'py>(
    py: Python<'py>,
    hook: &str,
    gate_ns: Option<f64>,
    gpu_probe: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let hook: &'static str = match hook {
        "settrace" => "settrace",
        "monitoring" => "monitoring",
        other => {
            return Err(Error::Input(format!(
                "unknown hook {other:?}: use \"settrace\" (Python ≤ 3.11) or \"monitoring\" (≥ 3.12)"
            ))
            .into())
        }
    };
    let tps = sampler::ticks_per_second();
    let fault_ticks = sampler::min_page_fault_ticks();
    let gate_ticks = match gate_ns {
        Some(ns) => (ns.max(0.0) * tps / 1e9) as u64,
        None => fault_ticks / 2,
    };
    let gpu = match gpu_probe {
        Some(p) => Gpu::Waiting { probe: p },
        None => Gpu::Off,
    };
    let mut g = PROFILER.0.try_borrow_mut().map_err(|_| Error::Runtime("line profiler busy".into()))?;
    match g.as_mut() {
        Some(p) => {
            p.active = true;
            p.hook = hook;
            p.gate_ticks = gate_ticks;
            p.ticks_per_s = tps;
            if !matches!(p.gpu, Gpu::Ready { .. }) {
                p.gpu = gpu;
            }
        }
        None => *g = Some(Profiler::new(hook, gate_ticks, tps, gpu)),
    }
    let d = PyDict::new(py);
    d.set_item("hook", hook)?;
    d.set_item("gate_ns", gate_ticks as f64 * 1e9 / tps)?;
    d.set_item("min_page_fault_ns", fault_ticks as f64 * 1e9 / tps)?;
    Ok(d)
}

/// The peak ledger's fold: another torchmem reader read `peak_bytes` as CUDA device `device`'s allocated
/// peak just before resetting the counters; the profiler's next read of that device counts it.
#[pyfunction]
fn line_fold_gpu_peak(device: i64, peak_bytes: i64) {
    state::with(|p| {
        if matches!(p.gpu, Gpu::Ready { device: d, .. } if d == device) {
            p.gpu_folded_peak_bytes = p.gpu_folded_peak_bytes.max(peak_bytes);
        }
    });
}

/// Stop accounting (hooks may still call in; they return at once).
#[pyfunction]
fn line_stop() {
    state::with(|p| p.active = false);
}

/// Forget all numbers (the registered code objects stay).
#[pyfunction]
fn line_clear() {
    state::with(|p| p.clear_stats());
}

/// Register a code object to profile. `offsets` is `list(code.co_lines())` as (start, end, line).
#[pyfunction]
fn line_add_code(code: Py<PyAny>, first_line: u32, offsets: Vec<(u32, u32, Option<u32>)>) -> PyResult<u32> {
    let offsets = offsets.into_iter().filter_map(|(s, e, l)| l.map(|l| (s, e, l))).collect();
    state::with(|p| p.add_code(code, first_line, offsets))
        .ok_or_else(|| Error::Runtime("line profiler not started (call line_start)".into()).into())
}

/// `matcher(code) -> bool`, asked once per unknown code object at its first call (for `--line=SPEC`);
/// it registers accepted code with `line_add_code` itself.
#[pyfunction]
#[pyo3(signature = (matcher=None))]
fn line_set_matcher(matcher: Option<Py<PyAny>>) {
    state::with(|p| p.matcher = matcher);
}

/// `sys.monitoring.DISABLE`, returned from PY_START for code that is not profiled.
#[pyfunction]
fn line_set_disable(obj: Py<PyAny>) {
    state::with(|p| p.disable = Some(obj));
}

/// The raw FASTCALL callbacks for sys.monitoring: keys "line", "start", "resume", "exit".
#[pyfunction]
fn line_monitoring_callbacks(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in hooks::monitoring_callbacks(py)? {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Install (`on=True`) or remove the C trace function on the calling thread (Python ≤ 3.11).
#[pyfunction]
fn line_trace_install(on: bool) -> bool {
    hooks::trace_install(on)
}

/// Python ≤ 3.11: install the C trace function on every existing thread (the calling one included).
/// Returns how many threads got it, or None where the interpreter does not export what this needs.
#[pyfunction]
fn line_trace_install_all() -> Option<usize> {
    hooks::trace_install_all_threads()
}

/// For `threading.settrace`: installs the C trace function in each new thread, then steps aside.
#[pyfunction]
fn line_thread_installer(_frame: &Bound<'_, PyAny>, _event: &Bound<'_, PyAny>, _arg: &Bound<'_, PyAny>) {
    let on = state::with(|p| p.active).unwrap_or(false);
    if on {
        hooks::trace_install(true);
    }
}

/// Everything measured so far: {"functions": [{code, calls, threads, lines: [(line, hits, rss_after,
/// cpu_delta, cpu_delta_max, gpu_alloc_delta|None, gpu_peak|None, gpu_reserved_delta|None)]}],
/// "warnings", "reads", "events", "gate_ns", "hook", "gpu"}.
#[pyfunction]
fn line_snapshot(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let g = PROFILER.0.try_borrow().map_err(|_| Error::Runtime("line profiler busy".into()))?;
    let d = PyDict::new(py);
    let Some(p) = g.as_ref() else {
        d.set_item("functions", Vec::<Py<PyAny>>::new())?;
        return Ok(d);
    };
    d.set_item("functions", p.snapshot(py)?)?;
    d.set_item("warnings", p.warnings.clone())?;
    d.set_item("reads", p.reads)?;
    d.set_item("events", p.events)?;
    d.set_item("gate_ns", p.gate_ticks as f64 * 1e9 / p.ticks_per_s)?;
    d.set_item("hook", p.hook)?;
    d.set_item(
        "gpu_device",
        match &p.gpu {
            Gpu::Ready { device, .. } if p.gpu_seen => Some(*device),
            _ => None,
        },
    )?;
    Ok(d)
}

/// Line-profile payloads (one dict, or a list of them) as typed line profiles (`lines::LineProfile`); a dict that is not one is skipped.
fn read_payloads(obj: &Bound<'_, PyAny>) -> Result<Vec<torchmem_core::lines::LineProfile>> {
    const FORM: &str = "a line-profile payload (a dict) or a list of them";
    let list = match from_py(obj, FORM)? {
        serde_json::Value::Array(a) => a,
        other => vec![other],
    };
    match list.iter().find(|p| !p.is_object()) {
        Some(bad) => Err(Error::Input(format!("not {FORM}: {bad}"))),
        None => Ok(torchmem_core::lines::parse(&list)),
    }
}

/// memory_profiler-style tables for line-profile payloads (Rust renders).
#[pyfunction]
fn line_render_text(payloads: &Bound<'_, PyAny>) -> Result<String> {
    Ok(torchmem_core::lines::render_text(&read_payloads(payloads)?))
}

/// The self-contained HTML fragment for line-profile payloads.
#[pyfunction]
fn line_render_html(payloads: &Bound<'_, PyAny>) -> Result<String> {
    Ok(torchmem_core::lines::render_html(&read_payloads(payloads)?))
}

/// The `lines` section of `torchmem report --format json`, as a dict.
#[pyfunction]
fn line_report<'py>(py: Python<'py>, payloads: &Bound<'py, PyAny>) -> Result<Bound<'py, PyAny>> {
    to_py(py, &torchmem_core::lines::to_json(&read_payloads(payloads)?))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(line_start, m)?)?;
    m.add_function(wrap_pyfunction!(line_stop, m)?)?;
    m.add_function(wrap_pyfunction!(line_fold_gpu_peak, m)?)?;
    m.add_function(wrap_pyfunction!(line_clear, m)?)?;
    m.add_function(wrap_pyfunction!(line_add_code, m)?)?;
    m.add_function(wrap_pyfunction!(line_set_matcher, m)?)?;
    m.add_function(wrap_pyfunction!(line_set_disable, m)?)?;
    m.add_function(wrap_pyfunction!(line_monitoring_callbacks, m)?)?;
    m.add_function(wrap_pyfunction!(line_trace_install, m)?)?;
    m.add_function(wrap_pyfunction!(line_trace_install_all, m)?)?;
    m.add_function(wrap_pyfunction!(line_thread_installer, m)?)?;
    m.add_function(wrap_pyfunction!(line_snapshot, m)?)?;
    m.add_function(wrap_pyfunction!(line_render_text, m)?)?;
    m.add_function(wrap_pyfunction!(line_render_html, m)?)?;
    m.add_function(wrap_pyfunction!(line_report, m)?)?;
    Ok(())
}
