//! The program's side of the peak ledger (`python/torchmem/_ledger.py` drives it): what the allocator's `peak`
//! stats read to the program although torchmem resets them (`program_peaks_*`), and the peaks the allocator
//! sampler folds in before a reset (`sampler_fold_peak`). The line profiler's half is `line::line_fold_gpu_peak`.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use torchmem_core::sources::allocator::AllocatorCounters;

/// Per CUDA device: the highest value each `peak` stat of `_cuda_memoryStats`'s nested dict held just before
/// each of torchmem's resets since the program's own last reset (or start), keyed by the stat's path (the
/// Python hashes of its keys, mixed: "allocated_bytes" → "all" → "peak"; stable within the process). The
/// program reads `max(this, the counter now)`, so torchmem's resets are not seen.
type PeakPaths = std::collections::HashMap<u64, i64>;
static PROGRAM_PEAKS: Mutex<Vec<(i64, PeakPaths)>> = Mutex::new(Vec::new());

/// What `walk_peaks` calls for each stat: `(path, the stat's dict, its peak)`.
type PeakVisitor<'a> = dyn FnMut(u64, &Bound<'_, PyDict>, i64) -> PyResult<()> + 'a;

fn mix_path(parent: u64, key_hash: u64) -> u64 {
    (parent.rotate_left(5) ^ key_hash).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Calls `visit(path, dict, peak)` for every dict in `nested` (any depth) that has an integer "peak" key (a
/// stat's dict; what lies under such a dict is not walked).
fn walk_peaks(
    d: &Bound<'_, PyDict>,
    path: u64,
    peak_key: &Bound<'_, pyo3::types::PyString>,
    visit: &mut PeakVisitor<'_>,
) -> PyResult<()> {
    if let Some(v) = d.get_item(peak_key)? {
        if let Ok(peak) = v.extract::<i64>() {
            // A stat's own dict ({current, peak, allocated, freed}): nothing nested below it.
            return visit(path, d, peak);
        }
    }
    for (k, v) in d.iter() {
        if let Ok(sub) = v.cast::<PyDict>() {
            walk_peaks(sub, mix_path(path, k.hash()? as u64), peak_key, visit)?;
        }
    }
    Ok(())
}

fn walk_nested(nested: &Bound<'_, PyAny>, visit: &mut PeakVisitor<'_>) -> PyResult<()> {
    let Ok(d) = nested.cast::<PyDict>() else { return Ok(()) };
    walk_peaks(d, 0, pyo3::intern!(nested.py(), "peak"), visit)
}

fn with_program_peaks<T>(device: i64, f: impl FnOnce(&mut PeakPaths) -> T) -> T {
    let mut all = PROGRAM_PEAKS.lock().unwrap_or_else(|p| p.into_inner());
    let i = match all.iter().position(|(d, _)| *d == device) {
        Some(i) => i,
        None => {
            all.push((device, PeakPaths::new()));
            all.len() - 1
        }
    };
    f(&mut all[i].1)
}

/// Folds every `peak` stat of `nested` (read just before torchmem resets device `device`) into the program's
/// ledger.
#[pyfunction]
fn program_peaks_fold(device: i64, nested: &Bound<'_, PyAny>) -> PyResult<()> {
    with_program_peaks(device, |ledger| {
        walk_nested(nested, &mut |path, _, peak| {
            let v = ledger.entry(path).or_insert(peak);
            *v = (*v).max(peak);
            Ok(())
        })
    })
}

/// Raises, in place, every `peak` stat of `nested` (a fresh dict from the allocator) to the program's ledger:
/// what the program would read had torchmem never reset the counters. Returns `nested`.
#[pyfunction]
fn program_peaks_apply<'py>(device: i64, nested: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    with_program_peaks(device, |ledger| {
        if ledger.is_empty() {
            return Ok(());
        }
        walk_nested(&nested, &mut |path, d, peak| {
            if let Some(&folded) = ledger.get(&path) {
                if folded > peak {
                    d.set_item("peak", folded)?;
                }
            }
            Ok(())
        })
    })?;
    Ok(nested)
}

/// Forgets the program's ledger of device `device` (the program reset its peaks itself).
#[pyfunction]
fn program_peaks_clear(device: i64) {
    with_program_peaks(device, |ledger| ledger.clear());
}

/// Per device: the highest peaks (allocated, reserved) another reader read just before resetting the
/// counters (the peak ledger folds them in) since the sampler's last read. A sample's peak is at least
/// these, so a spike that a window's reset took from the counter between two samples is still in the
/// profile.
static SAMPLER_FOLDED: Mutex<Vec<(u32, u64, u64)>> = Mutex::new(Vec::new());

/// The peak ledger's fold for the sampler: device `device`'s peaks read just before a reset.
#[pyfunction]
fn sampler_fold_peak(device: i64, peak_allocated_bytes: i64, peak_reserved_bytes: i64) {
    let Ok(dev) = u32::try_from(device) else { return };
    let (alloc, reserved) = (peak_allocated_bytes.max(0) as u64, peak_reserved_bytes.max(0) as u64);
    let mut folded = SAMPLER_FOLDED.lock().unwrap_or_else(|p| p.into_inner());
    match folded.iter_mut().find(|(d, _, _)| *d == dev) {
        Some(f) => {
            f.1 = f.1.max(alloc);
            f.2 = f.2.max(reserved);
        }
        None => folded.push((dev, alloc, reserved)),
    }
}

/// Raises `c`'s peaks to what was folded for `dev` since the last read, and forgets it.
pub(crate) fn take_sampler_folded(dev: u32, c: &mut AllocatorCounters) {
    let mut folded = SAMPLER_FOLDED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = folded.iter().position(|(d, _, _)| *d == dev) {
        let (_, alloc, reserved) = folded.swap_remove(i);
        c.peak_allocated_bytes = c.peak_allocated_bytes.max(alloc);
        c.peak_reserved_bytes = c.peak_reserved_bytes.max(reserved);
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(program_peaks_fold, m)?)?;
    m.add_function(wrap_pyfunction!(program_peaks_apply, m)?)?;
    m.add_function(wrap_pyfunction!(program_peaks_clear, m)?)?;
    m.add_function(wrap_pyfunction!(sampler_fold_peak, m)?)?;
    Ok(())
}
