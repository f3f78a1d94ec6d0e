//! This process's own memory from /proc, read fast: the one reader behind the in-process API
//! (`torchmem.stats()`, peak windows, the Monitor's markers) and the line profiler's per-event RSS.
//!
//! torchmem never resets the kernel's peak RSS (`VmHWM`, `ru_maxrss`: the program reads them as without
//! torchmem). A peak window's RSS peak comes from torchmem's own counter ([`rss_period_peak`]): the
//! kernel's high-water mark when it rose during the period (exact), else the highest RSS read at the
//! window's edges and by a watcher thread that samples `/proc/self/statm` while a window is open
//! ([`watch_rss`]): every 5 ms, every millisecond while RSS rises. Such a sampled peak is a lower bound: a
//! spike that was filled and freed between two samples is seen lower by what it grew since the last one.
//!
//! Files are opened once and re-read with `pread` (about half the cost of open+read+close). A forked child
//! inherits the parent's descriptors, which still name the parent's /proc entries: a `pthread_atfork` child
//! handler bumps a generation counter, and every [`SelfProcFile`] reopens when the generation it opened at
//! is no longer the current one (one relaxed atomic load per read, no `getpid` syscall). Other processes'
//! files (the recorder's process tree) are read by `procfs` with the same parsers.

use std::fs;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

use super::procfs::{page_size, parse_statm_rss_pages, parse_status_rss_and_peak};

/// Bumped in every forked child (before it runs any of our code), so that kept-open files reopen there.
static FORK_GENERATION: AtomicU64 = AtomicU64::new(0);

extern "C" fn after_fork_child() {
    FORK_GENERATION.fetch_add(1, Ordering::Relaxed);
}

fn watch_forks() {
    static ATFORK: std::sync::Once = std::sync::Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registers a plain extern "C" fn that only bumps an atomic (async-signal-safe).
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
    });
}

/// One `/proc/self/…` file kept open across reads; reopened in a forked child. A file that cannot be opened
/// (no /proc, a sandbox) is not retried until the next fork, so a hot path pays one failed open, not one
/// per read.
#[derive(Debug)]
pub struct SelfProcFile {
    path: &'static str,
    file: Option<fs::File>,
    generation: u64,
}

impl SelfProcFile {
    /// A file of this process to read, e.g. "/proc/self/statm".
    pub fn open_read(path: &'static str) -> SelfProcFile {
        watch_forks();
        let generation = FORK_GENERATION.load(Ordering::Relaxed);
        SelfProcFile { path, file: fs::File::open(path).ok(), generation }
    }

    fn file(&mut self) -> Option<&fs::File> {
        if self.generation != FORK_GENERATION.load(Ordering::Relaxed) {
            *self = Self::open_read(self.path);
        }
        self.file.as_ref()
    }

    /// The file's text from offset 0 into `buf` (its start, when longer); None when empty or unreadable.
    pub fn read<'b>(&mut self, buf: &'b mut [u8]) -> Option<&'b [u8]> {
        let n = self.file()?.read_at(buf, 0).ok()?;
        (n > 0).then(|| &buf[..n])
    }
}

/// `/proc/self/statm` kept open: this process's RSS in about a microsecond.
#[derive(Debug)]
pub struct SelfStatm {
    file: SelfProcFile,
    page_bytes: u64,
}

impl SelfStatm {
    pub fn open() -> SelfStatm {
        SelfStatm { file: SelfProcFile::open_read("/proc/self/statm"), page_bytes: page_size() }
    }

    /// Resident set size in bytes, or None when /proc is not readable.
    pub fn rss_bytes(&mut self) -> Option<u64> {
        let mut buf = [0u8; 128];
        let text = self.file.read(&mut buf)?;
        parse_statm_rss_pages(text).map(|pages| pages * self.page_bytes)
    }
}

/// RSS and its high-water mark, both from one read of `/proc/self/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelfMemory {
    pub rss_bytes: u64,
    /// `VmHWM`: the highest RSS since the process started (the kernel's; torchmem never resets it). From
    /// [`rss_period_peak`]: the highest since torchmem's period started.
    pub peak_rss_bytes: u64,
}

/// The in-process API's files, shared by its threads (the Python API, the allocator sampler).
struct SelfFiles {
    statm: SelfStatm,
    status: SelfProcFile,
}

static SELF_FILES: Mutex<Option<SelfFiles>> = Mutex::new(None);

fn with_self_files<T>(f: impl FnOnce(&mut SelfFiles) -> Option<T>) -> Option<T> {
    let mut guard = SELF_FILES.lock().unwrap_or_else(|p| p.into_inner());
    let files = guard.get_or_insert_with(|| SelfFiles {
        statm: SelfStatm::open(),
        status: SelfProcFile::open_read("/proc/self/status"),
    });
    f(files)
}

/// This process's RSS and peak RSS.
///
/// Fast path (~1.5 µs instead of ~5–12 µs for `/proc/self/status`): RSS from statm and the high-water mark
/// from `getrusage`, whose `ru_maxrss` is `max(high-water mark, maxrss inherited across exec)`. The first
/// call learns an upper bound of the inherited part (see [`exec_maxrss_bound`]); a `ru_maxrss` above that
/// bound can only be the high-water mark itself. Otherwise (or without /proc) it reads status.
pub fn self_memory() -> Option<SelfMemory> {
    let bound = exec_maxrss_bound();
    if let (Some(max_rss), Some(rss)) = (rusage_maxrss_bytes(), self_rss_bytes()) {
        if max_rss > bound {
            return Some(SelfMemory { rss_bytes: rss, peak_rss_bytes: max_rss.max(rss) });
        }
    }
    self_memory_from_status()
}

/// RSS and VmHWM from one read of `/proc/self/status` (the reference the fast path is checked against).
pub fn self_memory_from_status() -> Option<SelfMemory> {
    let mut buf = [0u8; 4096];
    let (rss_bytes, peak) = with_self_files(|f| {
        let text = f.status.read(&mut buf)?;
        parse_status_rss_and_peak(std::str::from_utf8(text).ok()?)
    })?;
    Some(SelfMemory { rss_bytes, peak_rss_bytes: peak? })
}

/// This process's RSS from `/proc/self/statm` (the cheapest read the kernel offers).
pub fn self_rss_bytes() -> Option<u64> {
    with_self_files(|f| f.statm.rss_bytes())
}

/// `getrusage(RUSAGE_SELF).ru_maxrss` in bytes.
fn rusage_maxrss_bytes() -> Option<u64> {
    // SAFETY: getrusage fills the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    (unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0).then(|| ru.ru_maxrss.max(0) as u64 * 1024)
}

/// An upper bound (bytes) of the maxrss the kernel carried over from the image before `exec`, which
/// `ru_maxrss` folds in: with `ru` and VmHWM read together, `ru > VmHWM` means the inherited value is `ru`;
/// `ru == VmHWM` means it is at most VmHWM. A fork child inherits nothing (0), so the bound stays valid.
/// `u64::MAX` (fast path off) where status or getrusage cannot be read.
pub fn exec_maxrss_bound() -> u64 {
    static BOUND: OnceLock<u64> = OnceLock::new();
    *BOUND.get_or_init(|| match (self_memory_from_status(), rusage_maxrss_bytes()) {
        (Some(m), Some(ru)) => ru.max(m.peak_rss_bytes),
        _ => u64::MAX,
    })
}

// --- torchmem's own peak RSS --------------------------------------------------------------------------

/// One period of torchmem's peak-RSS counter (the peak ledger's "since the last reset", kept here instead of
/// in the kernel).
#[derive(Debug, Clone, Copy)]
struct RssPeriod {
    /// The process the period belongs to (a forked child starts its own, from its start).
    pid: u32,
    /// The kernel's high-water mark when the period started: once it is higher, it rose inside the period,
    /// and is then the period's exact peak.
    hwm_at_start_bytes: u64,
    /// The highest RSS read since the period started (edges and the watcher's samples).
    max_seen_bytes: u64,
}

static RSS_PERIOD: Mutex<RssPeriod> = Mutex::new(RssPeriod { pid: 0, hwm_at_start_bytes: 0, max_seen_bytes: 0 });

fn rss_period() -> std::sync::MutexGuard<'static, RssPeriod> {
    let mut g = RSS_PERIOD.lock().unwrap_or_else(|p| p.into_inner());
    let pid = std::process::id();
    if g.pid != pid {
        // First use, or a forked child: the period is the process's life so far.
        *g = RssPeriod { pid, hwm_at_start_bytes: 0, max_seen_bytes: 0 };
    }
    g
}

fn period_peak(p: &RssPeriod, m: &SelfMemory) -> u64 {
    let seen = p.max_seen_bytes.max(m.rss_bytes);
    if m.peak_rss_bytes > p.hwm_at_start_bytes {
        seen.max(m.peak_rss_bytes)
    } else {
        seen
    }
}

/// RSS now and the highest RSS since torchmem's peak period started ([`rss_period_restart`]; the process's
/// start before the first). Exact when the period reached a new lifetime high (the kernel's high-water mark
/// rose); otherwise the highest RSS read at the period's edges and sampled by [`watch_rss`]'s thread.
pub fn rss_period_peak() -> Option<SelfMemory> {
    let mut p = rss_period();
    let m = self_memory()?;
    p.max_seen_bytes = p.max_seen_bytes.max(m.rss_bytes);
    Some(SelfMemory { rss_bytes: m.rss_bytes, peak_rss_bytes: period_peak(&p, &m) })
}

/// Ends torchmem's peak period and starts the next at the current RSS: returns [`rss_period_peak`] read just
/// before. Nothing the program reads changes (the kernel's counters are only read).
pub fn rss_period_restart() -> Option<SelfMemory> {
    let mut p = rss_period();
    let m = self_memory()?;
    let peak = period_peak(&p, &m);
    p.hwm_at_start_bytes = m.peak_rss_bytes;
    p.max_seen_bytes = m.rss_bytes;
    Some(SelfMemory { rss_bytes: m.rss_bytes, peak_rss_bytes: peak })
}

/// How often the watcher samples RSS while a window is open and RSS is not rising.
pub const RSS_WATCH_INTERVAL: Duration = Duration::from_millis(5);
/// How often it samples while RSS rose since its last sample (a spike being paged in): a spike freed right
/// after it was filled is then seen to within what it grew in its last millisecond.
pub const RSS_WATCH_RISING_INTERVAL: Duration = Duration::from_millis(1);
/// Growth between two samples that counts as rising (malloc's churn of a few pages does not).
const RISING_BY_BYTES: u64 = 1 << 20;

/// torchmem's open peak windows (the watcher samples only while there is one).
static OPEN_WINDOWS: AtomicUsize = AtomicUsize::new(0);
/// The process the watcher thread runs in (a forked child has none: it starts its own).
static WATCHER_PID: Mutex<Option<u32>> = Mutex::new(None);
/// Wakes the watcher when a window opens; it waits here while none is open.
static WATCHER_WAKE: (Mutex<()>, Condvar) = (Mutex::new(()), Condvar::new());

/// Tells the RSS watcher how many peak windows are open: with one or more, a thread samples
/// `/proc/self/statm` every [`RSS_WATCH_INTERVAL`] (every [`RSS_WATCH_RISING_INTERVAL`] while RSS rises) into the current period's highest RSS (about a microsecond
/// a read, no GIL); with none it waits. False where the thread cannot be started (windows then see their
/// edges and the kernel's high-water mark only).
///
/// The thread is a bare pthread (a small stack, no Rust thread handle) whose loop never calls malloc: a
/// thread that mallocs gets an arena of its own from glibc, 64 MiB of address space, which a program under
/// `RLIMIT_AS` (e.g. a batch-size search under a cap) would see vanish from its budget.
pub fn watch_rss(open_windows: usize) -> bool {
    OPEN_WINDOWS.store(open_windows, Ordering::Relaxed);
    let mut w = WATCHER_PID.lock().unwrap_or_else(|p| p.into_inner());
    let pid = std::process::id();
    if *w != Some(pid) {
        if open_windows == 0 {
            return true;
        }
        if !spawn_watcher() {
            return false;
        }
        *w = Some(pid);
    } else if open_windows > 0 {
        let _g = WATCHER_WAKE.0.lock().unwrap_or_else(|p| p.into_inner());
        WATCHER_WAKE.1.notify_one();
    }
    true
}

/// Starts [`rss_watch_loop`] on a detached pthread with a stack of 128 KiB plus what glibc needs for static
/// TLS (`__pthread_get_minstack`, as Rust's own threads add). True when it started.
fn spawn_watcher() -> bool {
    extern "C" fn start(_: *mut libc::c_void) -> *mut libc::c_void {
        rss_watch_loop()
    }
    type MinStack = unsafe extern "C" fn(*const libc::pthread_attr_t) -> libc::size_t;
    // SAFETY: plain pthread calls on an attribute object we own; `start` takes no argument and never
    // unwinds (the loop has no panicking call: poisoned locks are taken as they are).
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_attr_init(&mut attr) != 0 {
            return false;
        }
        let sym = libc::dlsym(libc::RTLD_DEFAULT, c"__pthread_get_minstack".as_ptr());
        let min_stack = if sym.is_null() {
            libc::PTHREAD_STACK_MIN
        } else {
            std::mem::transmute::<*mut libc::c_void, MinStack>(sym)(&attr)
        };
        libc::pthread_attr_setstacksize(&mut attr, min_stack + (128 << 10));
        libc::pthread_attr_setdetachstate(&mut attr, libc::PTHREAD_CREATE_DETACHED);
        let mut tid: libc::pthread_t = std::mem::zeroed();
        let rc = libc::pthread_create(&mut tid, &attr, start, std::ptr::null_mut());
        libc::pthread_attr_destroy(&mut attr);
        if rc == 0 {
            libc::pthread_setname_np(tid, c"torchmem-rss".as_ptr());
        }
        rc == 0
    }
}

/// The watcher's loop: no allocation anywhere in it (statm is read into a stack buffer through a descriptor
/// opened with a stack path).
fn rss_watch_loop() -> ! {
    let mut statm = SelfStatm::open();
    let mut last_rss = 0u64;
    let mut rising = false;
    loop {
        if OPEN_WINDOWS.load(Ordering::Relaxed) == 0 {
            let g = WATCHER_WAKE.0.lock().unwrap_or_else(|p| p.into_inner());
            if OPEN_WINDOWS.load(Ordering::Relaxed) == 0 {
                drop(WATCHER_WAKE.1.wait(g).unwrap_or_else(|p| p.into_inner()));
            }
            continue;
        }
        std::thread::sleep(if rising { RSS_WATCH_RISING_INTERVAL } else { RSS_WATCH_INTERVAL });
        // Read under the period's lock: a sample taken before a restart cannot land in the next period.
        let mut p = rss_period();
        if let Some(rss) = statm.rss_bytes() {
            p.max_seen_bytes = p.max_seen_bytes.max(rss);
            rising = rss > last_rss + RISING_BY_BYTES;
            last_rss = rss;
        }
    }
}

/// Returns freed heap memory at the top and in the middle of glibc's arenas to the kernel (the CPU side of
/// "empty the cache"). True when some memory was released.
pub fn malloc_trim() -> bool {
    MALLOC_TRIMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: malloc_trim has no preconditions; it only walks glibc's own arenas under their locks.
    unsafe { libc::malloc_trim(0) != 0 }
}

static MALLOC_TRIMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times this process called [`malloc_trim`]. A trim gives back free pages inside the heap while
/// malloc still counts them free (`malloc_free_bytes` does not fall with RSS), so RSS less free bytes drops
/// at a trim by memory nothing held: the leak detector does not count that step's fall.
pub fn malloc_trims() -> u64 {
    MALLOC_TRIMS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Bytes glibc's malloc holds freed, for reuse (`mallinfo2().fordblks`, all arenas): resident memory that
/// nothing holds, which RSS counts. A healthy loop's RSS creeps by what `free` keeps (measured:
/// `tests/leak_cases.py`'s healthy cache, RssAnon +69 MiB over 60 steps and fordblks +69 MiB with it, RssAnon
/// minus fordblks flat to 1 MiB); the leak detector judges RSS less this. Looked up at run time (glibc >=
/// 2.33), so the extension loads on older C libraries too; None where there is no `mallinfo2`.
#[cfg(target_env = "gnu")]
pub fn malloc_free_bytes() -> Option<u64> {
    type MallInfo2 = unsafe extern "C" fn() -> libc::mallinfo2;
    static SYMBOL: OnceLock<Option<MallInfo2>> = OnceLock::new();
    let f = SYMBOL.get_or_init(|| {
        // SAFETY: dlsym with a NUL-terminated name; a non-null result is glibc's mallinfo2, whose C signature
        // is `struct mallinfo2 mallinfo2(void)`, as `MallInfo2` says.
        let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"mallinfo2".as_ptr()) };
        (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut libc::c_void, MallInfo2>(p) })
    });
    // SAFETY: mallinfo2 has no preconditions; it walks glibc's arenas under their locks.
    f.map(|f| unsafe { f() }.fordblks as u64)
}

/// Not glibc: no `mallinfo2`.
#[cfg(not(target_env = "gnu"))]
pub fn malloc_free_bytes() -> Option<u64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    /// The peak-RSS tests reset this process's high-water mark: one at a time.
    static PEAK_TESTS: Mutex<()> = Mutex::new(());

    #[test]
    #[cfg(target_env = "gnu")]
    fn malloc_free_bytes_grow_by_what_free_keeps() {
        let _one = PEAK_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        // 64 blocks of 64 KiB (below the mmap threshold: from the heap), each followed by a small one that stays,
        // so that freed blocks can neither merge into the top of the heap nor be given back: their 4 MiB stays
        // free in the arena.
        let (blocks, pins): (Vec<Vec<u8>>, Vec<Vec<u8>>) =
            (0..64).map(|i| (vec![i as u8; 64 << 10], vec![i as u8; 2048])).unzip();
        let before = malloc_free_bytes().expect("glibc >= 2.33 has mallinfo2 (this test machine's C library)");
        assert_eq!(blocks.iter().map(|b| b[0] as u64).sum::<u64>(), (0..64).sum::<u64>());
        drop(blocks);
        let after = malloc_free_bytes().unwrap();
        // Other test threads allocate and free too: the 4 MiB must show, give or take 2 MiB.
        assert!(after + 2 * MIB > before + 4 * MIB, "{before} -> {after}");
        assert_eq!(pins.len(), 64);
    }

    #[test]
    fn reads_this_process_and_keeps_a_period_peak_without_resetting_the_kernels() {
        let _one = PEAK_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let m = self_memory().unwrap();
        assert!(m.rss_bytes > MIB && m.peak_rss_bytes >= m.rss_bytes);
        let statm = self_rss_bytes().unwrap();
        assert!(statm > MIB);
        // Touch 64 MiB, free it, restart the period: the period's peak falls back to about the current RSS,
        // the kernel's does not.
        let big = vec![1u8; 64 * MIB as usize];
        assert!(big.iter().map(|b| *b as u64).sum::<u64>() == 64 * MIB);
        let with_big = self_memory_from_status().unwrap();
        drop(big);
        rss_period_restart().unwrap();
        let period = rss_period_peak().unwrap();
        let kernel = self_memory_from_status().unwrap();
        assert!(period.peak_rss_bytes + 32 * MIB < with_big.peak_rss_bytes, "{period:?} vs {with_big:?}");
        // The kernel's counters are per-CPU and read approximately: equal within a few pages.
        assert!(kernel.peak_rss_bytes + MIB >= with_big.peak_rss_bytes, "{kernel:?} vs {with_big:?}");
        // A new lifetime high inside the period is its exact peak (the kernel's mark rose).
        let bigger = vec![2u8; (kernel.peak_rss_bytes.saturating_sub(kernel.rss_bytes) + 32 * MIB) as usize];
        assert!(bigger.iter().step_by(4096).all(|b| *b == 2));
        drop(bigger);
        let after = rss_period_restart().unwrap();
        let kernel_after = self_memory_from_status().unwrap();
        assert_eq!(after.peak_rss_bytes.max(kernel_after.peak_rss_bytes), kernel_after.peak_rss_bytes);
        assert!(after.peak_rss_bytes + 4 * MIB >= kernel_after.peak_rss_bytes, "{after:?} vs {kernel_after:?}");
    }

    #[test]
    fn the_watcher_samples_a_spike_below_the_lifetime_peak() {
        let _one = PEAK_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        // Raise the lifetime peak first, so that the spike below cannot show in the kernel's mark.
        let big = vec![1u8; 160 * MIB as usize];
        assert!(big.iter().step_by(4096).all(|b| *b == 1));
        drop(big);
        assert!(watch_rss(1));
        let start = rss_period_restart().unwrap();
        let spike = vec![3u8; 64 * MIB as usize];
        assert!(spike.iter().step_by(4096).all(|b| *b == 3));
        std::thread::sleep(Duration::from_millis(30));
        drop(spike);
        let end = rss_period_restart().unwrap();
        assert!(watch_rss(0));
        assert!(end.peak_rss_bytes >= start.rss_bytes + 56 * MIB, "{start:?} -> {end:?}");
    }

    #[test]
    fn fast_peak_rss_agrees_with_status() {
        let _one = PEAK_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let _ = exec_maxrss_bound();
        let big = vec![3u8; 48 * MIB as usize];
        assert!(big.iter().map(|b| *b as u64).sum::<u64>() == 3 * 48 * MIB);
        drop(big);
        // RSS moves between two reads (other tests run in parallel threads): compare each read with the
        // status read taken just after it, which can only be equal or later.
        for _ in 0..3 {
            let fast = self_memory().unwrap();
            let status = self_memory_from_status().unwrap();
            assert!(fast.peak_rss_bytes <= status.peak_rss_bytes, "{fast:?} vs {status:?}");
            assert!(fast.peak_rss_bytes + 8 * MIB >= status.peak_rss_bytes, "{fast:?} vs {status:?}");
        }
    }

    #[test]
    fn statm_sees_a_touched_megabyte() {
        // Fresh pages of our own (mmap, not the heap: malloc may hand back pages another test just freed,
        // already resident), touched one by one. Other tests of this binary run in parallel and may free
        // memory between the two reads, so a few tries.
        const LEN: usize = 8 << 20;
        let _one = PEAK_TESTS.lock().unwrap_or_else(|p| p.into_inner()); // not while they free 64 MiB
        let mut s = SelfStatm::open();
        let mut seen = Vec::new();
        for _ in 0..5 {
            // SAFETY: a private anonymous mapping of our own, written within its length, unmapped below.
            unsafe {
                let p = libc::mmap(
                    std::ptr::null_mut(),
                    LEN,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                assert_ne!(p, libc::MAP_FAILED);
                let before = s.rss_bytes().unwrap();
                for off in (0..LEN).step_by(4096) {
                    *(p as *mut u8).add(off) = 1;
                }
                let after = s.rss_bytes().unwrap();
                libc::munmap(p, LEN);
                if after >= before + (7 << 20) {
                    return;
                }
                seen.push((before, after));
            }
        }
        panic!("8 MiB touched, RSS rose less than 7 MiB in 5 tries: {seen:?}");
    }

    #[test]
    fn a_forked_child_reads_its_own_statm_not_the_parents() {
        // No test of this module allocates big buffers in parallel with this one (the child's numbers
        // are compared with the parent's).
        let _one = PEAK_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = SelfStatm::open();
        assert!(s.rss_bytes().is_some());
        let mut fds = [0i32; 2];
        // SAFETY: a pipe into an array we own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: the child touches a fresh mapping, reads /proc, writes one byte to the pipe and _exits
        // (glibc's malloc is fork-safe for the small allocations of the fresh read).
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // The child: 128 MiB more than the parent, read through the kept-open reader and through a
            // fresh open of /proc/<own pid>/statm; a reader still naming the parent misses the 128 MiB.
            let len = 128usize << 20;
            let mut ok = 0u8;
            unsafe {
                let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
                let p = libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0);
                if p != libc::MAP_FAILED {
                    std::ptr::write_bytes(p as *mut u8, 1, len);
                    let kept = s.rss_bytes().unwrap_or(0);
                    let fresh = super::super::procfs::rss_bytes(libc::getpid() as u32).unwrap_or(u64::MAX);
                    ok = (kept.abs_diff(fresh) < 32 * MIB) as u8 + 1;
                }
                libc::write(fds[1], &ok as *const u8 as *const libc::c_void, 1);
                libc::_exit(0)
            }
        }
        let mut ok = 0u8;
        // SAFETY: reading one byte into our own u8; waiting for our own child; closing our own fds.
        unsafe {
            libc::read(fds[0], &mut ok as *mut u8 as *mut libc::c_void, 1);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        assert_eq!(
            ok, 2,
            "the forked child's kept-open statm reader did not read the child (0: no answer, 1: wrong process)"
        );
    }
}
