//! The line profiler's native hooks: a `PyEval_SetTrace` C callback (Python ≤ 3.11; the symbol is not in
//! the limited API, so it and `PyFrame_GetCode` are looked up with `dlsym` at run time) and raw
//! `METH_FASTCALL` builtins registered as `sys.monitoring` callbacks (Python ≥ 3.12), which CPython calls
//! by vectorcall without a Python frame. Both feed `drive`, which reads memory only when the time since
//! the thread's previous profiled event passes the gate, and never lets an error or a panic escape into
//! the profiled program.

use std::ffi::{c_int, c_void};
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;

use super::sampler::ticks;
use super::state::{self, Ev, Gpu, Profiler, Verdict};

/// How an event names its place, before the code object is known to be profiled.
#[derive(Clone, Copy)]
pub enum Raw {
    /// sys.monitoring PY_START.
    Start,
    /// settrace CALL: a fresh call when the frame's line is at or before `co_firstlineno`, else a resume.
    Call {
        frame_line: u32,
    },
    /// sys.monitoring PY_RESUME / PY_THROW at a bytecode offset.
    ResumeAt {
        offset: u32,
    },
    Line(u32),
    Exit,
}

/// Handle one event. Never raises, never panics outward.
pub fn drive(code_ptr: *mut ffi::PyObject, frame: usize, raw: Raw) -> Verdict {
    std::panic::catch_unwind(|| drive_inner(code_ptr, frame, raw)).unwrap_or_else(|_| {
        state::with(|p| {
            p.active = false;
            p.warnings.push("line profiler stopped after an internal error (panic)".into());
        });
        Verdict::NotProfiled
    })
}

enum First {
    Off,
    Unknown(Option<Py<PyAny>>),
    /// Accounted without reading memory (the common, cheap path: one borrow, one clock read).
    Done,
    Read(u32, Option<Py<PyAny>>),
}

/// The event kind, once the code object's entry is known.
fn event_of(p: &Profiler, idx: u32, raw: Raw) -> Ev {
    match raw {
        Raw::Start => Ev::Start,
        Raw::Call { frame_line } => {
            if frame_line <= p.codes[idx as usize].first_line {
                Ev::Start
            } else {
                Ev::Resume(frame_line)
            }
        }
        Raw::ResumeAt { offset } => Ev::Resume(p.codes[idx as usize].line_of_offset(offset)),
        Raw::Line(l) => Ev::Line(l),
        Raw::Exit => Ev::Exit,
    }
}

fn drive_inner(code_ptr: *mut ffi::PyObject, frame: usize, raw: Raw) -> Verdict {
    let key = code_ptr as usize;
    let now = ticks();
    // SAFETY: every hook runs on a thread attached to the interpreter.
    let py = unsafe { Python::assume_attached() };
    let first = state::with(|p| {
        if !p.active {
            return First::Off;
        }
        let Some(&idx) = p.by_ptr.get(&key) else {
            if p.rejected.contains_key(&key) {
                return First::Unknown(None);
            }
            return First::Unknown(p.matcher.as_ref().map(|m| m.clone_ref(py)));
        };
        if p.needs_read(now) {
            First::Read(idx, p.probe_due(now))
        } else {
            let ev = event_of(p, idx, raw);
            p.account(idx, frame, ev, None, now);
            First::Done
        }
    })
    .unwrap_or(First::Off);
    let (idx, probe) = match first {
        First::Off => return Verdict::NotProfiled,
        First::Done => return Verdict::Profiled,
        First::Read(idx, probe) => (idx, probe),
        First::Unknown(matcher) => {
            let first_sight = matches!(raw, Raw::Start | Raw::Call { .. });
            let Some(matcher) = matcher.filter(|_| first_sight) else {
                return Verdict::NotProfiled;
            };
            // SAFETY: code_ptr is a live code object for the duration of the event.
            let code = unsafe { Bound::from_borrowed_ptr(py, code_ptr) };
            let accepted = matcher.call1(py, (code.clone(),)).and_then(|r| r.is_truthy(py)).unwrap_or(false);
            let known = state::with(|p| {
                let k = p.by_ptr.get(&key).copied();
                if k.is_none() {
                    p.rejected.insert(key, code.clone().unbind());
                }
                k.map(|k| (k, p.probe_due(ticks())))
            })
            .flatten();
            match known {
                Some(k) if accepted => k,
                _ => return Verdict::NotProfiled,
            }
        }
    };

    if let Some(probe) = probe {
        match probe.call0(py) {
            Ok(r) if !r.is_none(py) => {
                let parsed: PyResult<(i64, Py<PyAny>, Py<PyAny>)> = r.extract(py);
                state::with(|p| match parsed {
                    Ok((device, stats, reset)) => p.gpu = Gpu::Ready { device, stats, reset },
                    Err(e) => {
                        p.gpu = Gpu::Off;
                        p.warnings.push(format!("GPU columns off: the CUDA probe answered badly ({e})"));
                    }
                });
            }
            Ok(_) => {}
            Err(e) => {
                state::with(|p| {
                    p.gpu = Gpu::Off;
                    p.warnings.push(format!("GPU columns off: the CUDA probe failed ({e})"));
                });
            }
        }
    }
    let gpu = state::with(|p| match &p.gpu {
        Gpu::Ready { device, stats, reset } => Some((*device, stats.clone_ref(py), reset.clone_ref(py))),
        _ => None,
    })
    .flatten();
    let mut s = state::with(|p| p.last_sample()).unwrap_or_default();
    if let Some((device, stats, reset)) = gpu {
        match read_gpu(py, device, &stats, &reset) {
            Ok((alloc, peak, reserved)) => {
                s.gpu_alloc_bytes = alloc;
                s.gpu_peak_bytes = peak;
                s.gpu_reserved_bytes = reserved;
                state::with(|p| p.gpu_seen = true);
            }
            Err(e) => {
                state::with(|p| {
                    p.gpu = Gpu::Off;
                    p.warnings.push(format!("GPU columns stopped: reading the allocator failed ({e})"));
                });
            }
        }
    }
    state::with(|p| {
        let ev = event_of(p, idx, raw);
        s.rss_bytes = p.rss_now();
        p.account(idx, frame, ev, Some(s), ticks());
    });
    Verdict::Profiled
}

/// `(allocated, peak since our last read, reserved)` of one device from the nested stats dict (~13 µs);
/// resets the allocator's peak (through the peak ledger, which folds it into torchmem's other readers and
/// the program's view) when it is above allocated, so the next segment's peak is its own.
fn read_gpu(py: Python<'_>, device: i64, stats: &Py<PyAny>, reset: &Py<PyAny>) -> PyResult<(i64, i64, i64)> {
    let d = stats.call1(py, (device,))?;
    let d = d.bind(py);
    let all = d.get_item("allocated_bytes")?.get_item("all")?;
    let alloc: i64 = all.get_item("current")?.extract()?;
    let peak: i64 = all.get_item("peak")?.extract()?;
    let reserved: i64 = d.get_item("reserved_bytes")?.get_item("all")?.get_item("current")?.extract()?;
    // What other readers' resets took from the counter since our last read (the peak ledger folded it in).
    let folded = state::with(|p| std::mem::take(&mut p.gpu_folded_peak_bytes)).unwrap_or(0);
    let peak = peak.max(folded);
    if peak > alloc {
        reset.call1(py, (device,))?;
    }
    Ok((alloc, peak, reserved))
}

// ---------------------------------------------------------------------------------------------------
// Python ≤ 3.11: PyEval_SetTrace with a C callback.

type SetTraceFn = unsafe extern "C" fn(Option<TraceFn>, *mut ffi::PyObject);
type TraceFn = unsafe extern "C" fn(*mut ffi::PyObject, *mut ffi::PyFrameObject, c_int, *mut ffi::PyObject) -> c_int;
type GetCodeFn = unsafe extern "C" fn(*mut ffi::PyFrameObject) -> *mut ffi::PyObject;

struct TraceSyms {
    set_trace: SetTraceFn,
    get_code: GetCodeFn,
}

/// The addresses of these interpreter symbols, or None when one is missing.
fn lookup<const N: usize>(names: [&std::ffi::CStr; N]) -> Option<[*mut c_void; N]> {
    // SAFETY: dlsym with RTLD_DEFAULT and NUL-terminated names only reads the symbol tables.
    let ptrs = names.map(|n| unsafe { libc::dlsym(libc::RTLD_DEFAULT, n.as_ptr()) });
    ptrs.iter().all(|p| !p.is_null()).then_some(ptrs)
}

fn trace_syms() -> Option<&'static TraceSyms> {
    static SYMS: OnceLock<Option<TraceSyms>> = OnceLock::new();
    SYMS.get_or_init(|| {
        let [st, gc] = lookup([c"PyEval_SetTrace", c"PyFrame_GetCode"])?;
        // SAFETY: the signatures are CPython's stable `PyEval_SetTrace(Py_tracefunc, PyObject*)` and
        // `PyFrame_GetCode(PyFrameObject*)`.
        unsafe {
            Some(TraceSyms {
                set_trace: std::mem::transmute::<*mut c_void, SetTraceFn>(st),
                get_code: std::mem::transmute::<*mut c_void, GetCodeFn>(gc),
            })
        }
    })
    .as_ref()
}

const PYTRACE_CALL: c_int = 0;
const PYTRACE_LINE: c_int = 2;
const PYTRACE_RETURN: c_int = 3;

unsafe extern "C" fn trace_cb(
    _obj: *mut ffi::PyObject,
    frame: *mut ffi::PyFrameObject,
    what: c_int,
    _arg: *mut ffi::PyObject,
) -> c_int {
    if !(what == PYTRACE_LINE || what == PYTRACE_CALL || what == PYTRACE_RETURN) {
        return 0;
    }
    let Some(syms) = trace_syms() else { return 0 };
    let code = (syms.get_code)(frame);
    if code.is_null() {
        ffi::PyErr_Clear();
        return 0;
    }
    let raw = match what {
        PYTRACE_LINE => Raw::Line(ffi::PyFrame_GetLineNumber(frame).max(0) as u32),
        PYTRACE_CALL => Raw::Call { frame_line: ffi::PyFrame_GetLineNumber(frame).max(0) as u32 },
        _ => Raw::Exit,
    };
    drive(code, frame as usize, raw);
    ffi::Py_DecRef(code);
    0
}

type SetTraceForFn = unsafe extern "C" fn(*mut c_void, Option<TraceFn>, *mut ffi::PyObject) -> c_int;
type InterpGetFn = unsafe extern "C" fn() -> *mut c_void;
type ThreadHeadFn = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
type ThreadNextFn = unsafe extern "C" fn(*mut c_void) -> *mut c_void;

/// CPython ≤ 3.11's exported `_PyEval_SetTrace(tstate, func, arg)` and the public thread-state iterator.
struct AllThreadsSyms {
    set_trace_for: SetTraceForFn,
    interp_get: InterpGetFn,
    thread_head: ThreadHeadFn,
    thread_next: ThreadNextFn,
}

fn all_threads_syms() -> Option<&'static AllThreadsSyms> {
    static SYMS: OnceLock<Option<AllThreadsSyms>> = OnceLock::new();
    SYMS.get_or_init(|| {
        let [set, interp, head, next] = lookup([
            c"_PyEval_SetTrace",
            c"PyInterpreterState_Get",
            c"PyInterpreterState_ThreadHead",
            c"PyThreadState_Next",
        ])?;
        // SAFETY: the signatures are CPython 3.9–3.11's `int _PyEval_SetTrace(PyThreadState*, Py_tracefunc,
        // PyObject*)`, `PyInterpreterState_Get(void)`, `PyInterpreterState_ThreadHead(PyInterpreterState*)` and
        // `PyThreadState_Next(PyThreadState*)`.
        unsafe {
            Some(AllThreadsSyms {
                set_trace_for: std::mem::transmute::<*mut c_void, SetTraceForFn>(set),
                interp_get: std::mem::transmute::<*mut c_void, InterpGetFn>(interp),
                thread_head: std::mem::transmute::<*mut c_void, ThreadHeadFn>(head),
                thread_next: std::mem::transmute::<*mut c_void, ThreadNextFn>(next),
            })
        }
    })
    .as_ref()
}

/// Install the C trace function on every thread of the interpreter, the ones already running included (what
/// 3.12's `PyEval_SetTraceAllThreads` does): a profiled function called later from a thread that started
/// before profiling is traced too. Must be called with the GIL held (no thread state can come or go then).
/// Returns how many threads got it, or None when the symbols are missing.
pub fn trace_install_all_threads() -> Option<usize> {
    let syms = all_threads_syms()?;
    let mut installed = 0;
    // SAFETY: the GIL is held, so the thread-state list is stable while we walk it; `_PyEval_SetTrace` is
    // documented to be called with the GIL held for any thread state of the current interpreter.
    unsafe {
        let interp = (syms.interp_get)();
        if interp.is_null() {
            return None;
        }
        let mut ts = (syms.thread_head)(interp);
        while !ts.is_null() {
            if (syms.set_trace_for)(ts, Some(trace_cb), std::ptr::null_mut()) == 0 {
                installed += 1;
            } else {
                ffi::PyErr_Clear();
            }
            ts = (syms.thread_next)(ts);
        }
    }
    Some(installed)
}

/// Install the C trace function on the calling thread. False when the symbols are missing.
pub fn trace_install(on: bool) -> bool {
    let Some(syms) = trace_syms() else { return false };
    // SAFETY: called with the GIL held; NULL obj is allowed.
    unsafe { (syms.set_trace)(if on { Some(trace_cb) } else { None }, std::ptr::null_mut()) };
    true
}

// ---------------------------------------------------------------------------------------------------
// Python ≥ 3.12: sys.monitoring callbacks as raw METH_FASTCALL builtins.

const METH_FASTCALL: c_int = 0x0080;
type FastFn =
    unsafe extern "C" fn(*mut ffi::PyObject, *const *mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject;

unsafe fn none() -> *mut ffi::PyObject {
    let n = ffi::Py_None();
    ffi::Py_IncRef(n);
    n
}

unsafe fn arg_u32(args: *const *mut ffi::PyObject, n: ffi::Py_ssize_t, i: isize) -> Option<u32> {
    if (i as ffi::Py_ssize_t) >= n {
        return None;
    }
    let v = ffi::PyLong_AsLong(*args.offset(i));
    if v == -1 && !ffi::PyErr_Occurred().is_null() {
        ffi::PyErr_Clear();
        return None;
    }
    Some(v.max(0) as u32)
}

unsafe extern "C" fn mon_line(
    _s: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    n: ffi::Py_ssize_t,
) -> *mut ffi::PyObject {
    if let Some(line) = arg_u32(args, n, 1) {
        drive(*args, 0, Raw::Line(line));
    }
    none()
}

unsafe extern "C" fn mon_start(
    _s: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    n: ffi::Py_ssize_t,
) -> *mut ffi::PyObject {
    if n < 1 {
        return none();
    }
    if drive(*args, 0, Raw::Start) == Verdict::NotProfiled {
        // Only reached for code that is not ours (global PY_START while --line specs are pending):
        // switch PY_START off for that code so it costs nothing from now on.
        let disable = state::with(|p| p.disable.as_ref().map(|d| d.as_ptr())).flatten();
        if let Some(d) = disable {
            ffi::Py_IncRef(d);
            return d;
        }
    }
    none()
}

unsafe extern "C" fn mon_resume(
    _s: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    n: ffi::Py_ssize_t,
) -> *mut ffi::PyObject {
    if let Some(offset) = arg_u32(args, n, 1) {
        drive(*args, 0, Raw::ResumeAt { offset });
    }
    none()
}

unsafe extern "C" fn mon_exit(
    _s: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    n: ffi::Py_ssize_t,
) -> *mut ffi::PyObject {
    if n >= 1 {
        drive(*args, 0, Raw::Exit);
    }
    none()
}

/// A builtin function object calling `f` by vectorcall. The method table is leaked (lives forever).
pub fn fastcall_builtin(py: Python<'_>, name: &'static std::ffi::CStr, f: FastFn) -> PyResult<Py<PyAny>> {
    let def = Box::leak(Box::new(ffi::PyMethodDef {
        ml_name: name.as_ptr(),
        // SAFETY: METH_FASTCALL tells CPython to call through the fast signature.
        ml_meth: ffi::PyMethodDefPointer {
            PyCFunction: unsafe {
                std::mem::transmute::<
                    FastFn,
                    unsafe extern "C" fn(*mut ffi::PyObject, *mut ffi::PyObject) -> *mut ffi::PyObject,
                >(f)
            },
        },
        ml_flags: METH_FASTCALL,
        ml_doc: std::ptr::null(),
    }));
    // SAFETY: def is 'static; NULL self and module are allowed.
    unsafe {
        let obj = ffi::PyCFunction_NewEx(def, std::ptr::null_mut(), std::ptr::null_mut());
        Ok(Bound::from_owned_ptr_or_err(py, obj)?.unbind())
    }
}

pub fn monitoring_callbacks(py: Python<'_>) -> PyResult<Vec<(&'static str, Py<PyAny>)>> {
    Ok(vec![
        ("line", fastcall_builtin(py, c"torchmem_line", mon_line)?),
        ("start", fastcall_builtin(py, c"torchmem_start", mon_start)?),
        ("resume", fastcall_builtin(py, c"torchmem_resume", mon_resume)?),
        ("exit", fastcall_builtin(py, c"torchmem_exit", mon_exit)?),
    ])
}
