//! The line profiler's cheap clock and its memory readers.
//!
//! `ticks()` is the per-event clock (the TSC on x86-64, ~8 ns; `CLOCK_MONOTONIC` elsewhere, ~20 ns).
//! `calibrate_gate_ticks()` measures the cheapest page fault of this machine: no line that changes the
//! resident set can be shorter than one page fault or one munmap/madvise, so an event that comes less
//! than half that time after the previous one cannot have seen RSS change, and the profiler skips the
//! `/proc/self/statm` read (~0.8 µs) for it. `Statm` keeps the file open and re-reads it with `pread`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// The per-event clock, in ticks (see `ticks_per_second`).
#[inline(always)]
pub fn ticks() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no preconditions on x86-64.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: valid pointer to a timespec.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

/// How many ticks one second has, measured once over ~20 ms.
pub fn ticks_per_second() -> f64 {
    let t0 = Instant::now();
    let c0 = ticks();
    while t0.elapsed().as_millis() < 20 {
        std::hint::spin_loop();
    }
    let c1 = ticks();
    (c1.wrapping_sub(c0)) as f64 / t0.elapsed().as_secs_f64()
}

/// The cheapest first-touch page fault on this machine, in ticks (min over 256 pages, THP off).
pub fn min_page_fault_ticks() -> u64 {
    const PAGES: usize = 256;
    let page = page_size();
    let len = PAGES * page;
    // SAFETY: anonymous private mapping, unmapped below; we only write inside it.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return 0;
        }
        libc::madvise(p, len, libc::MADV_NOHUGEPAGE);
        let base = p as *mut u8;
        let mut best = u64::MAX;
        for i in 0..PAGES {
            let a = ticks();
            std::ptr::write_volatile(base.add(i * page), 1u8);
            let b = ticks();
            best = best.min(b.wrapping_sub(a));
        }
        libc::munmap(p, len);
        best
    }
}

pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if v > 0 {
        v as usize
    } else {
        4096
    }
}

static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn after_fork_child() {
    FORKED.store(true, Ordering::Relaxed);
}

/// `/proc/self/statm` kept open; re-opened in a forked child (the old fd names the parent).
pub struct Statm {
    fd: i32,
    page_bytes: i64,
}

impl Statm {
    pub fn open() -> Statm {
        static ATFORK: std::sync::Once = std::sync::Once::new();
        ATFORK.call_once(|| {
            // SAFETY: registering a plain extern "C" fn that only stores an atomic.
            unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
        });
        // SAFETY: NUL-terminated path literal.
        let fd = unsafe { libc::open(c"/proc/self/statm".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        Statm { fd, page_bytes: page_size() as i64 }
    }

    /// Resident set size in bytes, or `None` when /proc is not readable.
    pub fn rss_bytes(&mut self) -> Option<i64> {
        if FORKED.swap(false, Ordering::Relaxed) {
            if self.fd >= 0 {
                // SAFETY: closing our own fd.
                unsafe { libc::close(self.fd) };
            }
            *self = Statm::open();
        }
        if self.fd < 0 {
            return None;
        }
        let mut buf = [0u8; 128];
        // SAFETY: buffer is valid for its length; fd is ours.
        let n = unsafe { libc::pread(self.fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len(), 0) };
        if n <= 0 {
            return None;
        }
        parse_statm_resident_pages(&buf[..n as usize]).map(|pages| pages * self.page_bytes)
    }
}

impl Drop for Statm {
    fn drop(&mut self) {
        if self.fd >= 0 {
            // SAFETY: closing our own fd once.
            unsafe { libc::close(self.fd) };
        }
    }
}

/// The second field of statm ("size resident shared text lib data dt"), in pages.
pub fn parse_statm_resident_pages(text: &[u8]) -> Option<i64> {
    let mut fields = text.split(|b| *b == b' ');
    fields.next()?;
    let resident = fields.next()?;
    let mut v: i64 = 0;
    if resident.is_empty() {
        return None;
    }
    for &b in resident {
        if !b.is_ascii_digit() {
            return None;
        }
        v = v * 10 + (b - b'0') as i64;
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_statm() {
        assert_eq!(parse_statm_resident_pages(b"1000 250 30 1 0 90 0\n"), Some(250));
        assert_eq!(parse_statm_resident_pages(b"1000"), None);
        assert_eq!(parse_statm_resident_pages(b"1000 x 3"), None);
    }

    #[test]
    fn statm_sees_a_touched_megabyte() {
        let mut s = Statm::open();
        let before = s.rss_bytes().unwrap();
        let v = vec![1u8; 8 << 20];
        let after = s.rss_bytes().unwrap();
        assert!(after - before >= 7 << 20, "{before} -> {after}");
        drop(v);
    }

    #[test]
    fn a_page_fault_costs_something() {
        assert!(min_page_fault_ticks() > 0);
        assert!(ticks_per_second() > 1e6);
    }
}
