//! The line profiler's state and its accounting, shared by both hook paths (settrace, sys.monitoring).
//!
//! Every event arrives on a thread that holds the GIL, so the state lives in one `GilCell` (a RefCell
//! whose `Sync` rests on the GIL: the extension is abi3, which free-threaded CPython cannot load). Python
//! is never called while the state is borrowed: a Python call can release the GIL and let another
//! thread's callback in.
//!
//! Model: each thread keeps a stack of activations of profiled code objects (recursion, generators).
//! The top activation's current line is a *segment*: it starts at a LINE event (or a resume) with the
//! memory values of that moment and ends at the next event of the same activation (next line, return,
//! yield, unwind), inclusive of everything its callees did. Segment deltas therefore telescope: the sum
//! over a function's lines is the change between its first line and its return.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use torchmem_core::sources::self_proc::SelfStatm;

/// A RefCell that is `Sync` because every access happens with the GIL held.
pub struct GilCell<T>(pub RefCell<T>);
// SAFETY: only touched from threads attached to the interpreter (GIL held); abi3 modules cannot be
// loaded by free-threaded builds, so the GIL serialises all access.
unsafe impl<T> Sync for GilCell<T> {}

pub static PROFILER: GilCell<Option<Profiler>> = GilCell(RefCell::new(None));

thread_local! {
    static THREAD_INDEX: Cell<u32> = const { Cell::new(u32::MAX) };
}

/// Hash for pointers: multiply, keep the high bits.
#[derive(Default)]
pub struct PtrHasher(u64);
impl Hasher for PtrHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ *b as u64).wrapping_mul(0x100000001b3);
        }
    }
    fn write_usize(&mut self, v: usize) {
        self.0 = (v as u64 >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
pub type PtrMap<V> = HashMap<usize, V, BuildHasherDefault<PtrHasher>>;

/// Accumulated numbers of one source line.
#[derive(Clone, Copy, Debug)]
pub struct LineStats {
    pub hits: u64,
    pub rss_after_bytes: i64,
    pub cpu_delta_bytes: i64,
    pub cpu_delta_max_bytes: i64,
    pub segments: u64,
    pub gpu_alloc_delta_bytes: i64,
    pub gpu_peak_bytes: i64,
    pub gpu_reserved_delta_bytes: i64,
}

impl Default for LineStats {
    fn default() -> Self {
        LineStats {
            hits: 0,
            rss_after_bytes: 0,
            cpu_delta_bytes: 0,
            cpu_delta_max_bytes: i64::MIN,
            segments: 0,
            gpu_alloc_delta_bytes: 0,
            gpu_peak_bytes: i64::MIN,
            gpu_reserved_delta_bytes: 0,
        }
    }
}

/// One profiled code object.
pub struct CodeEntry {
    pub code: Py<PyAny>,
    pub first_line: u32,
    /// (start offset, end offset, line) from `co_lines()`, for the line of a resumed generator.
    pub offsets: Vec<(u32, u32, u32)>,
    pub lines: Vec<LineStats>,
    pub calls: u64,
    pub threads: Vec<u32>,
}

impl CodeEntry {
    pub fn line_of_offset(&self, offset: u32) -> u32 {
        self.offsets.iter().find(|(s, e, _)| *s <= offset && offset < *e).map(|(_, _, l)| *l).unwrap_or(0)
    }
    fn stats(&mut self, line: u32) -> &mut LineStats {
        let i = line.saturating_sub(self.first_line) as usize;
        if i >= self.lines.len() {
            self.lines.resize(i + 1, LineStats::default());
        }
        &mut self.lines[i]
    }
}

/// Memory values at one moment.
#[derive(Clone, Copy, Default, Debug)]
pub struct Sample {
    pub rss_bytes: i64,
    pub gpu_alloc_bytes: i64,
    pub gpu_reserved_bytes: i64,
    /// The allocator's peak since our last reset (≥ gpu_alloc_bytes).
    pub gpu_peak_bytes: i64,
}

struct Activation {
    code: u32,
    frame: usize,
    line: u32,
    start: Sample,
    /// The highest allocator peak read while this segment was open (reads reset the allocator's peak,
    /// so nested events' reads must be folded in here).
    seg_peak_bytes: i64,
}

struct ThreadState {
    stack: Vec<Activation>,
    last_tick: u64,
    last: Sample,
    fresh: bool,
}

pub enum Gpu {
    /// Not probed yet (or CUDA not initialised yet): allocator counters are 0 until CUDA starts.
    Waiting {
        probe: Py<PyAny>,
    },
    Ready {
        device: i64,
        stats: Py<PyAny>,
        reset: Py<PyAny>,
    },
    Off,
}

pub struct Profiler {
    pub active: bool,
    pub hook: &'static str,
    pub codes: Vec<CodeEntry>,
    pub by_ptr: PtrMap<u32>,
    /// Code objects the matcher rejected, kept alive so their address is not reused by another.
    pub rejected: PtrMap<Py<PyAny>>,
    pub matcher: Option<Py<PyAny>>,
    pub disable: Option<Py<PyAny>>,
    threads: Vec<ThreadState>,
    pub gate_ticks: u64,
    pub ticks_per_s: f64,
    statm: SelfStatm,
    pub gpu: Gpu,
    pub gpu_seen: bool,
    /// The allocator's peak read by another torchmem reader just before it reset the counters (the peak
    /// ledger folds it in here), since the profiler's own last read: the next read's peak is at least this.
    pub gpu_folded_peak_bytes: i64,
    last_probe_tick: u64,
    pub warnings: Vec<String>,
    pub reads: u64,
    pub events: u64,
}

/// What an event is, as both hook paths see it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Ev {
    /// A fresh call of the code (PY_START, or settrace CALL at the first line).
    Start,
    /// A generator/coroutine resumed at `line` (PY_RESUME, PY_THROW, settrace CALL later in the body).
    Resume(u32),
    Line(u32),
    /// Return, yield or unwind: the activation ends.
    Exit,
}

/// What the caller should do with the code object after the event.
#[derive(PartialEq, Eq, Debug)]
pub enum Verdict {
    Profiled,
    NotProfiled,
}

impl Profiler {
    pub fn new(hook: &'static str, gate_ticks: u64, ticks_per_s: f64, gpu: Gpu) -> Profiler {
        Profiler {
            active: true,
            hook,
            codes: Vec::new(),
            by_ptr: PtrMap::default(),
            rejected: PtrMap::default(),
            matcher: None,
            disable: None,
            threads: Vec::new(),
            gate_ticks,
            ticks_per_s,
            statm: SelfStatm::open(),
            gpu,
            gpu_seen: false,
            gpu_folded_peak_bytes: 0,
            last_probe_tick: 0,
            warnings: Vec::new(),
            reads: 0,
            events: 0,
        }
    }

    pub fn add_code(&mut self, code: Py<PyAny>, first_line: u32, offsets: Vec<(u32, u32, u32)>) -> u32 {
        let ptr = code.as_ptr() as usize;
        if let Some(i) = self.by_ptr.get(&ptr) {
            return *i;
        }
        self.rejected.remove(&ptr);
        let i = self.codes.len() as u32;
        self.codes.push(CodeEntry { code, first_line, offsets, lines: Vec::new(), calls: 0, threads: Vec::new() });
        self.by_ptr.insert(ptr, i);
        i
    }

    pub fn clear_stats(&mut self) {
        for c in &mut self.codes {
            c.lines.clear();
            c.calls = 0;
            c.threads.clear();
        }
        for t in &mut self.threads {
            t.stack.clear();
            t.fresh = true;
        }
        self.reads = 0;
        self.events = 0;
    }

    fn thread_index(&mut self) -> usize {
        let mut i = THREAD_INDEX.with(|c| c.get()) as usize;
        if i >= self.threads.len() {
            i = self.threads.len();
            self.threads.push(ThreadState { stack: Vec::new(), last_tick: 0, last: Sample::default(), fresh: true });
            THREAD_INDEX.with(|c| c.set(i as u32));
        }
        i
    }

    /// Whether this thread's event needs fresh memory values (time since its previous event ≥ gate).
    pub fn needs_read(&mut self, now: u64) -> bool {
        let t = self.thread_index();
        let ts = &self.threads[t];
        ts.fresh || now.wrapping_sub(ts.last_tick) >= self.gate_ticks
    }

    /// Whether a GPU probe is due (CUDA not seen yet; at most every ~10 ms).
    pub fn probe_due(&mut self, now: u64) -> Option<Py<PyAny>> {
        if let Gpu::Waiting { probe } = &self.gpu {
            let every = (self.ticks_per_s / 100.0) as u64;
            if now.wrapping_sub(self.last_probe_tick) >= every || self.last_probe_tick == 0 {
                self.last_probe_tick = now;
                // SAFETY-free: clone under the GIL.
                return Some(probe.clone_ref(unsafe { Python::assume_attached() }));
            }
        }
        None
    }

    /// The calling thread's most recent values (the baseline a skipped event keeps).
    pub fn last_sample(&mut self) -> Sample {
        let t = self.thread_index();
        self.threads[t].last
    }

    pub fn rss_now(&mut self) -> i64 {
        self.reads += 1;
        match self.statm.rss_bytes() {
            Some(v) => v as i64,
            None => {
                let t = self.thread_index();
                self.threads[t].last.rss_bytes
            }
        }
    }

    /// Account one event of a profiled code object. `sample` is `Some` when memory was read.
    pub fn account(&mut self, code: u32, frame: usize, ev: Ev, sample: Option<Sample>, end_tick: u64) {
        self.events += 1;
        let t = self.thread_index();
        let now = match sample {
            Some(s) => s,
            None => self.threads[t].last,
        };
        {
            let ts = &mut self.threads[t];
            ts.last = now;
            ts.last_tick = end_tick;
            ts.fresh = false;
        }
        let codes = &mut self.codes;
        let ts = &mut self.threads[t];
        if sample.is_some() {
            for a in &mut ts.stack {
                a.seg_peak_bytes = a.seg_peak_bytes.max(now.gpu_peak_bytes);
            }
        }
        // The activation this event belongs to: the top one, matched by frame (settrace) or code.
        let matches = |a: &Activation| a.code == code && (frame == 0 || a.frame == frame);
        match ev {
            Ev::Start | Ev::Resume(_) => {
                let line = if let Ev::Resume(l) = ev { l } else { 0 };
                if ev == Ev::Start {
                    let c = &mut codes[code as usize];
                    c.calls += 1;
                    if !c.threads.contains(&(t as u32)) {
                        c.threads.push(t as u32);
                    }
                }
                ts.stack.push(Activation { code, frame, line, start: now, seg_peak_bytes: now.gpu_alloc_bytes });
            }
            Ev::Line(line) => {
                if !ts.stack.last().is_some_and(matches) {
                    // Profiling started inside this call, or a missed exit: repair the stack.
                    if let Some(pos) = ts.stack.iter().rposition(matches) {
                        for a in ts.stack.drain(pos + 1..).rev().collect::<Vec<_>>() {
                            close(codes, &a, &now);
                        }
                    } else {
                        ts.stack.push(Activation {
                            code,
                            frame,
                            line: 0,
                            start: now,
                            seg_peak_bytes: now.gpu_alloc_bytes,
                        });
                    }
                }
                let top = ts.stack.last_mut().expect("pushed above");
                close(codes, top, &now);
                codes[code as usize].stats(line).hits += 1;
                top.line = line;
                top.start = now;
                top.seg_peak_bytes = now.gpu_alloc_bytes;
            }
            Ev::Exit => {
                if let Some(pos) = ts.stack.iter().rposition(matches) {
                    let popped: Vec<Activation> = ts.stack.drain(pos..).collect();
                    for a in popped.iter().rev() {
                        close(codes, a, &now);
                    }
                }
            }
        }
    }

    pub fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let gpu_on = self.gpu_seen;
        let mut out = Vec::new();
        for c in &self.codes {
            let d = PyDict::new(py);
            d.set_item("code", c.code.bind(py))?;
            d.set_item("calls", c.calls)?;
            d.set_item("threads", c.threads.len())?;
            let mut rows = Vec::new();
            for (i, s) in c.lines.iter().enumerate() {
                if s.hits == 0 && s.segments == 0 {
                    continue;
                }
                let gpu = gpu_on;
                rows.push((
                    c.first_line as u64 + i as u64,
                    s.hits,
                    s.rss_after_bytes,
                    s.cpu_delta_bytes,
                    if s.segments > 0 { s.cpu_delta_max_bytes } else { 0 },
                    if gpu { Some(s.gpu_alloc_delta_bytes) } else { None },
                    if gpu { Some(if s.segments > 0 { s.gpu_peak_bytes.max(0) } else { 0 }) } else { None },
                    if gpu { Some(s.gpu_reserved_delta_bytes) } else { None },
                ));
            }
            d.set_item("lines", rows)?;
            out.push(d);
        }
        Ok(out)
    }
}

/// End the current segment of `a` at `now`.
fn close(codes: &mut [CodeEntry], a: &Activation, now: &Sample) {
    if a.line == 0 {
        return;
    }
    let s = codes[a.code as usize].stats(a.line);
    let d = now.rss_bytes - a.start.rss_bytes;
    s.segments += 1;
    s.cpu_delta_bytes += d;
    s.cpu_delta_max_bytes = s.cpu_delta_max_bytes.max(d);
    s.rss_after_bytes = now.rss_bytes;
    s.gpu_alloc_delta_bytes += now.gpu_alloc_bytes - a.start.gpu_alloc_bytes;
    s.gpu_reserved_delta_bytes += now.gpu_reserved_bytes - a.start.gpu_reserved_bytes;
    let top = a.seg_peak_bytes.max(now.gpu_peak_bytes).max(now.gpu_alloc_bytes);
    s.gpu_peak_bytes = s.gpu_peak_bytes.max(top - a.start.gpu_alloc_bytes);
}

/// Borrow the profiler mutably, or `None` when it is off or already borrowed (re-entry).
pub fn with<R>(f: impl FnOnce(&mut Profiler) -> R) -> Option<R> {
    let mut g = PROFILER.0.try_borrow_mut().ok()?;
    let p = g.as_mut()?;
    Some(f(p))
}
