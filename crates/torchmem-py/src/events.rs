//! The event buffer between the Python API and `torchmem run`'s recorder. `emit_event` only appends the JSON
//! line to a buffer (no system call on the training loop's path); the allocator sampler thread writes the
//! buffer out every tick without the interpreter, and so does `flush_events` (at exit, or when no sampler
//! runs). A forked child drops what it inherited: those lines are its parent's.
//!
//! Where the lines go: under `torchmem run`, `TORCHMEM_EVENT_SOCKET` names the recorder's Unix socket and
//! each process connects by itself (a forked child makes its own connection, a process started by
//! multiprocessing's `spawn` finds the path in its environment although it inherited no descriptor), opening
//! with a `hello` line that says who it is (pid; rank, local rank and world size from `RANK`, `LOCAL_RANK`,
//! `WORLD_SIZE`, else Slurm's `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`); a new `hello` follows when
//! that changes (a worker that sets `RANK` after start). Otherwise `TORCHMEM_EVENT_FD` names an inherited
//! pipe (tests). Writes are whole lines, one writer at a time, cut into pieces ≤ PIPE_BUF so that lines of
//! several processes sharing a pipe never interleave either.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::errors::Error;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use torchmem_core::model::{Edge, Launch, MarkerKind, MarkerMemory, Origin};
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

/// This process's connection to the recorder's socket, and the identity its last `hello` announced.
struct Connection {
    pid: u32,
    stream: OwnedFd,
    announced: (Origin, Launch),
}

static CONNECTION: Mutex<Option<Connection>> = Mutex::new(None);
/// The identity as last read from the environment (read with the interpreter attached: Python's
/// `os.environ[...] = ` calls setenv under the GIL, so reading there never races it).
static IDENTITY: Mutex<Option<(Origin, Launch, Instant)>> = Mutex::new(None);
/// One write at a time: a line is never cut by another thread's write on the same stream.
static WRITING: Mutex<()> = Mutex::new(());
/// How often the queueing path re-reads the rank variables.
const IDENTITY_REFRESH: Duration = Duration::from_secs(1);

fn env_u32(names: [&str; 2]) -> Option<u32> {
    names.iter().find_map(|n| std::env::var(n).ok()?.trim().parse().ok())
}

/// Who this process is, from its pid and the distributed-launch variables.
pub fn read_identity() -> Origin {
    Origin {
        pid: Some(std::process::id()),
        rank: env_u32(["RANK", "SLURM_PROCID"]),
        local_rank: env_u32(["LOCAL_RANK", "SLURM_LOCALID"]),
        world_size: env_u32(["WORLD_SIZE", "SLURM_NTASKS"]),
    }
}

/// The identity to announce (with the node and attempt: `GROUP_RANK`, `TORCHELASTIC_RESTART_COUNT`, else
/// Slurm's); re-read from the environment at most once a second by callers holding the interpreter
/// (`fresh`), and whenever the pid changed (fork). The first read comes from a caller holding the
/// interpreter too (the queueing path, or starting the sampler).
fn identity(me: u32, fresh: bool) -> (Origin, Launch) {
    let mut guard = IDENTITY.lock().expect("identity");
    let stale = match guard.as_ref() {
        None => true,
        Some((o, _, at)) => o.pid != Some(me) || (fresh && at.elapsed() >= IDENTITY_REFRESH),
    };
    if stale {
        *guard = Some((read_identity(), Launch::from_vars(&|n| std::env::var(n).ok()), Instant::now()));
    }
    guard.as_ref().map(|(o, l, _)| (*o, *l)).unwrap_or_default()
}

fn socket_path() -> Option<&'static std::path::PathBuf> {
    static PATH: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    PATH.get_or_init(|| std::env::var_os("TORCHMEM_EVENT_SOCKET").filter(|p| !p.is_empty()).map(Into::into)).as_ref()
}

fn hello_line(&(origin, launch): &(Origin, Launch)) -> String {
    let mut line = serde_json::to_string(&ChildMessage::Hello { origin, launch }).unwrap_or_default();
    line.push('\n');
    line
}

/// This process's connection (made on first use, and again in a forked child), with a fresh `hello` when the
/// identity changed. None when the recorder cannot be reached.
fn connection_fd() -> Option<i32> {
    let path = socket_path()?;
    let me = std::process::id();
    let origin = identity(me, false);
    let mut guard = CONNECTION.lock().expect("event connection");
    if guard.as_ref().is_some_and(|c| c.pid != me) {
        // Inherited through fork: the parent's connection; close our copy and make our own.
        *guard = None;
    }
    if guard.is_none() {
        let stream = UnixStream::connect(path).ok()?;
        let fd = OwnedFd::from(stream);
        if !write_all(fd.as_raw_fd(), hello_line(&origin).as_bytes()) {
            return None;
        }
        *guard = Some(Connection { pid: me, stream: fd, announced: origin });
    }
    let conn = guard.as_mut()?;
    if conn.announced != origin {
        if !write_all(conn.stream.as_raw_fd(), hello_line(&origin).as_bytes()) {
            *guard = None;
            return None;
        }
        conn.announced = origin;
    }
    Some(conn.stream.as_raw_fd())
}

/// Where events go: this process's connection to the recorder's socket (`TORCHMEM_EVENT_SOCKET`), else the
/// inherited pipe of `TORCHMEM_EVENT_FD` when it is set and open.
pub fn event_fd() -> Option<i32> {
    if socket_path().is_some() {
        return connection_fd();
    }
    let fd: i32 = std::env::var("TORCHMEM_EVENT_FD").ok()?.trim().parse().ok()?;
    // SAFETY: F_GETFD only asks whether the descriptor is open.
    (unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1).then_some(fd)
}

/// Writes the whole buffer, one writer at a time; false when the recorder is gone (EPIPE, EBADF). On a
/// socket it never raises SIGPIPE.
pub fn write_all(fd: i32, mut data: &[u8]) -> bool {
    let _one_writer = WRITING.lock().expect("event writer");
    let mut is_socket = true;
    while !data.is_empty() {
        // SAFETY: writes from a live slice to a descriptor; a closed one returns an error, nothing else.
        let n = unsafe {
            if is_socket {
                libc::send(fd, data.as_ptr().cast(), data.len(), libc::MSG_NOSIGNAL)
            } else {
                libc::write(fd, data.as_ptr().cast(), data.len())
            }
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            if is_socket && err.raw_os_error() == Some(libc::ENOTSOCK) {
                is_socket = false;
                continue;
            }
            return false;
        }
        data = &data[n as usize..];
    }
    true
}

/// Writes `data` (whole lines) in pieces of at most PIPE_BUF bytes, each ending at a line boundary (on a
/// pipe shared by several processes, a write up to PIPE_BUF is atomic).
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
/// (A marker with a breakdown goes as a whole JSON line through `emit_event`: `_events.emit_marker_with`.)
#[pyfunction]
#[pyo3(signature = (t_ns, kind, edge, name, index, memory, device=None))]
#[allow(clippy::too_many_arguments)]
fn emit_marker(
    py: Python<'_>,
    t_ns: u64,
    kind: &str,
    edge: &str,
    name: &str,
    index: Option<i64>,
    memory: &Bound<'_, PyDict>,
    device: Option<u32>,
) -> PyResult<bool> {
    let kind = MarkerKind::parse(kind)
        .ok_or_else(|| Error::Input(format!("unknown marker kind {kind:?} (epoch, step, phase, mark)")))?;
    let edge =
        Edge::parse(edge).ok_or_else(|| Error::Input(format!("unknown marker edge {edge:?} (start, end, point)")))?;
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
            held_rss_bytes: opt_u64(memory, "held_rss_bytes"),
        },
        device,
        breakdown: None,
        activations_by_module: None,
    };
    let line = serde_json::to_string(&message).map_err(Error::from)?;
    Ok(queue_line(py, &line))
}

fn queue_line(py: Python<'_>, line: &str) -> bool {
    let me = std::process::id();
    // The interpreter is attached here: the one safe place to re-read the rank variables.
    identity(me, true);
    let sampler_runs = crate::sampler::sampler_running_in(me);
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
