//! One clock for the whole run: CLOCK_MONOTONIC in nanoseconds. Python's `time.monotonic_ns()` reads the same
//! clock on Linux, so events from the profiled process and the recorder's samples line up exactly.

pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Wall-clock seconds since the Unix epoch, for the profile's metadata.
pub fn unix_time_s() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}
