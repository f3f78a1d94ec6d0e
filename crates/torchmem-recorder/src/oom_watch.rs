//! Did the kernel's OOM killer act during a run? `torchmem run` reads the OOM-kill counters at the start and
//! at the end: the run's memory cgroup (cgroup v2 `memory.events`, v1 `memory.oom_control`: `oom_kill N`,
//! which counts kills of processes in that cgroup whatever limit was hit) and the host's (`/proc/vmstat`),
//! and, where it is readable (root, or `dmesg_restrict=0`), the kernel log from the start of the run on,
//! looking for "Killed process PID" of the program. The result goes into the profile's run metadata.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use torchmem_core::model::OomFinding;

/// The counters at the start of a run, and the kernel log positioned at its end.
pub struct OomWatch {
    cgroup_file: Option<PathBuf>,
    cgroup_before: Option<u64>,
    host_before: Option<u64>,
    kmsg: Option<File>,
}

/// `key N` from a flat-keyed file such as memory.events or /proc/vmstat.
fn read_key(path: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key)).then(|| it.next()?.parse().ok()).flatten()
    })
}

/// The file holding this process's memory cgroup's `oom_kill` counter, if one can be found.
fn cgroup_counter_file() -> Option<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut candidates = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_id, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            // cgroup v1: the memory controller's own hierarchy (the mount root inside a container).
            candidates.push(Path::new("/sys/fs/cgroup/memory").join(rel).join("memory.oom_control"));
            candidates.push(PathBuf::from("/sys/fs/cgroup/memory/memory.oom_control"));
        } else if controllers.is_empty() {
            // cgroup v2 (unified), mounted at /sys/fs/cgroup or, on hybrid systems, /sys/fs/cgroup/unified.
            candidates.push(Path::new("/sys/fs/cgroup").join(rel).join("memory.events"));
            candidates.push(Path::new("/sys/fs/cgroup/unified").join(rel).join("memory.events"));
            candidates.push(PathBuf::from("/sys/fs/cgroup/memory.events"));
        }
    }
    candidates.into_iter().find(|p| read_key(p, "oom_kill").is_some())
}

impl OomWatch {
    /// Reads the counters now and opens the kernel log at its end (records from here on are the run's).
    pub fn start() -> OomWatch {
        let cgroup_file = cgroup_counter_file();
        let cgroup_before = cgroup_file.as_deref().and_then(|p| read_key(p, "oom_kill"));
        let host_before = read_key(Path::new("/proc/vmstat"), "oom_kill");
        let kmsg =
            std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open("/dev/kmsg").ok().filter(|f| {
                use std::os::fd::AsRawFd;
                // SAFETY: lseek on a descriptor we own; SEEK_END on /dev/kmsg skips the records so far.
                unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_END) >= 0 }
            });
        OomWatch { cgroup_file, cgroup_before, host_before, kmsg }
    }

    /// What happened since `start`. `program_pid` is the program torchmem started.
    pub fn finish(&mut self, program_pid: u32) -> OomFinding {
        let cgroup_kills = match (&self.cgroup_file, self.cgroup_before) {
            (Some(p), Some(before)) => read_key(p, "oom_kill").map(|now| now.saturating_sub(before)),
            _ => None,
        };
        let host_kills = self
            .host_before
            .and_then(|before| read_key(Path::new("/proc/vmstat"), "oom_kill").map(|now| now.saturating_sub(before)));
        let program_in_kernel_log = self.kmsg.as_mut().map(|f| {
            let needle = format!("Killed process {program_pid} (");
            let mut found = false;
            let mut buf = vec![0u8; 8192];
            // Each read returns one record; EAGAIN at the end, EPIPE when records were overwritten (go on).
            for _ in 0..100_000 {
                match f.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => found |= String::from_utf8_lossy(&buf[..n]).contains(&needle),
                    Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                    Err(_) => break,
                }
            }
            found
        });
        OomFinding { cgroup_kills, host_kills, program_in_kernel_log }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flat_keyed_files_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("memory.events");
        std::fs::write(&p, "low 0\nhigh 0\nmax 3\noom 2\noom_kill 1\noom_group_kill 0\n").unwrap();
        assert_eq!(read_key(&p, "oom_kill"), Some(1));
        assert_eq!(read_key(&p, "oom"), Some(2));
        assert_eq!(read_key(&p, "nope"), None);
    }

    #[test]
    fn counters_are_read_on_this_machine() {
        // /proc/vmstat has had oom_kill since Linux 4.13.
        let mut w = OomWatch::start();
        let f = w.finish(std::process::id());
        assert_eq!(f.host_kills.is_some(), read_key(Path::new("/proc/vmstat"), "oom_kill").is_some());
        assert_eq!(f.program_in_kernel_log, w.kmsg.as_ref().map(|_| false));
    }
}
