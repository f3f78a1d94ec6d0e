//! The event buffer between the Python API and `torchmem run`'s recorder. `emit_event` only appends the JSON
//! line to a buffer (no system call on the training loop's path); the allocator sampler thread writes the
//! buffer to the pipe every tick without the interpreter, and so does `flush_events` (at exit, or when no
//! sampler runs). Writes are cut at line boundaries into pieces ≤ PIPE_BUF so lines from several processes
//! sharing the pipe never interleave. A forked child drops what it inherited: those lines are its parent's.

use std::sync::Mutex;

use pyo3::prelude::*;

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

fn take_for_this_process(buf: &mut Buffer) -> Vec<u8> {
    let me = std::process::id();
    if buf.pid != me {
        buf.pid = me;
        buf.bytes.clear();
    }
    std::mem::take(&mut buf.bytes)
}

/// Writes everything buffered so far; returns false when there is no recorder (or it went away).
pub fn flush() -> bool {
    let data = take_for_this_process(&mut BUFFER.lock().expect("event buffer"));
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
    let sampler_runs = crate::api::sampler_running();
    let full = {
        let mut buf = BUFFER.lock().expect("event buffer");
        let me = std::process::id();
        if buf.pid != me {
            buf.pid = me;
            buf.bytes.clear();
        }
        buf.bytes.extend_from_slice(line.as_bytes());
        buf.bytes.push(b'\n');
        buf.bytes.len() >= FLUSH_AT_BYTES
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
