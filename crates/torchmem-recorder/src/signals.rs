//! How `torchmem run` passes signals on to the program, so that running under torchmem is never worse than
//! running the program bare (the behaviour of a good supervisor such as tini or `uv run`).
//!
//! * A signal that was **ignored** when torchmem started (`nohup`, `cmd &` in a script, `trap '' HUP`, a CI
//!   harness) is ignored by the program too: it starts with SIG_IGN there, as it would bare (SIG_IGN is
//!   inherited across exec). torchmem still catches it and forwards it like any other signal, because a
//!   program may install its own handler (a trainer that checkpoints on SIGHUP under `nohup`): a `kill -HUP`
//!   of torchmem's pid must reach that handler as a `kill -HUP` of the program's pid would bare, and a program
//!   that kept SIG_IGN drops the forwarded copy as it would drop the original. The program also starts with
//!   torchmem's signal mask as torchmem got it, and with SIGPIPE and SIGXFSZ at their default, as Python's
//!   `subprocess` does (CPython and Rust's runtime ignore those two for themselves).
//! * Every catchable signal is caught and **forwarded exactly once**. The program stays in torchmem's
//!   process group, so a terminal's Ctrl-C/Ctrl-Z, `input()`, pdb and job control behave as without
//!   torchmem. But then a signal sent to the whole group (`kill -INT -- -PGID`, `timeout`, Slurm, a
//!   terminal) or to every process of a control group one by one (systemd's `KillMode=control-group`)
//!   already reaches the program directly, and forwarding it would deliver it twice. To tell the two apart,
//!   torchmem forks a tiny **sentinel** process before any thread starts: same process group, same cgroup,
//!   every signal blocked; it reports each signal it takes with `sigwaitinfo` over a pipe (signal number and
//!   CLOCK_MONOTONIC time). When torchmem gets a signal, it looks for the sentinel's report of the same
//!   signal within [`MATCH_WINDOW_NS`]: if there is one, the signal went to the group or the cgroup and the
//!   program has it already, so it is not forwarded; if none comes within [`FORWARD_AFTER_NS`], the signal
//!   was sent to torchmem alone and is forwarded. The sentinel dies with torchmem (PR_SET_PDEATHSIG SIGKILL)
//!   and is killed and reaped at the end of the run; it is torchmem's child, not the program's, so the
//!   recorder (which walks the tree below the program) never counts it. After fork it makes only
//!   async-signal-safe calls. Without a sentinel (fork failed) a terminal's signals (si_code SI_KERNEL) are
//!   recognised and the rest forwarded.
//! * Left alone: the synchronous fault signals (SEGV, BUS, FPE, ILL, TRAP, SYS), SIGCHLD, SIGTTIN/SIGTTOU
//!   (the terminal sends them to the whole group; catching SIGTTOU would make a background write loop), and
//!   SIGPIPE/SIGXFSZ/SIGXCPU (they are about torchmem's own writes and CPU time, not the program's).
//! * SIGTSTP: forwarded like the others unless the group got it, then torchmem stops itself with the default
//!   action (so a shell sees the job stop, and `fg`/SIGCONT resumes it; in an orphaned process group the
//!   kernel discards the stop for both, as it would for the program alone). SIGCONT is forwarded when it was
//!   sent to torchmem alone.
//!
//! The handler only writes a fixed-size record to a non-blocking self-pipe (async-signal-safe); the run
//! loop waits on that pipe and the sentinel's with `ppoll`, so a signal wakes it at once.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::time::Duration;

/// A sentinel report within this distance of torchmem's own receipt means both got the same send.
pub const MATCH_WINDOW_NS: u64 = 50_000_000;
/// How long torchmem waits for the sentinel's report before it concludes the signal was sent to it alone.
pub const FORWARD_AFTER_NS: u64 = 50_000_000;
/// Sentinel reports that matched nothing are dropped after this long.
const REPORT_KEEP_NS: u64 = 250_000_000;

/// What the handler and the sentinel write per signal: fixed size, far below PIPE_BUF (atomic writes).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct SigRecord {
    signo: i32,
    code: i32,
    sender_pid: i32,
    _pad: i32,
    t_ns: u64,
}

const RECORD_BYTES: usize = std::mem::size_of::<SigRecord>();

static SELF_PIPE_W: AtomicI32 = AtomicI32::new(-1);
static OUR_PID: AtomicI32 = AtomicI32::new(0);
/// Signals that hit our handler in the forked child before exec (bit `signo - 1`); `pre_exec` re-raises them.
static CHILD_EARLY: AtomicU64 = AtomicU64::new(0);

fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we own; it is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

extern "C" fn on_signal(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: only async-signal-safe calls (getpid, clock_gettime, write) and atomics; errno is restored.
    unsafe {
        let errno = *libc::__errno_location();
        if libc::getpid() != OUR_PID.load(Ordering::Relaxed) {
            // The forked child, between fork and exec: keep it for pre_exec to re-raise after the reset.
            if (1..=64).contains(&sig) {
                CHILD_EARLY.fetch_or(1u64 << (sig - 1), Ordering::SeqCst);
            }
        } else {
            let (code, sender_pid) = if info.is_null() { (0, 0) } else { ((*info).si_code, (*info).si_pid()) };
            let rec = SigRecord { signo: sig, code, sender_pid, _pad: 0, t_ns: now_ns() };
            let fd = SELF_PIPE_W.load(Ordering::Relaxed);
            if fd >= 0 {
                libc::write(fd, &rec as *const SigRecord as *const libc::c_void, RECORD_BYTES);
            }
        }
        *libc::__errno_location() = errno;
    }
}

/// The signals torchmem catches and forwards (see the module comment).
pub fn forwardable_signals() -> Vec<i32> {
    let left_alone = [
        libc::SIGKILL,
        libc::SIGSTOP,
        libc::SIGSEGV,
        libc::SIGBUS,
        libc::SIGFPE,
        libc::SIGILL,
        libc::SIGTRAP,
        libc::SIGSYS,
        libc::SIGCHLD,
        libc::SIGTTIN,
        libc::SIGTTOU,
        libc::SIGPIPE,
        libc::SIGXFSZ,
        libc::SIGXCPU,
    ];
    let mut v: Vec<i32> = (1..32).filter(|s| !left_alone.contains(s)).collect();
    v.extend(libc::SIGRTMIN()..=libc::SIGRTMAX());
    v
}

fn disposition(sig: i32) -> Option<libc::sigaction> {
    // SAFETY: querying (not changing) a disposition into a zeroed sigaction we own.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(sig, std::ptr::null(), &mut old) == 0).then_some(old)
    }
}

fn empty_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initialises the set we own.
    unsafe {
        let mut s: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut s);
        s
    }
}

fn full_set() -> libc::sigset_t {
    // SAFETY: sigfillset initialises the set we own.
    unsafe {
        let mut s: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut s);
        s
    }
}

fn read_records(fd: RawFd, out: &mut Vec<SigRecord>) -> bool {
    let mut buf = [0u8; RECORD_BYTES * 32];
    loop {
        // SAFETY: reading into a buffer we own from a non-blocking fd we own.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
        if n == 0 {
            return false; // the writer is gone
        }
        if n < 0 {
            let e = std::io::Error::last_os_error().raw_os_error();
            return e == Some(libc::EAGAIN) || e == Some(libc::EINTR);
        }
        for chunk in buf[..n as usize].chunks_exact(RECORD_BYTES) {
            // SAFETY: SigRecord is plain old data of exactly RECORD_BYTES bytes.
            out.push(unsafe { std::ptr::read_unaligned(chunk.as_ptr() as *const SigRecord) });
        }
    }
}

fn nonblocking_pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two fresh fds into the array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both fds are fresh and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The sentinel process: its pid and the read end of its report pipe.
struct Sentinel {
    pid: libc::pid_t,
    reports: OwnedFd,
}

impl Sentinel {
    /// Forks the sentinel. Call before any thread of ours starts; the child makes only async-signal-safe
    /// calls (prctl, getppid, close_range/close, sigwaitinfo, clock_gettime, write, _exit).
    fn spawn() -> Option<Sentinel> {
        let (read_end, write_end) = nonblocking_pipe().ok()?;
        let w = write_end.as_raw_fd();
        // SAFETY: blocking every signal around fork so the sentinel starts with all of them blocked; the
        // parent's mask is put back right after.
        unsafe {
            // The report pipe's write end must block in the sentinel (a full pipe only delays reports).
            libc::fcntl(w, libc::F_SETFL, 0);
            let full = full_set();
            let mut old = empty_set();
            libc::pthread_sigmask(libc::SIG_SETMASK, &full, &mut old);
            let parent = libc::getpid();
            let pid = libc::fork();
            if pid == 0 {
                sentinel_main(parent, w, &full);
            }
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
            drop(write_end);
            (pid > 0).then_some(Sentinel { pid, reports: read_end })
        }
    }
}

/// The sentinel's whole life, in the forked child. Never returns.
unsafe fn sentinel_main(parent: libc::pid_t, w: RawFd, all: &libc::sigset_t) -> ! {
    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
    if libc::getppid() != parent {
        libc::_exit(0);
    }
    libc::prctl(libc::PR_SET_NAME, c"torchmem-sentry".as_ptr());
    // Hold no file of torchmem's (stdout pipes, the profile, the terminal): only the report pipe.
    if libc::syscall(libc::SYS_close_range, 0u32, (w as u32).saturating_sub(1), 0u32) != 0
        || libc::syscall(libc::SYS_close_range, w as u32 + 1, u32::MAX, 0u32) != 0
    {
        for fd in 0..4096 {
            if fd != w {
                libc::close(fd);
            }
        }
    }
    libc::chdir(c"/".as_ptr());
    loop {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let sig = libc::sigwaitinfo(all, &mut info);
        if sig <= 0 {
            continue;
        }
        let rec = SigRecord { signo: sig, code: info.si_code, sender_pid: info.si_pid(), _pad: 0, t_ns: now_ns() };
        if libc::write(w, &rec as *const SigRecord as *const libc::c_void, RECORD_BYTES) < 0
            && *libc::__errno_location() == libc::EPIPE
        {
            libc::_exit(0);
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        // SAFETY: killing and reaping our own child.
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

/// A signal torchmem received and has not decided about yet.
#[derive(Debug, Clone, Copy)]
struct Received {
    signo: i32,
    code: i32,
    t_ns: u64,
    /// Arrived before the program existed: the program cannot have it, so it is always forwarded.
    before_child: bool,
}

/// One decision about a received signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    pub signo: i32,
    /// True: send it to the program. False: the program got it directly (group or cgroup-wide send).
    pub forward: bool,
}

/// Torchmem's signal handling for one run: installed by [`Supervisor::install`], undone on drop.
pub struct Supervisor {
    sentinel: Option<Sentinel>,
    self_pipe_r: OwnedFd,
    _self_pipe_w: OwnedFd,
    /// Signals with our handler, and what they had before (restored on drop).
    handled: Vec<(i32, libc::sigaction)>,
    /// Those of them that were ignored at start: the program starts with them ignored.
    ignored_at_start: Vec<i32>,
    /// The mask torchmem started with; the program gets it.
    startup_mask: libc::sigset_t,
    received: Vec<Received>,
    reports: Vec<SigRecord>,
    child_started: bool,
}

impl Supervisor {
    /// Looks at how torchmem started (ignored signals, mask), forks the sentinel, and installs the handler
    /// for every forwardable signal, remembering which were ignored. Call before any thread of ours starts.
    pub fn install() -> std::io::Result<Supervisor> {
        let mut startup_mask = empty_set();
        // SAFETY: reading our mask into a set we own.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), &mut startup_mask) };
        let sentinel = Sentinel::spawn();
        let (r, w) = nonblocking_pipe()?;
        // SAFETY: getpid is always safe.
        OUR_PID.store(unsafe { libc::getpid() }, Ordering::SeqCst);
        SELF_PIPE_W.store(w.as_raw_fd(), Ordering::SeqCst);
        let mut handled = Vec::new();
        let mut ignored_at_start = Vec::new();
        for sig in forwardable_signals() {
            let Some(old) = disposition(sig) else { continue };
            let ignored = old.sa_sigaction == libc::SIG_IGN;
            // SAFETY: installing our async-signal-safe handler with a zeroed sigaction we own.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_signal as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                if libc::sigaction(sig, &sa, std::ptr::null_mut()) == 0 {
                    handled.push((sig, old));
                    if ignored {
                        ignored_at_start.push(sig);
                    }
                }
            }
        }
        Ok(Supervisor {
            sentinel,
            self_pipe_r: r,
            _self_pipe_w: w,
            handled,
            ignored_at_start,
            startup_mask,
            received: Vec::new(),
            reports: Vec::new(),
            child_started: false,
        })
    }

    /// Whether a sentinel is running (group sends are then told apart exactly).
    pub fn has_sentinel(&self) -> bool {
        self.sentinel.is_some()
    }

    /// The sentinel's pid, if any.
    pub fn sentinel_pid(&self) -> Option<u32> {
        self.sentinel.as_ref().map(|s| s.pid as u32)
    }

    /// The signals that have our handler.
    pub fn handled_signals(&self) -> Vec<i32> {
        self.handled.iter().map(|(s, _)| *s).collect()
    }

    /// A `pre_exec` hook for the program: resets the caught signals to what torchmem started with (SIG_IGN
    /// stays ignored, every other to its default) and SIGPIPE/SIGXFSZ to their default,
    /// re-raises any signal that hit the child between fork and this point, sets PR_SET_PDEATHSIG, and
    /// restores the signal mask torchmem started with. Only async-signal-safe calls.
    pub fn child_setup(&self) -> impl FnMut() -> std::io::Result<()> + Send + Sync + 'static {
        let handled: Vec<i32> = self.handled_signals();
        let ignored = self.ignored_at_start.clone();
        let mask = SigSet(self.startup_mask);
        // SAFETY: getpid is always safe.
        let parent = unsafe { libc::getpid() };
        move || {
            // SAFETY: async-signal-safe calls only, in the forked child before exec.
            unsafe {
                let full = full_set();
                libc::sigprocmask(libc::SIG_SETMASK, &full, std::ptr::null_mut());
                for &sig in &handled {
                    let start = if ignored.contains(&sig) { libc::SIG_IGN } else { libc::SIG_DFL };
                    libc::signal(sig, start);
                }
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                libc::signal(libc::SIGXFSZ, libc::SIG_DFL);
                let early = CHILD_EARLY.swap(0, Ordering::SeqCst);
                for sig in 1..=64 {
                    if early & (1u64 << (sig - 1)) != 0 {
                        libc::kill(libc::getpid(), sig);
                    }
                }
                // If torchmem dies, the program gets SIGTERM instead of running on unobserved.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                if libc::getppid() != parent {
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                libc::sigprocmask(libc::SIG_SETMASK, &mask.0, std::ptr::null_mut());
            }
            Ok(())
        }
    }

    /// Call right before the program is forked: the signals received so far cannot have reached it, so they
    /// are forwarded once it runs; those received from now on may have reached it directly.
    pub fn about_to_spawn(&mut self) {
        self.drain();
        for r in &mut self.received {
            r.before_child = true;
        }
        self.child_started = true;
    }

    fn drain(&mut self) {
        let mut got = Vec::new();
        read_records(self.self_pipe_r.as_raw_fd(), &mut got);
        let before_child = !self.child_started;
        self.received.extend(got.into_iter().map(|r| Received {
            signo: r.signo,
            code: r.code,
            t_ns: r.t_ns,
            before_child,
        }));
        if let Some(s) = &self.sentinel {
            let alive = read_records(s.reports.as_raw_fd(), &mut self.reports);
            if !alive {
                self.sentinel = None; // killed (SIGKILL to the group?): fall back to forwarding
            }
        }
    }

    /// Waits up to `timeout` for a signal, a sentinel report, or `also` becoming readable (the program's
    /// pidfd: it ended), and returns early when one comes.
    pub fn wait(&self, timeout: Duration, also: Option<RawFd>) {
        let timeout = match self.next_deadline_ns() {
            Some(d) => timeout.min(Duration::from_nanos(d.saturating_sub(now_ns()))),
            None => timeout,
        };
        let mut fds = vec![libc::pollfd { fd: self.self_pipe_r.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        if let Some(s) = &self.sentinel {
            fds.push(libc::pollfd { fd: s.reports.as_raw_fd(), events: libc::POLLIN, revents: 0 });
        }
        if let Some(fd) = also {
            fds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
        }
        let ts = libc::timespec { tv_sec: timeout.as_secs() as _, tv_nsec: timeout.subsec_nanos() as _ };
        // SAFETY: ppoll on fds we own with a timespec we own; EINTR (a signal) just ends the wait early.
        unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as _, &ts, std::ptr::null()) };
    }

    fn next_deadline_ns(&self) -> Option<u64> {
        self.received.iter().filter(|r| !r.before_child).map(|r| r.t_ns + FORWARD_AFTER_NS).min()
    }

    /// Reads what arrived and returns the decisions that can be made now, oldest first; a signal whose
    /// sentinel report may still come stays for a later call.
    pub fn decide(&mut self) -> Vec<Decision> {
        self.drain();
        let now = now_ns();
        let has_sentinel = self.sentinel.is_some();
        let mut out = Vec::new();
        let mut keep = Vec::new();
        for r in std::mem::take(&mut self.received) {
            let matched = self
                .reports
                .iter()
                .position(|s| s.signo == r.signo && s.t_ns.abs_diff(r.t_ns) <= MATCH_WINDOW_NS)
                .map(|i| self.reports.remove(i))
                .is_some();
            if r.before_child {
                out.push(Decision { signo: r.signo, forward: true });
            } else if matched {
                out.push(Decision { signo: r.signo, forward: false });
            } else if !has_sentinel {
                // A terminal's keys reach the whole foreground group (the program too).
                let from_tty = r.code == libc::SI_KERNEL
                    && [libc::SIGINT, libc::SIGQUIT, libc::SIGTSTP, libc::SIGWINCH].contains(&r.signo);
                out.push(Decision { signo: r.signo, forward: !from_tty });
            } else if now >= r.t_ns + FORWARD_AFTER_NS {
                out.push(Decision { signo: r.signo, forward: true });
            } else {
                keep.push(r);
            }
        }
        self.received = keep;
        self.reports.retain(|s| now.saturating_sub(s.t_ns) < REPORT_KEEP_NS);
        out
    }

    /// SIGTSTP's own effect on torchmem, after it was passed on: stop with the default action (the kernel
    /// skips it in an orphaned process group, as for the program), and catch SIGTSTP again once continued.
    pub fn stop_self(&self) {
        // Ignored at start: the program ignores it too (unless it caught it: then it does not stop either).
        if !self.handled.iter().any(|(s, _)| *s == libc::SIGTSTP) || self.ignored_at_start.contains(&libc::SIGTSTP) {
            return;
        }
        // SAFETY: switching SIGTSTP to its default, raising it on ourselves, then putting our handler back.
        unsafe {
            let mut ours: libc::sigaction = std::mem::zeroed();
            libc::sigaction(libc::SIGTSTP, std::ptr::null(), &mut ours);
            libc::signal(libc::SIGTSTP, libc::SIG_DFL);
            libc::raise(libc::SIGTSTP);
            libc::sigaction(libc::SIGTSTP, &ours, std::ptr::null_mut());
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // Put every disposition back (the Python entry point returns to CPython's own handlers).
        for (sig, old) in &self.handled {
            // SAFETY: restoring a sigaction we read at install time.
            unsafe { libc::sigaction(*sig, old, std::ptr::null_mut()) };
        }
        SELF_PIPE_W.store(-1, Ordering::SeqCst);
        self.sentinel = None; // kills and reaps it
    }
}

/// A sigset_t that may move into the `pre_exec` closure.
#[derive(Clone, Copy)]
struct SigSet(libc::sigset_t);
// SAFETY: a sigset_t is plain data.
unsafe impl Send for SigSet {}
// SAFETY: a sigset_t is plain data.
unsafe impl Sync for SigSet {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_and_job_control_reads_are_left_alone() {
        let s = forwardable_signals();
        for left in [libc::SIGSEGV, libc::SIGCHLD, libc::SIGKILL, libc::SIGSTOP, libc::SIGTTOU, libc::SIGPIPE] {
            assert!(!s.contains(&left), "{left}");
        }
        for fwd in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGUSR1, libc::SIGWINCH, libc::SIGTSTP] {
            assert!(s.contains(&fwd), "{fwd}");
        }
        assert!(s.contains(&libc::SIGRTMIN()));
    }
}
