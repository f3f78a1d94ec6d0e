//! The allocator sampler that `torchmem run` starts in the profiled process: a thread reading PyTorch's
//! allocator counters every interval (through torch's own bindings, found once) and streaming them to the
//! recorder's event socket; `allocator_counters` and `read_allocator_once` for the API. Whether it runs is an
//! atomic (`SAMPLER_PID`), read by the event writer on every marker without a lock.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use torchmem_core::sources::allocator::AllocatorCounters;

use crate::errors::Error;
use crate::events::{event_fd, write_all};
use crate::ledger::take_sampler_folded;
use crate::nvml::nvml_index_of_torch;
use crate::record_macro::read_only_record;

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
/// The pid of the process whose sampler thread runs (0: none). Set when the thread starts, cleared when it is
/// stopped or ends: the event writer reads it on every marker, without the lock.
static SAMPLER_PID: AtomicU32 = AtomicU32::new(0);
static ATEXIT_REGISTERED: AtomicBool = AtomicBool::new(false);

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
    // Ended (stopped, or the recorder's socket closed): markers flush their own events from now on.
    let _ = SAMPLER_PID.compare_exchange(std::process::id(), 0, Ordering::AcqRel, Ordering::Acquire);
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
        SAMPLER_PID.store(me, Ordering::Release);
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
    SAMPLER_PID.store(0, Ordering::Release);
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
    SAMPLER_PID.load(Ordering::Acquire) == pid
}

/// True when the sampler thread runs in this process.
#[pyfunction]
fn allocator_sampler_running() -> bool {
    sampler_running_in(std::process::id())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyAllocatorCounters>()?;
    m.add_function(wrap_pyfunction!(allocator_counters, m)?)?;
    m.add_function(wrap_pyfunction!(read_allocator_once, m)?)?;
    m.add_function(wrap_pyfunction!(start_allocator_sampler, m)?)?;
    m.add_function(wrap_pyfunction!(stop_allocator_sampler, m)?)?;
    m.add_function(wrap_pyfunction!(allocator_sampler_running, m)?)?;
    Ok(())
}
