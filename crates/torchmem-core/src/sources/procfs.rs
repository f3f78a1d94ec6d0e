//! Reads a process tree's memory from /proc: RSS from `statm` or with its high-water mark (VmHWM) from
//! `status` (cheap, a few µs: the high-rate path), PSS and
//! USS from `smaps_rollup` (milliseconds on a big process: the low-rate path), the tree from `children`
//! files with a full /proc scan as fallback. The parsers here are the only ones: `self_proc` reads this
//! process's own files through them.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;

/// The kernel's page size in bytes (asked once).
pub fn page_size() -> u64 {
    static PAGE_BYTES: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *PAGE_BYTES.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 {
            p as u64
        } else {
            4096
        }
    })
}

/// Resident set size in bytes from `/proc/PID/statm` (second field, in pages).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let text = fs::read(format!("/proc/{pid}/statm")).ok()?;
    parse_statm_rss_pages(&text).map(|pages| pages * page_size())
}

/// The second field of statm ("size resident shared text lib data dt"), in pages; None when it is missing
/// or not a number.
pub fn parse_statm_rss_pages(text: &[u8]) -> Option<u64> {
    let field = text.split(|b| b.is_ascii_whitespace()).filter(|f| !f.is_empty()).nth(1)?;
    if field.is_empty() || field.len() > 19 || !field.iter().all(u8::is_ascii_digit) {
        return None;
    }
    Some(field.iter().fold(0u64, |v, b| v * 10 + (b - b'0') as u64))
}

/// The parts of `smaps_rollup` we use, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Rollup {
    pub rss_bytes: u64,
    pub pss_bytes: u64,
    /// Private_Clean + Private_Dirty: pages no other process maps.
    pub uss_bytes: u64,
    pub swap_bytes: u64,
}

pub fn smaps_rollup(pid: u32) -> Option<Rollup> {
    let text = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    parse_smaps_rollup(&text)
}

pub fn parse_smaps_rollup(text: &str) -> Option<Rollup> {
    let mut r = Rollup::default();
    let mut seen_pss = false;
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else { continue };
        let kib: u64 = match rest.trim().trim_end_matches("kB").trim().parse() {
            Ok(v) => v,
            Err(_) => continue,
        };
        let bytes = kib * 1024;
        match key {
            "Rss" => r.rss_bytes = bytes,
            "Pss" => {
                r.pss_bytes = bytes;
                seen_pss = true
            }
            "Private_Clean" | "Private_Dirty" => r.uss_bytes += bytes,
            "Swap" => r.swap_bytes = bytes,
            _ => {}
        }
    }
    seen_pss.then_some(r)
}

/// `VmHWM` (peak RSS since start or the last `clear_refs` reset) from `/proc/PID/status`, bytes.
pub fn peak_rss_bytes(pid: u32) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status_field_bytes(&text, "VmHWM")
}

/// RSS (`VmRSS`) and its kernel high-water mark (`VmHWM`) from one read of `/proc/PID/status`, bytes.
/// The sampler's fast path: the high-water mark catches a peak that fell between two samples.
pub fn rss_and_peak_bytes(pid: u32) -> Option<(u64, Option<u64>)> {
    let text = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_status_rss_and_peak(&text)
}

/// (`VmRSS`, `VmHWM`) of a status text; None for a process without memory (a zombie, a kernel thread).
pub fn parse_status_rss_and_peak(text: &str) -> Option<(u64, Option<u64>)> {
    let rss = status_field_bytes(text, "VmRSS")?;
    Some((rss, status_field_bytes(text, "VmHWM")))
}

pub fn status_field_bytes(text: &str, field: &str) -> Option<u64> {
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix(field).and_then(|r| r.strip_prefix(':')) {
            let kib: u64 = rest.trim().trim_end_matches("kB").trim().parse().ok()?;
            return Some(kib * 1024);
        }
    }
    None
}

/// The parent pid from `/proc/PID/stat` (the field after the parenthesised command name).
pub fn parent_pid(pid: u32) -> Option<u32> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_ppid(&text)
}

pub fn parse_stat_ppid(text: &str) -> Option<u32> {
    let after = &text[text.rfind(')')? + 1..];
    after.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// When the process started, on CLOCK_MONOTONIC in ns (the run's clock), from `/proc/PID/stat`'s
/// `starttime` (clock ticks since boot, so 10 ms steps): a process first seen by a sample some time after
/// it started still gets its real lifetime.
pub fn start_monotonic_ns(pid: u32) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let ticks = parse_stat_starttime_ticks(&text)?;
    // SAFETY: sysconf has no preconditions.
    let per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let per_s = if per_s > 0 { per_s as u128 } else { 100 };
    let boot_ns = (ticks as u128 * 1_000_000_000 / per_s) as u64;
    // starttime counts on CLOCK_BOOTTIME (suspend included): shift it by BOOTTIME − MONOTONIC now.
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    let boottime_now = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    let offset = boottime_now.saturating_sub(crate::clock::monotonic_ns());
    Some(boot_ns.saturating_sub(offset))
}

/// `starttime`, the 22nd field of `/proc/PID/stat` (counted after the parenthesised command name, which
/// may hold spaces and parentheses).
pub fn parse_stat_starttime_ticks(text: &str) -> Option<u64> {
    let after = &text[text.rfind(')')? + 1..];
    after.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// The command line, arguments joined by spaces ("[comm]" for kernel threads and zombies).
pub fn cmdline(pid: u32) -> String {
    match fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(bytes) if !bytes.is_empty() => bytes
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect::<Vec<_>>()
            .join(" "),
        _ => fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| format!("[{}]", c.trim())).unwrap_or_default(),
    }
}

/// Every live descendant of `root` (root included), as pid → ppid.
///
/// Uses `/proc/PID/task/TID/children` (one small read per thread of each process in the tree); falls back to
/// scanning every process's `stat` when the kernel lacks `children` files.
pub fn process_tree(root: u32) -> BTreeMap<u32, u32> {
    let mut tree = BTreeMap::new();
    if !std::path::Path::new(&format!("/proc/{root}")).exists() {
        return tree;
    }
    let root_ppid = parent_pid(root).unwrap_or(0);
    tree.insert(root, root_ppid);
    if std::path::Path::new(&format!("/proc/{root}/task/{root}/children")).exists() {
        let mut stack = vec![root];
        while let Some(pid) = stack.pop() {
            for child in children_of(pid) {
                if tree.insert(child, pid).is_none() {
                    stack.push(child);
                }
            }
        }
    } else {
        let mut by_parent: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for pid in all_pids() {
            if let Some(ppid) = parent_pid(pid) {
                by_parent.entry(ppid).or_default().push(pid);
            }
        }
        let mut stack = vec![root];
        while let Some(pid) = stack.pop() {
            for &child in by_parent.get(&pid).map(|v| v.as_slice()).unwrap_or(&[]) {
                if tree.insert(child, pid).is_none() {
                    stack.push(child);
                }
            }
        }
    }
    tree
}

/// The children of `pid` (of every thread of it), from the kernel's `children` files.
pub fn children_of(pid: u32) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else { return out };
    for task in tasks.flatten() {
        if let Ok(text) = fs::read_to_string(task.path().join("children")) {
            out.extend(text.split_ascii_whitespace().filter_map(|s| s.parse::<u32>().ok()));
        }
    }
    out
}

fn all_pids() -> Vec<u32> {
    fs::read_dir("/proc")
        .map(|rd| rd.flatten().filter_map(|e| e.file_name().to_str()?.parse().ok()).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_text() {
        assert_eq!(parse_statm_rss_pages(b"1000 250 30 1 0 400 0\n"), Some(250));
        assert_eq!(parse_statm_rss_pages(b"1000"), None);
        assert_eq!(parse_statm_rss_pages(b"1000 x 3"), None);
        assert_eq!(parse_stat_ppid("42 (a b) c) S 7 42 42 0"), Some(7));
        let stat = "42 (a b) c) S 7 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 123456 1000 250";
        assert_eq!(parse_stat_starttime_ticks(stat), Some(123456));
        assert_eq!(parse_stat_starttime_ticks("42 (x) S 7"), None);
        let rollup = "00400000-7ffd [rollup]\nRss:  100 kB\nPss:  60 kB\nPss_Anon: 1 kB\nShared_Clean: 40 kB\nPrivate_Clean: 10 kB\nPrivate_Dirty: 50 kB\nSwap: 0 kB\n";
        let r = parse_smaps_rollup(rollup).unwrap();
        assert_eq!(r.rss_bytes, 100 * 1024);
        assert_eq!(r.pss_bytes, 60 * 1024);
        assert_eq!(r.uss_bytes, 60 * 1024);
        assert_eq!(status_field_bytes("Name:\tx\nVmHWM:\t  2048 kB\n", "VmHWM"), Some(2 << 20));
        let status = "Name:\tpython\nVmPeak:\t  9000 kB\nVmHWM:\t    4096 kB\nVmRSS:\t    1024 kB\n";
        assert_eq!(parse_status_rss_and_peak(status), Some((1 << 20, Some(4 << 20))));
        assert_eq!(parse_status_rss_and_peak("Name:\tzombie\nState:\tZ (zombie)\n"), None);
    }

    #[test]
    fn reads_this_process_from_real_proc() {
        let me = std::process::id();
        let rss = rss_bytes(me).unwrap();
        assert!(rss > 1 << 20, "rss {rss}");
        let r = smaps_rollup(me).unwrap();
        assert!(r.pss_bytes > 0 && r.uss_bytes <= r.rss_bytes);
        assert!(peak_rss_bytes(me).unwrap() >= rss / 2);
        let (rss2, hwm) = rss_and_peak_bytes(me).unwrap();
        assert!(rss2 > 1 << 20 && hwm.unwrap() >= rss2, "{rss2} {hwm:?}");
        let tree = process_tree(me);
        assert!(tree.contains_key(&me));
    }

    #[test]
    fn a_real_child_starts_when_it_was_spawned() {
        let before = crate::clock::monotonic_ns();
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let start = start_monotonic_ns(child.id());
        child.kill().unwrap();
        child.wait().unwrap();
        let start = start.unwrap();
        // starttime has clock-tick (10 ms) steps.
        assert!(start + 20_000_000 >= before && start <= crate::clock::monotonic_ns(), "{before} {start}");
    }

    #[test]
    fn finds_a_real_child() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        let tree = process_tree(std::process::id());
        let found = tree.get(&child.id()).copied();
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found, Some(std::process::id()));
    }
}
