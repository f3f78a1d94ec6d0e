//! The event buffer between the Python API and `torchmem run`'s recorder. `emit_event` only appends the JSON
//! line to a buffer (no system call on the training loop's path); the allocator sampler thread writes the
//! buffer to the pipe every tick without the interpreter, and so does `flush_events` (at exit, or when no
//! sampler runs). Writes are cut at line boundaries into pieces ≤ PIPE_BUF so lines from several processes
//! sharing the pipe never interleave. A forked child drops what it inherited: those lines are its parent's.

use std::sync::Mutex;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use torchmem_core::model::{Edge, MarkerKind, MarkerMemory};
use torchmem_core::wire::ChildMessage;

/// Flush synchronously when the buffer grows past this, whoever is calling.
const FLUSH_AT_BYTES: usize = 32 * 1024;
/// Linux's PIPE_BUF: writes up to this size to a pipe are atomic.
const PIPE_BUF: usize = 4096;

struct Buffer {
    pid: u32,
    bytes: Vec<u8>,
}

static BUFFER: Mutex<Buffer> = Mutex::new(Buffer { pid: 0, bytes: Vec::new() });

/// The recorder's pipe from `TORCHMEM_EVENT_FD`, when it is set and open.
pub fn event_fd() -> Option<i32> {
    let fd: i32 = std::env::var("TORCHMEM_EVENT_FD").ok()?.trim().parse().ok()?;
    // SAFETY: F_GETFD only asks whether the descriptor is open.
    (unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1).then_some(fd)
}

/// Writes the whole buffer; false when the recorder is gone (EPIPE, EBADF).
pub fn write_all(fd: i32, mut data: &[u8]) -> bool {
    while !data.is_empty() {
        // SAFETY: writes from a live slice to a descriptor; a closed one returns an error, nothing else.
        let n = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return false;
        }
        data = &data[n as usize..];
    }
    true
}

/// Writes `data` (whole lines) in pieces of at most PIPE_BUF bytes, each ending at a line boundary.
fn write_lines(fd: i32, data: &[u8]) -> bool {
    let mut rest = data;
    while !rest.is_empty() {
        let mut end = rest.len().min(PIPE_BUF);
        if end < rest.len() {
            // Back up to the last newline inside the piece; a single line longer than PIPE_BUF goes whole.
            end = match rest[..end].iter().rposition(|&b| b == b'\n') {
                Some(i) => i + 1,
                None => rest.iter().position(|&b| b == b'\n').map(|i| i + 1).unwrap_or(rest.len()),
            };
        }
        if !write_all(fd, &rest[..end]) {
            return false;
        }
        rest = &rest[end..];
    }
    true
}

/// The buffer's lines of process `me`: a forked child drops what it inherited (its parent's lines).
fn lines_of(buf: &mut Buffer, me: u32) -> &mut Vec<u8> {
    if buf.pid != me {
        buf.pid = me;
        buf.bytes.clear();
    }
    &mut buf.bytes
}

/// Writes everything buffered so far; returns false when there is no recorder (or it went away).
pub fn flush() -> bool {
    let data = std::mem::take(lines_of(&mut BUFFER.lock().expect("event buffer"), std::process::id()));
    if data.is_empty() {
        return true;
    }
    match event_fd() {
        Some(fd) => write_lines(fd, &data),
        None => false,
    }
}

/// Queues one JSON message (without its newline) for the recorder.
#[pyfunction]
fn emit_event(py: Python<'_>, line: &str) -> bool {
    queue_line(py, line)
}

fn opt_u64(memory: &Bound<'_, PyDict>, key: &str) -> Option<u64> {
    let v = memory.get_item(key).ok()??;
    v.extract::<i64>().ok().map(|v| v.max(0) as u64)
}

/// Queues one marker (the Python API's hot path: phases, steps, epochs), formatted here rather than by
/// `json.dumps`. `memory` holds the `MarkerMemory` fields that were read (`rss_bytes`, `allocated_bytes`, ...).
#[pyfunction]
#[pyo3(signature = (t_ns, kind, edge, name, index, memory))]
fn emit_marker(
    py: Python<'_>,
    t_ns: u64,
    kind: &str,
    edge: &str,
    name: &str,
    index: Option<i64>,
    memory: &Bound<'_, PyDict>,
) -> PyResult<bool> {
    let kind = MarkerKind::parse(kind)
        .ok_or_else(|| PyValueError::new_err(format!("unknown marker kind {kind:?} (epoch, step, phase, mark)")))?;
    let edge = Edge::parse(edge)
        .ok_or_else(|| PyValueError::new_err(format!("unknown marker edge {edge:?} (start, end, point)")))?;
    let message = ChildMessage::Marker {
        t_ns,
        kind,
        edge,
        name: name.to_string(),
        index,
        memory: MarkerMemory {
            rss_bytes: opt_u64(memory, "rss_bytes"),
            allocated_bytes: opt_u64(memory, "allocated_bytes"),
            reserved_bytes: opt_u64(memory, "reserved_bytes"),
            peak_allocated_bytes: opt_u64(memory, "peak_allocated_bytes"),
            peak_reserved_bytes: opt_u64(memory, "peak_reserved_bytes"),
            peak_rss_bytes: opt_u64(memory, "peak_rss_bytes"),
        },
    };
    let line = serde_json::to_string(&message).map_err(|e| PyValueError::new_err(e.to_string()))?;
    Ok(queue_line(py, &line))
}

fn queue_line(py: Python<'_>, line: &str) -> bool {
    let me = std::process::id();
    let sampler_runs = crate::api::sampler_running_in(me);
    let full = {
        let mut buf = BUFFER.lock().expect("event buffer");
        let bytes = lines_of(&mut buf, me);
        bytes.extend_from_slice(line.as_bytes());
        bytes.push(b'\n');
        bytes.len() >= FLUSH_AT_BYTES
    };
    if full || !sampler_runs {
        return py.detach(flush);
    }
    true
}

/// Writes the buffered messages now (the sampler does it every tick; this is for exit and tests).
#[pyfunction]
fn flush_events(py: Python<'_>) -> bool {
    py.detach(flush)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(emit_event, m)?)?;
    m.add_function(wrap_pyfunction!(emit_marker, m)?)?;
    m.add_function(wrap_pyfunction!(flush_events, m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_end_at_line_boundaries_and_stay_atomic() {
        let mut fds = [0; 2];
        // SAFETY: a fresh pipe we own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let line = format!("{}\n", "x".repeat(1000));
        let data = line.repeat(10);
        assert!(write_lines(fds[1], data.as_bytes()));
        let mut out = vec![0u8; 20000];
        // SAFETY: reading into our buffer.
        let n = unsafe { libc::read(fds[0], out.as_mut_ptr().cast(), out.len()) };
        assert_eq!(&out[..n as usize], data.as_bytes());
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
    }
}
