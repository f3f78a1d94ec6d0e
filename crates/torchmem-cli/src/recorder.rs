//! The recorder behind `torchmem run`: samples the profiled process tree's CPU memory (RSS at the fast
//! interval, PSS/USS at a slower one), GPU memory through NVML, and merges the messages the profiled Python
//! process sends over its pipe; everything is written to the profile in small committed batches.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};

use torchmem_core::model::*;
use torchmem_core::sources::gpu::{tree_bytes, GpuReading, GpuSource};
use torchmem_core::sources::procfs;
use torchmem_core::store::{ProfileWriter, Record};
use torchmem_core::wire::ChildMessage;

/// How often each source is read.
#[derive(Debug, Clone)]
pub struct Config {
    pub interval_ms: f64,
    pub pss_interval_ms: f64,
    pub tree_interval_ms: f64,
    pub flush_interval_ms: f64,
}

impl Default for Config {
    fn default() -> Self {
        Config { interval_ms: 10.0, pss_interval_ms: 250.0, tree_interval_ms: 100.0, flush_interval_ms: 50.0 }
    }
}

/// The latest values, for the live status line and the end-of-run check.
#[derive(Debug, Clone, Default)]
pub struct Latest {
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
    pub allocated_bytes: Option<u64>,
    pub peak_allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    pub gpu_process_bytes: Option<u64>,
    pub samples: u64,
}

pub struct Recorder {
    pub config: Config,
    writer: ProfileWriter,
    gpu: Option<Box<dyn GpuSource>>,
    root_pid: u32,
    start_ns: u64,
    tree: BTreeMap<u32, u32>,
    known: BTreeSet<u32>,
    last_tree: Option<Instant>,
    last_pss: Option<Instant>,
    /// The PSS/USS interval in use: the configured one, stretched so that walking a process's pages (it
    /// holds that process's mmap lock: its mmap, munmap and peak-RSS resets wait) takes ≤ 1 % of the time.
    pss_every_ms: f64,
    last_flush: Instant,
    last_gpu: BTreeMap<u32, (GpuSample, u64)>,
    last_torch: BTreeMap<u32, TorchSample>,
    pub latest: Latest,
    messages: Option<Receiver<String>>,
    pub bad_messages: u64,
}

/// The next PSS/USS interval: the configured one, or 100 times the slowest walk of one process's pages
/// (~12 ms for a 700 MiB torch process), whichever is longer: the profiled program waits on that walk only
/// when it maps, unmaps or resets its peak RSS during it, and this bounds that to 1 % of its time.
pub fn pss_interval_for(configured_ms: f64, slowest_walk_ms: f64) -> f64 {
    configured_ms.max(slowest_walk_ms * 100.0)
}

/// A GPU row repeats the previous one unless a value changed; rows are kept at least once a second anyway.
const HEARTBEAT_NS: u64 = 1_000_000_000;

impl Recorder {
    pub fn new(
        config: Config,
        writer: ProfileWriter,
        gpu: Option<Box<dyn GpuSource>>,
        root_pid: u32,
        start_ns: u64,
        messages: Option<Receiver<String>>,
    ) -> Self {
        Recorder {
            pss_every_ms: config.pss_interval_ms,
            config,
            writer,
            gpu,
            root_pid,
            start_ns,
            tree: BTreeMap::new(),
            known: BTreeSet::new(),
            last_tree: None,
            last_pss: None,
            last_flush: Instant::now(),
            last_gpu: BTreeMap::new(),
            last_torch: BTreeMap::new(),
            latest: Latest::default(),
            messages,
            bad_messages: 0,
        }
    }

    fn rel(&self, abs_ns: u64) -> u64 {
        abs_ns.saturating_sub(self.start_ns)
    }

    fn due(last: Option<Instant>, every_ms: f64) -> bool {
        last.is_none_or(|l| l.elapsed().as_secs_f64() * 1000.0 >= every_ms)
    }

    /// One tick: CPU (and at their rates the tree, PSS/USS, per-process rows), GPU, pending messages, flush.
    pub fn tick(&mut self) -> torchmem_core::Result<()> {
        let now_abs = torchmem_core::clock::monotonic_ns();
        let t_ns = self.rel(now_abs);
        if Self::due(self.last_tree, self.config.tree_interval_ms) || self.tree.is_empty() {
            self.refresh_tree(t_ns);
        }
        let pss_due = Self::due(self.last_pss, self.pss_every_ms);
        let mut slowest_walk_ms = 0.0f64;
        let gpu_readings: Vec<GpuReading> = self.gpu.as_ref().map(|g| g.read()).unwrap_or_default();

        let mut rss_total = 0u64;
        let mut pss_total = 0u64;
        let mut uss_total = 0u64;
        let mut alive = 0u32;
        let mut per_pid = Vec::new();
        for &pid in self.tree.keys() {
            if pss_due {
                let walk_started = Instant::now();
                let rollup = procfs::smaps_rollup(pid);
                slowest_walk_ms = slowest_walk_ms.max(walk_started.elapsed().as_secs_f64() * 1000.0);
                if let Some(r) = rollup.filter(|r| r.rss_bytes > 0) {
                    rss_total += r.rss_bytes;
                    pss_total += r.pss_bytes;
                    uss_total += r.uss_bytes;
                    alive += 1;
                    let gpu_bytes = if self.gpu.is_some() {
                        let b: u64 = gpu_readings.iter().filter_map(|g| g.process_bytes.get(&pid)).sum();
                        Some(b)
                    } else {
                        None
                    };
                    per_pid.push(ProcessSample {
                        t_ns,
                        pid,
                        rss_bytes: r.rss_bytes,
                        pss_bytes: Some(r.pss_bytes),
                        uss_bytes: Some(r.uss_bytes),
                        gpu_bytes,
                    });
                }
            } else if let Some(rss) = procfs::rss_bytes(pid).filter(|r| *r > 0) {
                rss_total += rss;
                alive += 1;
            }
        }
        if pss_due {
            self.last_pss = Some(Instant::now());
            self.pss_every_ms = pss_interval_for(self.config.pss_interval_ms, slowest_walk_ms);
        }
        if alive > 0 {
            let sample = CpuSample {
                t_ns,
                rss_bytes: rss_total,
                pss_bytes: pss_due.then_some(pss_total),
                uss_bytes: pss_due.then_some(uss_total),
                process_count: alive,
            };
            self.latest.rss_bytes = rss_total;
            self.latest.peak_rss_bytes = self.latest.peak_rss_bytes.max(rss_total);
            self.latest.samples += 1;
            self.writer.push(Record::Cpu(sample));
            for s in per_pid {
                self.writer.push(Record::Process(s));
            }
        }
        let pids: Vec<u32> = self.tree.keys().copied().collect();
        for r in &gpu_readings {
            let sample = GpuSample {
                t_ns,
                device: r.index,
                used_bytes: r.used_bytes,
                total_bytes: r.total_bytes,
                process_bytes: tree_bytes(r, pids.iter().copied()),
            };
            if let Some(b) = sample.process_bytes {
                self.latest.gpu_process_bytes = Some(b);
            }
            let keep = match self.last_gpu.get(&r.index) {
                Some((prev, prev_t)) => {
                    prev.used_bytes != sample.used_bytes
                        || prev.process_bytes != sample.process_bytes
                        || t_ns.saturating_sub(*prev_t) >= HEARTBEAT_NS
                }
                None => true,
            };
            if keep {
                self.last_gpu.insert(r.index, (sample.clone(), t_ns));
                self.writer.push(Record::Gpu(sample));
            }
        }
        self.drain_messages();
        if self.last_flush.elapsed().as_secs_f64() * 1000.0 >= self.config.flush_interval_ms {
            self.writer.flush()?;
            self.last_flush = Instant::now();
        }
        Ok(())
    }

    fn refresh_tree(&mut self, t_ns: u64) {
        self.tree = procfs::process_tree(self.root_pid);
        self.last_tree = Some(Instant::now());
        for (&pid, &ppid) in &self.tree {
            let first = self.known.insert(pid);
            let cmdline = if first { procfs::cmdline(pid) } else { String::new() };
            self.writer.push(Record::ProcessSeen(ProcessInfo {
                pid,
                ppid,
                cmdline,
                first_t_ns: t_ns,
                last_t_ns: t_ns,
            }));
        }
    }

    /// Moves every message the profiled process sent so far into the profile.
    pub fn drain_messages(&mut self) {
        loop {
            let line = match self.messages.as_ref().map(|rx| rx.try_recv()) {
                Some(Ok(line)) => line,
                Some(Err(TryRecvError::Disconnected)) => {
                    self.messages = None;
                    break;
                }
                _ => break,
            };
            match ChildMessage::parse_line(&line) {
                Ok(msg) => self.store_message(msg),
                Err(_) => self.bad_messages += 1,
            }
        }
    }

    fn store_message(&mut self, msg: ChildMessage) {
        let record = match msg {
            ChildMessage::Torch {
                t_ns,
                device,
                allocated,
                reserved,
                peak_allocated,
                peak_reserved,
                active,
                inactive_split,
            } => {
                self.latest.allocated_bytes = Some(allocated);
                self.latest.reserved_bytes = Some(reserved);
                self.latest.peak_allocated_bytes =
                    Some(self.latest.peak_allocated_bytes.unwrap_or(0).max(peak_allocated).max(allocated));
                let sample = TorchSample {
                    t_ns: self.rel(t_ns),
                    device,
                    allocated_bytes: allocated,
                    reserved_bytes: reserved,
                    peak_allocated_bytes: peak_allocated,
                    peak_reserved_bytes: peak_reserved,
                    active_bytes: active,
                    inactive_split_bytes: inactive_split,
                };
                // An unchanged reading adds nothing to a step-function timeline: keep one a second.
                if let Some(prev) = self.last_torch.get(&device) {
                    let same = TorchSample { t_ns: prev.t_ns, ..sample.clone() } == *prev;
                    if same && sample.t_ns.saturating_sub(prev.t_ns) < HEARTBEAT_NS {
                        return;
                    }
                }
                self.last_torch.insert(device, sample.clone());
                Record::Torch(sample)
            }
            ChildMessage::Marker { t_ns, kind, edge, name, index, memory } => {
                Record::Marker(Marker { t_ns: self.rel(t_ns), kind, edge, name, index, memory })
            }
            ChildMessage::LineProfile { t_ns, data } => Record::LineProfile { t_ns: self.rel(t_ns), data },
            ChildMessage::Blob { t_ns, name, data } => Record::Blob { t_ns: self.rel(t_ns), name, data },
        };
        self.writer.push(record);
    }

    /// Waits (up to `timeout`) for the profiled processes to close the pipe, storing what they still send.
    pub fn drain_until_closed(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.messages.is_some() && Instant::now() < deadline {
            self.drain_messages();
            std::thread::sleep(Duration::from_millis(5));
        }
        self.drain_messages();
    }

    pub fn finish(mut self, exit_code: Option<i32>) -> torchmem_core::Result<()> {
        self.drain_messages();
        let duration = self.rel(torchmem_core::clock::monotonic_ns());
        self.writer.finish(exit_code, duration)
    }
}

/// Reads newline-separated messages from the pipe's read end on a thread of its own.
pub fn spawn_pipe_reader(read_fd: std::os::fd::OwnedFd) -> Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("torchmem-events".into())
        .spawn(move || {
            let reader = BufReader::with_capacity(1 << 16, std::fs::File::from(read_fd));
            for line in reader.lines() {
                match line {
                    Ok(l) if !l.is_empty() => {
                        if tx.send(l).is_err() {
                            break;
                        }
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        })
        .expect("spawn event reader thread");
    rx
}

#[cfg(test)]
mod tests {
    use super::pss_interval_for;

    #[test]
    fn pss_reads_back_off_to_one_percent_of_the_time() {
        assert_eq!(pss_interval_for(250.0, 0.3), 250.0);
        assert_eq!(pss_interval_for(250.0, 12.0), 1200.0);
        assert_eq!(pss_interval_for(1000.0, 5.0), 1000.0);
    }
}
