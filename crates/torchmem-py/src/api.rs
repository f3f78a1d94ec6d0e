//! Bindings for what the Python API must run inside the user's process: this process's memory (/proc), NVML's
//! view of it, the Monitor's summaries rendered by the core, the program's side of the peak ledger (what the
//! allocator's `peak` stats read to the program although torchmem resets them; `python/torchmem/_ledger.py`
//! drives it), and the allocator sampler thread that `torchmem run` starts to stream PyTorch's allocator
//! counters to the recorder.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use torchmem_core::sources::allocator::AllocatorCounters;
use torchmem_core::sources::gpu::{nvml_index_of_torch_device, NvmlLib};
use torchmem_core::sources::{device_info, self_proc};

use crate::convert::to_py;
use crate::errors::{Error, Result};

/// A read-only record for Python around one of core's `u64` records (`$ty` is a newtype of it): one getter per
/// field, named as core's field, and a repr `Name(field=value, ...)` that names each (one list).
macro_rules! read_only_record {
    ($ty:ident, $name:literal, $($field:ident),+ $(,)?) => {
        #[pymethods]
        impl $ty {
            $(
                #[getter]
                fn $field(&self) -> u64 {
                    self.0.$field
                }
            )+

            fn __repr__(&self) -> String {
                let fields = [$(format!(concat!(stringify!($field), "={}"), self.0.$field)),+];
                format!(concat!($name, "({})"), fields.join(", "))
            }
        }
    };
}

// --- this process's memory -------------------------------------------------------------------------------

/// This process's RSS and peak RSS, in bytes, from one read of /proc/self/status: core's `SelfMemory`
/// (read-only attributes) behind `self_memory`.
#[pyclass(frozen, eq, module = "torchmem._native", name = "SelfMemory")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PySelfMemory(self_proc::SelfMemory);

read_only_record!(PySelfMemory, "SelfMemory", rss_bytes, peak_rss_bytes);

/// RSS and peak RSS from one read of /proc/self/status; None where /proc is missing.
#[pyfunction]
fn self_memory() -> Option<PySelfMemory> {
    self_proc::self_memory().map(PySelfMemory)
}

/// RSS in bytes from /proc/self/statm (the cheapest read).
#[pyfunction]
fn self_rss_bytes() -> Option<u64> {
    self_proc::self_rss_bytes()
}

/// This process's /proc/self/smaps_rollup, in bytes: core's `procfs::Rollup` (read-only attributes) behind
/// `self_rollup`.
#[pyclass(frozen, eq, module = "torchmem._native", name = "SmapsRollup")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PySmapsRollup(torchmem_core::sources::procfs::Rollup);

read_only_record!(PySmapsRollup, "SmapsRollup", rss_bytes, pss_bytes, uss_bytes, swap_bytes);

/// RSS, PSS, USS and swap from /proc/self/smaps_rollup (milliseconds on big processes); None where missing.
#[pyfunction]
fn self_rollup(py: Python<'_>) -> Option<PySmapsRollup> {
    let pid = std::process::id();
    py.detach(|| torchmem_core::sources::procfs::smaps_rollup(pid)).map(PySmapsRollup)
}

/// What glibc's malloc keeps freed, for reuse (`mallinfo2().fordblks`); None where not glibc >= 2.33.
#[pyfunction]
fn malloc_free_bytes() -> Option<u64> {
    self_proc::malloc_free_bytes()
}

/// RSS now and the highest RSS since torchmem's peak period started (its own counter: the kernel's peak
/// is never reset); None where /proc is missing.
#[pyfunction]
fn rss_period_peak() -> Option<PySelfMemory> {
    self_proc::rss_period_peak().map(PySelfMemory)
}

/// Ends torchmem's peak period (returns `rss_period_peak()` read just before) and starts the next one.
#[pyfunction]
fn rss_period_restart() -> Option<PySelfMemory> {
    self_proc::rss_period_restart().map(PySelfMemory)
}

/// How many peak windows are open: while one is, a thread samples RSS every 5 ms into the period.
#[pyfunction]
fn watch_rss(open_windows: usize) -> bool {
    self_proc::watch_rss(open_windows)
}

/// glibc `malloc_trim(0)`: gives freed heap pages back to the kernel. True when something was released.
#[pyfunction]
fn malloc_trim(py: Python<'_>) -> bool {
    py.detach(self_proc::malloc_trim)
}

/// torchmem's byte formatter (`torchmem-units`): reports' style.
#[pyfunction]
fn format_bytes(bytes: u64) -> String {
    torchmem_core::units::format_bytes(bytes)
}

/// torchmem's byte formatter in PyTorch's style (two decimals in every unit: `32.00 MiB`).
#[pyfunction]
fn format_bytes_torch(bytes: u64) -> String {
    torchmem_core::units::format_bytes_torch(bytes)
}

// --- NVML ------------------------------------------------------------------------------------------------

static NVML: OnceLock<std::result::Result<Mutex<NvmlLib>, String>> = OnceLock::new();

/// NVML, opened once per process (core's one wrapper, `sources::gpu::NvmlLib`).
fn nvml() -> Result<&'static Mutex<NvmlLib>> {
    NVML.get_or_init(|| NvmlLib::open().map(Mutex::new).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| Error::Tool(e.clone()))
}

/// Why NVML cannot be used here, or None when it can (opens it once per process).
#[pyfunction]
fn nvml_error(py: Python<'_>) -> Option<String> {
    py.detach(|| nvml().err().map(|e| PyErr::from(e).to_string()))
}

/// The NVML index of torch's CUDA device `torch_index` (`sources::gpu::nvml_index_of_torch_device`: by
/// torch's `uuid` of it, else by CUDA_VISIBLE_DEVICES, else torch's index); None without NVML or when
/// CUDA_VISIBLE_DEVICES names the device in a way NVML cannot map.
#[pyfunction]
#[pyo3(signature = (torch_index, uuid=None))]
fn nvml_index_of_device(py: Python<'_>, torch_index: u32, uuid: Option<String>) -> Option<u32> {
    py.detach(|| nvml_index_of_torch(torch_index, uuid.as_deref()))
}

/// The one rule, read without the interpreter (opening NVML can take milliseconds).
fn nvml_index_of_torch(torch_index: u32, uuid: Option<&str>) -> Option<u32> {
    let nvml = nvml().ok()?.lock().expect("NVML lock");
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    nvml_index_of_torch_device(|u| nvml.index_of_uuid(u), torch_index, uuid, visible.as_deref())
}

/// One NVML read of a device, in bytes: what `nvml_read` returns (`torchmem.stats()`'s device numbers).
#[pyclass(frozen, get_all, eq, module = "torchmem._native")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmlReading {
    total_bytes: u64,
    used_bytes: u64,
    free_bytes: u64,
    /// What NVML charges to the pid asked about; None when NVML lists no such process on the device.
    process_bytes: Option<u64>,
    /// What NVML charges to every other process on the device.
    other_processes_bytes: u64,
}

#[pymethods]
impl NvmlReading {
    /// A reading built by hand (tests, fakes of NVML); `nvml_read` makes the real ones.
    #[new]
    #[pyo3(signature = (*, total_bytes, used_bytes, free_bytes, process_bytes, other_processes_bytes))]
    fn new(
        total_bytes: u64,
        used_bytes: u64,
        free_bytes: u64,
        process_bytes: Option<u64>,
        other_processes_bytes: u64,
    ) -> Self {
        NvmlReading { total_bytes, used_bytes, free_bytes, process_bytes, other_processes_bytes }
    }

    fn __repr__(&self) -> String {
        let process = self.process_bytes.map_or_else(|| "None".to_owned(), |b| b.to_string());
        format!(
            "NvmlReading(total_bytes={}, used_bytes={}, free_bytes={}, process_bytes={process}, \
             other_processes_bytes={})",
            self.total_bytes, self.used_bytes, self.free_bytes, self.other_processes_bytes
        )
    }
}

/// NVML device `index` now, with what NVML charges to `pid` and to the other processes.
#[pyfunction]
fn nvml_read(py: Python<'_>, index: u32, pid: u32) -> Result<NvmlReading> {
    py.detach(|| {
        let r = nvml()?.lock().expect("NVML lock").read(index)?;
        Ok(NvmlReading {
            total_bytes: r.total_bytes,
            used_bytes: r.used_bytes,
            free_bytes: r.free_bytes,
            process_bytes: r.this_process_bytes(pid),
            other_processes_bytes: r.other_processes_bytes(pid),
        })
    })
}

/// The host and its NVIDIA devices (`sources::device_info::DeviceInfo` as a dict); never creates a CUDA context.
#[pyfunction]
#[pyo3(name = "device_info")]
fn device_info_dict(py: Python<'_>) -> Result<Bound<'_, PyAny>> {
    let pid = std::process::id();
    let info = py.detach(|| device_info::device_info(pid));
    to_py(py, &info)
}

// --- the program's peak ledger -------------------------------------------------------------------------

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

// --- allocator sampler -----------------------------------------------------------------------------------

/// torch objects the sampler calls, looked up once torch is fully imported.
struct TorchFns {
    is_initialized: Py<PyAny>,
    device_count: Py<PyAny>,
    memory_stats: Py<PyAny>,
}

fn lookup_torch(py: Python<'_>) -> Option<TorchFns> {
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    let modules = modules.cast::<PyDict>().ok()?;
    let torch = modules.get_item("torch").ok()??;
    let cuda = torch.getattr("cuda").ok()?;
    Some(TorchFns {
        is_initialized: cuda.getattr("is_initialized").ok()?.unbind(),
        device_count: cuda.getattr("device_count").ok()?.unbind(),
        memory_stats: raw_binding(torch.getattr("_C").ok()?.getattr("_cuda_memoryStats").ok()?).unbind(),
    })
}

/// The allocator's own binding behind torchmem's program-view wrapper (`_ledger.py` keeps it as
/// `_torchmem_raw`): the sampler reads the counters as they are, like the rest of torchmem.
fn raw_binding(f: Bound<'_, PyAny>) -> Bound<'_, PyAny> {
    f.getattr("_torchmem_raw").unwrap_or(f)
}

fn nested_u64(d: &Bound<'_, PyAny>, path: &[&str]) -> u64 {
    let mut cur = d.clone();
    for key in path {
        match cur.get_item(*key) {
            Ok(v) => cur = v,
            Err(_) => return 0,
        }
    }
    cur.extract::<i64>().map(|v| v.max(0) as u64).unwrap_or(0)
}

/// Reads the counters from `torch._C._cuda_memoryStats(dev)`'s nested dict.
fn counters_from_nested(d: &Bound<'_, PyAny>) -> AllocatorCounters {
    AllocatorCounters {
        allocated_bytes: nested_u64(d, &["allocated_bytes", "all", "current"]),
        reserved_bytes: nested_u64(d, &["reserved_bytes", "all", "current"]),
        peak_allocated_bytes: nested_u64(d, &["allocated_bytes", "all", "peak"]),
        peak_reserved_bytes: nested_u64(d, &["reserved_bytes", "all", "peak"]),
        active_bytes: nested_u64(d, &["active_bytes", "all", "current"]),
        inactive_split_bytes: nested_u64(d, &["inactive_split_bytes", "all", "current"]),
        num_alloc_retries: nested_u64(d, &["num_alloc_retries"]),
        num_ooms: nested_u64(d, &["num_ooms"]),
    }
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
fn take_sampler_folded(dev: u32, c: &mut AllocatorCounters) {
    let mut folded = SAMPLER_FOLDED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = folded.iter().position(|(d, _, _)| *d == dev) {
        let (_, alloc, reserved) = folded.swap_remove(i);
        c.peak_allocated_bytes = c.peak_allocated_bytes.max(alloc);
        c.peak_reserved_bytes = c.peak_reserved_bytes.max(reserved);
    }
}

/// One sampler tick (`sampler`: the thread's, which takes the peaks folded for it): the counters of every
/// device whose allocator has been used, by torch's device index, or nothing when torch is not imported or
/// CUDA not initialised (never initialises CUDA: that would cost ~500 MB of GPU memory).
fn sample_devices(py: Python<'_>, cache: &mut Option<TorchFns>, sampler: bool) -> Vec<(u32, AllocatorCounters)> {
    if cache.is_none() {
        *cache = lookup_torch(py);
    }
    let Some(fns) = cache.as_ref() else {
        return Vec::new();
    };
    let initialised = fns.is_initialized.bind(py).call0().and_then(|v| v.is_truthy()).unwrap_or(false);
    if !initialised {
        return Vec::new();
    }
    let count: u32 = fns.device_count.bind(py).call0().and_then(|v| v.extract()).unwrap_or(0);
    let mut out = Vec::new();
    for dev in 0..count {
        let Ok(d) = fns.memory_stats.bind(py).call1((dev,)) else {
            continue;
        };
        let mut c = counters_from_nested(&d);
        if sampler {
            take_sampler_folded(dev, &mut c);
        }
        if !c.never_used() {
            out.push((dev, c));
        }
    }
    out
}

/// torch's UUID of CUDA device `dev` (`torch.cuda.get_device_properties(dev).uuid`), without NVML's prefix.
fn torch_device_uuid(py: Python<'_>, dev: u32) -> Option<String> {
    let torch = py.import("sys").ok()?.getattr("modules").ok()?.get_item("torch").ok()?;
    let props = torch.getattr("cuda").ok()?.call_method1("get_device_properties", (dev,)).ok()?;
    props.getattr("uuid").ok()?.str().ok().map(|s| s.to_string())
}

/// Torch device index → NVML device index, learned once per device: the profile keys GPU rows by NVML index,
/// so the allocator's numbers land on the GPU they belong to even when CUDA_VISIBLE_DEVICES renumbers
/// devices for the program (torch's cuda:0 can be NVML's GPU 3).
#[derive(Default)]
struct DeviceMap {
    nvml_of: std::collections::HashMap<u32, u32>,
}

impl DeviceMap {
    /// UUIDs of devices not mapped yet (read with the interpreter attached).
    fn unknown_uuids(&self, py: Python<'_>, devices: &[(u32, AllocatorCounters)]) -> Vec<(u32, Option<String>)> {
        devices
            .iter()
            .filter(|(dev, _)| !self.nvml_of.contains_key(dev))
            .map(|(dev, _)| (*dev, torch_device_uuid(py, *dev)))
            .collect()
    }

    /// Maps them through NVML (without the interpreter: opening NVML can take milliseconds), by the rule
    /// `torchmem.stats()` uses; where it cannot say, torch's index.
    fn learn(&mut self, uuids: Vec<(u32, Option<String>)>) {
        for (dev, uuid) in uuids {
            let index = nvml_index_of_torch(dev, uuid.as_deref()).unwrap_or(dev);
            self.nvml_of.insert(dev, index);
        }
    }

    fn nvml_index(&self, dev: u32) -> u32 {
        self.nvml_of.get(&dev).copied().unwrap_or(dev)
    }
}

/// The counters of one device as the sampler reads them, for Python: core's `AllocatorCounters` (one field per
/// counter, read-only) behind `allocator_counters`.
#[pyclass(frozen, eq, module = "torchmem._native", name = "AllocatorCounters")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PyAllocatorCounters(AllocatorCounters);

read_only_record!(
    PyAllocatorCounters,
    "AllocatorCounters",
    allocated_bytes,
    reserved_bytes,
    peak_allocated_bytes,
    peak_reserved_bytes,
    active_bytes,
    inactive_split_bytes,
    num_alloc_retries,
    num_ooms,
);

/// The counters of one device from a `_cuda_memoryStats` dict (missing keys read as 0), as the sampler reads them.
#[pyfunction]
fn allocator_counters(nested: &Bound<'_, PyAny>) -> PyAllocatorCounters {
    PyAllocatorCounters(counters_from_nested(nested))
}

/// One sampler read, returned instead of sent (to time it and to test it): wire lines keyed by NVML index.
#[pyfunction]
fn read_allocator_once(py: Python<'_>) -> Vec<String> {
    let devices = sample_devices(py, &mut None, false);
    let mut map = DeviceMap::default();
    let unknown = map.unknown_uuids(py, &devices);
    py.detach(|| map.learn(unknown));
    let t_ns = torchmem_core::clock::monotonic_ns();
    devices.iter().map(|(dev, c)| c.wire_line(t_ns, map.nvml_index(*dev))).collect()
}

struct Sampler {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
    /// The process that started the thread: after fork the child has the handle but not the thread.
    pid: u32,
}

static SAMPLER: Mutex<Option<Sampler>> = Mutex::new(None);
static ATEXIT_REGISTERED: AtomicBool = AtomicBool::new(false);

use crate::events::{event_fd, write_all};

/// Until the program has used CUDA, the interpreter is asked only every this many ticks (the buffered
/// events still go out every tick): a CPU-only program is not interrupted 100 times a second for nothing.
/// The allocator's peak counters are cumulative, so a later first read loses no peak.
const IDLE_TICKS_PER_READ: u32 = 10;

/// The sampler thread's body. It attaches to the interpreter once, for its whole life, and between reads only
/// releases and retakes the GIL (`PyEval_SaveThread`/`RestoreThread`, which allocate nothing). Attaching
/// afresh on every tick (`PyGILState_Ensure` from a thread without a thread state) allocates a new thread
/// state each time through `PyMem_RawCalloc`; on Python < 3.13 that allocation races `tracemalloc.stop()` in
/// another thread and segfaults in tracemalloc's `traceback_new` (CPython gh-128679) — a program that stops
/// tracemalloc, or torchmem's own leak probe, was killed by SIGSEGV about once in fifteen runs under load.
/// `ready` is signalled once the thread state exists, so that its one allocation happens while
/// `start_allocator_sampler` waits, not while the program runs.
fn sampler_loop(stop: Arc<AtomicBool>, fd: i32, interval: Duration, ready: std::sync::mpsc::Sender<()>) {
    // try_attach returns None once the interpreter is finalizing: the thread then just ends.
    let attached = Python::try_attach(|py| {
        let _ = ready.send(());
        sampler_ticks(py, &stop, fd, interval);
    });
    if attached.is_none() {
        let _ = ready.send(());
        crate::events::flush();
    }
}

fn sampler_ticks(py: Python<'_>, stop: &AtomicBool, fd: i32, interval: Duration) {
    let mut cache: Option<TorchFns> = None;
    let mut map = DeviceMap::default();
    let mut cuda_seen = false;
    let mut tick: u32 = 0;
    loop {
        // Detached until a read is due: idle ticks only flush the event buffer, without the GIL.
        // Stopping (at exit): one last read, so that a program whose GPU work ended between two idle reads
        // (every 10th tick) still leaves its peaks in the timeline.
        let stopping = py.detach(|| loop {
            std::thread::park_timeout(interval);
            let stopping = stop.load(Ordering::Acquire);
            tick = tick.wrapping_add(1);
            if stopping || cuda_seen || tick % IDLE_TICKS_PER_READ == 1 {
                return stopping;
            }
            crate::events::flush();
        });
        let devices = sample_devices(py, &mut cache, true);
        let t_ns = torchmem_core::clock::monotonic_ns();
        let unknown = map.unknown_uuids(py, &devices);
        cuda_seen |= !devices.is_empty();
        let sent = py.detach(|| {
            map.learn(unknown);
            // Each line is one write (< PIPE_BUF), so it never interleaves with the Python side's events.
            let sent = devices.iter().all(|(dev, c)| write_all(fd, c.wire_line(t_ns, map.nvml_index(*dev)).as_bytes()));
            // The Python API's buffered events go out on the same tick, without the interpreter.
            crate::events::flush();
            sent
        });
        if !sent || stopping {
            break;
        }
    }
    py.detach(crate::events::flush);
    // `cache`'s references to torch's functions are released here, with the interpreter attached.
    drop(cache);
}

/// Starts the thread that sends the allocator's counters to `torchmem run`'s recorder every `interval_ms`.
/// Returns False (and does nothing) when neither `TORCHMEM_EVENT_SOCKET` (the recorder's socket) nor
/// `TORCHMEM_EVENT_FD` (an inherited pipe) reaches a recorder; True when running.
#[pyfunction]
fn start_allocator_sampler(py: Python<'_>, interval_ms: f64) -> PyResult<bool> {
    if !(interval_ms.is_finite() && interval_ms > 0.0) {
        return Err(
            Error::Input(format!("interval_ms must be a positive number of milliseconds, got {interval_ms}")).into()
        );
    }
    let Some(fd) = event_fd() else {
        return Ok(false);
    };
    let me = std::process::id();
    {
        let mut guard = SAMPLER.lock().expect("sampler lock");
        if let Some(s) = guard.as_ref() {
            if s.pid == me && !s.thread.is_finished() {
                return Ok(true);
            }
        }
        if let Some(old) = guard.take() {
            // A finished thread, or one that belonged to our parent before fork: nothing to join here.
            if old.pid == me {
                let _ = old.thread.join();
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        // Any positive interval is taken (a huge one: a read only at exit); never a panic.
        let interval = Duration::try_from_secs_f64(interval_ms / 1000.0).unwrap_or(Duration::MAX);
        let thread_stop = stop.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("torchmem-allocator-sampler".into())
            .spawn(move || sampler_loop(thread_stop, fd, interval, ready_tx))
            .map_err(|e| Error::Tool(format!("cannot start the sampler thread: {e}")))?;
        *guard = Some(Sampler { stop, thread, pid: me });
        drop(guard);
        // Until the thread has its thread state (it needs the GIL to make one); an error means it ended.
        let _ = py.detach(move || ready_rx.recv());
    }
    if !ATEXIT_REGISTERED.swap(true, Ordering::AcqRel) {
        let stopper = wrap_pyfunction!(stop_allocator_sampler, py)?;
        py.import("atexit")?.call_method1("register", (stopper,))?;
    }
    Ok(true)
}

/// Stops and joins the sampler thread (called at interpreter exit too). True when one was running.
#[pyfunction]
fn stop_allocator_sampler(py: Python<'_>) -> bool {
    let taken = SAMPLER.lock().expect("sampler lock").take();
    let Some(s) = taken else { return false };
    if s.pid != std::process::id() {
        // Forked child: the thread lives only in the parent.
        return false;
    }
    s.stop.store(true, Ordering::Release);
    s.thread.thread().unpark();
    // Join detached: the thread may be waiting to attach, and must get the interpreter to finish its tick.
    py.detach(move || s.thread.join().is_ok())
}

/// True when the sampler thread runs in process `pid` (this one: it flushes the event buffer every tick).
pub fn sampler_running_in(pid: u32) -> bool {
    SAMPLER.lock().expect("sampler lock").as_ref().is_some_and(|s| s.pid == pid && !s.thread.is_finished())
}

/// True when the sampler thread runs in this process.
#[pyfunction]
fn allocator_sampler_running() -> bool {
    sampler_running_in(std::process::id())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    // The names a breakdown entry carries as `<name>_bytes` (core's `breakdown::Category`, one list).
    let categories: Vec<&str> = torchmem_core::breakdown::Category::ALL.iter().map(|c| c.as_str()).collect();
    m.add("BREAKDOWN_CATEGORIES", pyo3::types::PyTuple::new(m.py(), categories)?)?;
    m.add_class::<NvmlReading>()?;
    m.add_class::<PySelfMemory>()?;
    m.add_class::<PySmapsRollup>()?;
    m.add_class::<PyAllocatorCounters>()?;
    m.add_function(wrap_pyfunction!(self_memory, m)?)?;
    m.add_function(wrap_pyfunction!(self_rss_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(malloc_free_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(self_rollup, m)?)?;
    m.add_function(wrap_pyfunction!(rss_period_peak, m)?)?;
    m.add_function(wrap_pyfunction!(rss_period_restart, m)?)?;
    m.add_function(wrap_pyfunction!(watch_rss, m)?)?;
    m.add_function(wrap_pyfunction!(malloc_trim, m)?)?;
    m.add_function(wrap_pyfunction!(format_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(format_bytes_torch, m)?)?;
    m.add_function(wrap_pyfunction!(nvml_error, m)?)?;
    m.add_function(wrap_pyfunction!(nvml_index_of_device, m)?)?;
    m.add_function(wrap_pyfunction!(nvml_read, m)?)?;
    m.add_function(wrap_pyfunction!(device_info_dict, m)?)?;
    m.add_function(wrap_pyfunction!(allocator_counters, m)?)?;
    m.add_function(wrap_pyfunction!(program_peaks_fold, m)?)?;
    m.add_function(wrap_pyfunction!(program_peaks_apply, m)?)?;
    m.add_function(wrap_pyfunction!(program_peaks_clear, m)?)?;
    m.add_function(wrap_pyfunction!(sampler_fold_peak, m)?)?;
    m.add_function(wrap_pyfunction!(read_allocator_once, m)?)?;
    m.add_function(wrap_pyfunction!(start_allocator_sampler, m)?)?;
    m.add_function(wrap_pyfunction!(stop_allocator_sampler, m)?)?;
    m.add_function(wrap_pyfunction!(allocator_sampler_running, m)?)?;
    Ok(())
}
