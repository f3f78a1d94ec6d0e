//! The line profiler's cheap clock and its memory readers.
//!
//! `ticks()` is the per-event clock (the TSC on x86-64, ~8 ns; `CLOCK_MONOTONIC` elsewhere, ~20 ns).
//! `calibrate_gate_ticks()` measures the cheapest page fault of this machine: no line that changes the
//! resident set can be shorter than one page fault or one munmap/madvise, so an event that comes less
//! than half that time after the previous one cannot have seen RSS change, and the profiler skips the
//! `/proc/self/statm` read (~0.8 µs) for it. That read is core's `sources::self_proc::SelfStatm` (kept open,
//! re-read with `pread`, reopened in a forked child), the reader the rest of the in-process API uses.

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
    let page = torchmem_core::sources::procfs::page_size() as usize;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_fault_costs_something() {
        assert!(min_page_fault_ticks() > 0);
        assert!(ticks_per_second() > 1e6);
    }
}
