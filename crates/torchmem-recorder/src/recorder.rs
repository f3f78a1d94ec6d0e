//! The recorder behind `torchmem run`: samples the profiled process tree's CPU memory (RSS at the fast
//! interval, PSS/USS at a slower one), GPU memory through NVML, and merges the messages the profiled Python
//! processes send to its Unix socket (`EventListener`: each process connects by itself and says who it is);
//! everything is written to the profile in small committed batches. Step and phase markers pass through
//! the keep-or-fold rule (`torchmem_core::fold`): a fast loop's file stays small, its totals exact.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use torchmem_core::fold::{SpanFolder, DEFAULT_KEEP_SPANS};
use torchmem_core::model::*;
use torchmem_core::record::{Blob, GpuIdentity, GpuProcesses, Identity, Outlived, Vmhwm};
use torchmem_core::sources::gpu::{tree_bytes, GpuReading, GpuSource};
use torchmem_core::sources::procfs;
use torchmem_core::store::Record;
use torchmem_core::wire::ChildMessage;

use crate::sinks::{GpuProcessBytes, Sinks};

/// How often each source is read.
#[derive(Debug, Clone)]
pub struct Config {
    pub interval_ms: f64,
    pub pss_interval_ms: f64,
    pub tree_interval_ms: f64,
    pub flush_interval_ms: f64,
    /// Occurrences of each (pid, rank, kind, name) step or phase kept as markers; the rest are folded.
    pub keep_spans: u64,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            interval_ms: 10.0,
            pss_interval_ms: 250.0,
            tree_interval_ms: 100.0,
            flush_interval_ms: 50.0,
            keep_spans: DEFAULT_KEEP_SPANS,
        }
    }
}

/// One message from a profiled process, stamped with the identity its connection announced (None: a line
/// that is not a message).
pub struct Incoming {
    pub origin: Origin,
    pub message: Option<ChildMessage>,
}

/// The recorder's Unix socket (in a private directory, removed on drop): every process of the run connects
/// to `path()` by itself, so descendants started by `spawn` (no inherited descriptors) are heard too. One
/// reader thread per connection parses the lines.
pub struct EventListener {
    dir: PathBuf,
    path: PathBuf,
    open: Arc<AtomicUsize>,
    messages: Receiver<Incoming>,
}

/// The pid of a connected peer, from the kernel.
fn peer_pid(stream: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED fills a ucred of the size we pass.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0 && cred.pid > 0).then_some(cred.pid as u32)
}

fn read_connection(stream: UnixStream, tx: Sender<Incoming>, open: Arc<AtomicUsize>) {
    // Until the process says more in its hello, the kernel's word for who it is.
    let mut origin = Origin { pid: peer_pid(&stream), ..Default::default() };
    let reader = BufReader::with_capacity(1 << 16, stream);
    for line in reader.lines() {
        let Ok(line) = line else { break };
        if line.is_empty() {
            continue;
        }
        let message = match ChildMessage::parse_line(&line) {
            Ok(ChildMessage::Hello { origin: o, launch }) => {
                origin = o;
                Some(ChildMessage::Hello { origin: o, launch })
            }
            Ok(m) => Some(m),
            Err(_) => None,
        };
        if tx.send(Incoming { origin, message }).is_err() {
            break;
        }
    }
    open.fetch_sub(1, Ordering::AcqRel);
}

impl EventListener {
    /// Listens on a fresh socket under the temporary directory (`TMPDIR`, else /tmp).
    pub fn bind() -> anyhow::Result<Self> {
        let name = format!("torchmem-events-{}-{}", std::process::id(), torchmem_core::clock::monotonic_ns());
        let mut last_err = None;
        for base in [std::env::temp_dir(), PathBuf::from("/tmp")] {
            let dir = base.join(&name);
            let path = dir.join("events.sock");
            // sun_path holds 108 bytes.
            if path.as_os_str().len() >= 100 {
                continue;
            }
            let made = std::fs::DirBuilder::new().mode(0o700).create(&dir);
            match made.and_then(|_| UnixListener::bind(&path)) {
                Ok(listener) => return Ok(Self::serve(dir, path, listener)),
                Err(e) => {
                    let _ = std::fs::remove_dir(&dir);
                    last_err = Some(format!("{}: {e}", dir.display()));
                }
            }
        }
        anyhow::bail!(
            "cannot create the event socket ({}). Set TMPDIR to a writable directory with a short path",
            last_err.unwrap_or_else(|| "the temporary directory's path is too long".into())
        )
    }

    fn serve(dir: PathBuf, path: PathBuf, listener: UnixListener) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let open = Arc::new(AtomicUsize::new(0));
        let counter = open.clone();
        std::thread::Builder::new()
            .name("torchmem-events".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    counter.fetch_add(1, Ordering::AcqRel);
                    let (tx, counter2) = (tx.clone(), counter.clone());
                    let spawned = std::thread::Builder::new()
                        .name("torchmem-events-conn".into())
                        .spawn(move || read_connection(stream, tx, counter2));
                    if spawned.is_err() {
                        counter.fetch_sub(1, Ordering::AcqRel);
                    }
                }
            })
            .expect("spawn event listener thread");
        EventListener { dir, path, open, messages: rx }
    }

    /// The socket's path, for `TORCHMEM_EVENT_SOCKET`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Connections still open (their processes may still send).
    pub fn open_connections(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }
}

impl Drop for EventListener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

pub struct Recorder {
    pub config: Config,
    /// Where the records go: the profile, and the live sinks asked for (`crate::sinks`).
    writer: Sinks,
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
    /// The tree's RSS at the last PSS/USS read: a read is also taken when RSS grew 1.5× since (see
    /// `pss_due_for_growth`), so a short run or a burst of forked workers is not described by a stale read.
    rss_at_last_pss: u64,
    /// The tree's process count at the last PSS/USS read (see `pss_due_for_tree_change`).
    tree_len_at_last_pss: usize,
    /// Each process's kernel RSS high-water mark (`VmHWM`), the highest read: it holds a peak that fell
    /// between two samples. Stored as the `vmhwm` blob; `hwm_stored` is what was stored last.
    hwm_bytes: BTreeMap<u32, u64>,
    hwm_stored: BTreeMap<u32, u64>,
    /// Each process's NVML peak per GPU (the rank × GPU matrix), stored as the `gpu_processes` blob when
    /// it changed (`gpu_processes_dirty`).
    gpu_processes: GpuProcesses,
    gpu_processes_dirty: bool,
    last_flush: Instant,
    last_gpu: BTreeMap<u32, (GpuSample, u64)>,
    last_torch: BTreeMap<(Option<u32>, u32), TorchSample>,
    /// The tree's RSS at the last sample (when PSS is due again; the live outputs read `LiveState`).
    latest_rss_bytes: u64,
    events: Option<EventListener>,
    folder: SpanFolder,
    pub bad_messages: u64,
    /// This process's own children that are not the program's (the signal sentinel). Every other child
    /// of ours besides the program is an orphan of its tree that the kernel handed to us (we are its
    /// subreaper, `PR_SET_CHILD_SUBREAPER`): it stays in the tree, and we reap it when it ends.
    not_the_programs: BTreeSet<u32>,
    /// The program's process as first seen (its real start), for its end time.
    seen_root: Option<ProcessInfo>,
    /// When the program ended (ns since the run's start): the run's duration.
    end_t_ns: Option<u64>,
    /// Processes of the tree still running when the program ended (orphans it left running).
    outlived: BTreeSet<u32>,
}

/// The blob that lists the processes of the tree that were still running when the program ended
/// (`record::Outlived`): the report marks them as having outlived it.
pub const OUTLIVED_BLOB: &str = Blob::OUTLIVED;

/// How one process ended, from `wait4`.
#[derive(Debug, Clone, Copy)]
pub struct Reaped {
    /// The raw wait status (`ExitStatus::from_raw`).
    pub status: i32,
    /// The kernel's peak RSS of the process (and of its reaped descendants), `ru_maxrss`.
    pub max_rss_bytes: u64,
}

/// Reaps `pid` if it has ended (never blocks); None while it runs.
pub fn try_reap(pid: u32) -> std::io::Result<Option<Reaped>> {
    let mut status = 0;
    // SAFETY: a zeroed rusage we own for wait4 to fill.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: wait4 on a pid that is our child, with out-parameters we own.
        let r = unsafe { libc::wait4(pid as libc::pid_t, &mut status, libc::WNOHANG, &mut usage) };
        if r == 0 {
            return Ok(None);
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        // ru_maxrss is in KiB on Linux.
        return Ok(Some(Reaped { status, max_rss_bytes: (usage.ru_maxrss.max(0) as u64) * 1024 }));
    }
}

/// The next PSS/USS interval: the configured one, or 100 times the slowest walk of one process's pages
/// (~12 ms for a 700 MiB torch process), whichever is longer: the profiled program waits on that walk only
/// when it maps, unmaps or resets its peak RSS during it, and this bounds that to 1 % of its time.
pub fn pss_interval_for(configured_ms: f64, slowest_walk_ms: f64) -> f64 {
    configured_ms.max(slowest_walk_ms * 100.0)
}

/// A PSS/USS read out of turn: the tree's RSS grew to 1.5× what it was at the last read (the program
/// started up, loaded a model, forked DataLoader workers). Growth by 1.5× can happen only a few dozen
/// times in a run, so this adds few page walks; at least 20 ms apart all the same.
pub fn pss_due_for_growth(rss_at_last_pss: u64, rss_now: u64, ms_since_last_pss: f64) -> bool {
    rss_at_last_pss > 0 && rss_now >= rss_at_last_pss + rss_at_last_pss / 2 && ms_since_last_pss >= 20.0
}

/// A PSS/USS read out of turn because processes joined or left the tree (workers started or ended: how
/// pages are shared changed), at most one per tenth of the PSS interval so a program that keeps
/// starting short subprocesses does not walk pages more often than 10 % above the budget.
pub fn pss_due_for_tree_change(count_at_last_pss: usize, count_now: usize, ms_since: f64, every_ms: f64) -> bool {
    count_at_last_pss > 0 && count_now != count_at_last_pss && ms_since >= (every_ms / 10.0).max(20.0)
}

/// A GPU row repeats the previous one unless a value changed; rows are kept at least once a second anyway.
const HEARTBEAT_NS: u64 = 1_000_000_000;

impl Recorder {
    pub fn new(
        config: Config,
        writer: Sinks,
        gpu: Option<Box<dyn GpuSource>>,
        root_pid: u32,
        start_ns: u64,
        events: Option<EventListener>,
    ) -> Self {
        Recorder {
            folder: SpanFolder::new(config.keep_spans),
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
            rss_at_last_pss: 0,
            tree_len_at_last_pss: 0,
            hwm_bytes: BTreeMap::new(),
            hwm_stored: BTreeMap::new(),
            gpu_processes: GpuProcesses::default(),
            gpu_processes_dirty: false,
            last_flush: Instant::now(),
            last_gpu: BTreeMap::new(),
            last_torch: BTreeMap::new(),
            latest_rss_bytes: 0,
            events,
            bad_messages: 0,
            not_the_programs: BTreeSet::new(),
            seen_root: None,
            end_t_ns: None,
            outlived: BTreeSet::new(),
        }
    }

    /// Children of this process that are not the program's (the signal sentinel): never adopted as
    /// orphans of the tree, never reaped here.
    pub fn set_not_the_programs(&mut self, pids: impl IntoIterator<Item = u32>) {
        self.not_the_programs.extend(pids);
    }

    /// The program has ended (`exit_abs_ns` on CLOCK_MONOTONIC) and is reaped: a last sample of what is
    /// left of its tree (orphans it left running), its end time, and the kernel's peak RSS from `wait4`,
    /// which the recorded peak never falls below.
    pub fn program_ended(&mut self, exit_abs_ns: u64, reaped: Reaped) -> torchmem_core::Result<()> {
        let t_end = self.rel(exit_abs_ns);
        self.end_t_ns = Some(t_end);
        let root = self.root_pid;
        let e = self.hwm_bytes.entry(root).or_insert(0);
        *e = (*e).max(reaped.max_rss_bytes);
        if let Some(info) = self.seen_root.take() {
            self.writer.push(Record::ProcessSeen(ProcessInfo { last_t_ns: t_end.max(info.first_t_ns), ..info }));
        }
        // The final sample, now: the tree without the program (it is gone), with the PSS of what is left.
        self.last_tree = None;
        self.last_pss = None;
        let result = self.tick();
        self.outlived = self.tree.keys().copied().filter(|&p| p != root).collect();
        result
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
        let since_pss_ms = self.last_pss.map(|l| l.elapsed().as_secs_f64() * 1000.0).unwrap_or(f64::INFINITY);
        let timer_due = Self::due(self.last_pss, self.pss_every_ms);
        let pss_due = timer_due
            || pss_due_for_growth(self.rss_at_last_pss, self.latest_rss_bytes, since_pss_ms)
            || pss_due_for_tree_change(self.tree_len_at_last_pss, self.tree.len(), since_pss_ms, self.pss_every_ms);
        let mut slowest_walk_ms = 0.0f64;
        let gpu_readings: Vec<GpuReading> = self.gpu.as_ref().map(|g| g.read()).unwrap_or_default();
        if !gpu_readings.is_empty() {
            let tree = &self.tree;
            self.writer.saw_gpu_processes(|| {
                let mut out = Vec::new();
                for r in &gpu_readings {
                    for (&pid, &used_bytes) in r.process_bytes.iter().filter(|(p, _)| tree.contains_key(p)) {
                        out.push(GpuProcessBytes { device: r.index, pid, used_bytes });
                    }
                }
                out
            });
        }

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
            } else if let Some((rss, _)) = Self::read_rss_and_peak(&mut self.hwm_bytes, pid).filter(|r| r.0 > 0) {
                rss_total += rss;
                alive += 1;
            }
            if pss_due {
                // smaps_rollup has no high-water mark; one more small read.
                if let Some(hwm) = procfs::peak_rss_bytes(pid) {
                    let e = self.hwm_bytes.entry(pid).or_insert(0);
                    *e = (*e).max(hwm);
                }
            }
        }
        if pss_due {
            self.last_pss = Some(Instant::now());
            self.rss_at_last_pss = rss_total;
            self.tree_len_at_last_pss = self.tree.len();
            if timer_due {
                self.pss_every_ms = pss_interval_for(self.config.pss_interval_ms, slowest_walk_ms);
                self.store_hwm(t_ns);
                self.store_gpu_processes(t_ns);
            }
        }
        if alive > 0 {
            let sample = CpuSample {
                t_ns,
                rss_bytes: rss_total,
                pss_bytes: pss_due.then_some(pss_total),
                uss_bytes: pss_due.then_some(uss_total),
                process_count: alive,
            };
            self.latest_rss_bytes = rss_total;
            self.writer.push(Record::Cpu(sample));
            for s in per_pid {
                self.writer.push(Record::Process(s));
            }
        }
        self.observe_gpu_processes(&gpu_readings, t_ns);
        let pids: Vec<u32> = self.tree.keys().copied().collect();
        for r in &gpu_readings {
            let sample = GpuSample {
                t_ns,
                device: r.index,
                used_bytes: r.used_bytes,
                total_bytes: r.total_bytes,
                process_bytes: tree_bytes(r, pids.iter().copied()),
            };
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
            self.push_aggregates();
            self.writer.flush(t_ns)?;
            self.last_flush = Instant::now();
        }
        Ok(())
    }

    /// The program's tree: the program and its descendants, plus the orphans the kernel handed to us (its
    /// processes whose parent ended) and theirs. Adopted orphans that ended are reaped here, with their
    /// end time and peak RSS.
    fn refresh_tree(&mut self, t_ns: u64) {
        let me = std::process::id();
        let mut tree = procfs::process_tree(self.root_pid);
        for pid in procfs::children_of(me) {
            if pid == self.root_pid || self.not_the_programs.contains(&pid) {
                continue;
            }
            // An orphan of the tree: reap it if it ended (it is ours to reap now).
            if let Ok(Some(r)) = try_reap(pid) {
                let e = self.hwm_bytes.entry(pid).or_insert(0);
                *e = (*e).max(r.max_rss_bytes);
                continue;
            }
            for (p, pp) in procfs::process_tree(pid) {
                tree.entry(p).or_insert(pp);
            }
        }
        for pid in self.tree.keys().filter(|p| !tree.contains_key(p)) {
            self.writer.saw_exit(*pid);
        }
        self.tree = tree;
        self.last_tree = Some(Instant::now());
        for (&pid, &ppid) in &self.tree {
            let first = self.known.insert(pid);
            let (cmdline, first_t_ns) = if first {
                // Its real start: a process seen first by this refresh may have started up to an interval ago.
                let started = procfs::start_monotonic_ns(pid).map(|s| self.rel(s).min(t_ns)).unwrap_or(t_ns);
                (procfs::cmdline(pid), started)
            } else {
                (String::new(), t_ns)
            };
            let info = ProcessInfo { pid, ppid, cmdline, first_t_ns, last_t_ns: t_ns };
            if pid == self.root_pid && first {
                self.seen_root = Some(info.clone());
            }
            self.writer.push(Record::ProcessSeen(info));
        }
    }

    /// The folded spans' rows that changed, with their totals so far, into the next commit.
    fn push_aggregates(&mut self) {
        for row in self.folder.take_dirty() {
            self.writer.push(Record::Aggregate(row));
        }
        for row in self.folder.take_dirty_breakdowns() {
            self.writer.push(Record::BreakdownAggregate(row));
        }
    }

    /// Moves every message the profiled processes sent so far into the profile.
    pub fn drain_messages(&mut self) {
        loop {
            let incoming = match self.events.as_ref().map(|l| l.messages.try_recv()) {
                Some(Ok(incoming)) => incoming,
                Some(Err(TryRecvError::Disconnected)) => {
                    self.events = None;
                    break;
                }
                _ => break,
            };
            match incoming.message {
                Some(msg) => self.store_message(incoming.origin, msg),
                None => self.bad_messages += 1,
            }
        }
    }

    fn store_message(&mut self, origin: Origin, msg: ChildMessage) {
        let record = match msg {
            // Who each process is, even one that sends nothing else (the rank view's identity).
            ChildMessage::Hello { origin: o, launch } => {
                let t_ns = self.rel(torchmem_core::clock::monotonic_ns());
                // Its node and attempt (torchrun's GROUP_RANK, TORCHELASTIC_RESTART_COUNT), when launched so.
                let blob = Blob::Identity(Identity { origin: o, launch, t_ns });
                Record::Blob { t_ns, origin: Origin::default(), blob }
            }
            ChildMessage::Torch { t_ns, device, counters: c } => {
                let sample = c.torch_sample(self.rel(t_ns), device, origin);
                // An unchanged reading adds nothing to a step-function timeline: keep one a second.
                if let Some(prev) = self.last_torch.get(&(origin.pid, device)) {
                    let same = TorchSample { t_ns: prev.t_ns, ..sample.clone() } == *prev;
                    if same && sample.t_ns.saturating_sub(prev.t_ns) < HEARTBEAT_NS {
                        return;
                    }
                }
                self.last_torch.insert((origin.pid, device), sample.clone());
                Record::Torch(sample)
            }
            ChildMessage::Marker {
                t_ns,
                kind,
                edge,
                name,
                index,
                memory,
                device,
                breakdown,
                activations_by_module,
            } => {
                let t_ns = self.rel(t_ns);
                let marker =
                    Marker { t_ns, kind, edge, name, index, memory, origin, device, breakdown, activations_by_module };
                self.writer.saw_marker(&marker);
                match self.folder.push(marker) {
                    Some(kept) => Record::Marker(kept),
                    None => return,
                }
            }
            ChildMessage::LineProfile { t_ns, data } => {
                Record::LineProfile { t_ns: self.rel(t_ns), origin, profile: data }
            }
            ChildMessage::Blob { t_ns, name, data } => {
                Record::Blob { t_ns: self.rel(t_ns), origin, blob: Blob::from_parts(name, data) }
            }
        };
        self.writer.push(record);
    }

    /// Waits (up to `timeout`) for the profiled processes to close their connections, storing what they
    /// still send.
    pub fn drain_until_closed(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.events.as_ref().is_some_and(|l| l.open_connections() > 0) && Instant::now() < deadline {
            self.drain_messages();
            std::thread::sleep(Duration::from_millis(5));
        }
        self.drain_messages();
    }

    /// RSS and `VmHWM` of one process (one read of its status file); folds the high-water mark in.
    fn read_rss_and_peak(hwm_bytes: &mut BTreeMap<u32, u64>, pid: u32) -> Option<(u64, Option<u64>)> {
        let r = procfs::rss_and_peak_bytes(pid).or_else(|| Some((procfs::rss_bytes(pid)?, None)))?;
        if let Some(hwm) = r.1 {
            let e = hwm_bytes.entry(pid).or_insert(0);
            *e = (*e).max(hwm);
        }
        Some(r)
    }

    /// Stores the high-water marks as the `vmhwm` blob (`record::Vmhwm`) when they rose.
    fn store_hwm(&mut self, t_ns: u64) {
        if self.hwm_bytes == self.hwm_stored || self.hwm_bytes.is_empty() {
            return;
        }
        let blob = Blob::Vmhwm(Vmhwm { pids: self.hwm_bytes.clone() });
        self.writer.push(Record::Blob { t_ns, origin: Origin::default(), blob });
        self.hwm_stored = self.hwm_bytes.clone();
    }

    /// Folds this tick's NVML per-process readings of the tree's processes into `gpu_processes`.
    fn observe_gpu_processes(&mut self, readings: &[GpuReading], t_ns: u64) {
        if readings.is_empty() {
            return;
        }
        if self.gpu_processes.devices.is_empty() {
            if let Some(g) = &self.gpu {
                self.gpu_processes.devices = g
                    .devices()
                    .iter()
                    .map(|d| GpuIdentity { index: d.index, uuid: d.uuid.clone(), name: d.name.clone() })
                    .collect();
            }
        }
        for r in readings {
            for (&pid, &bytes) in r.process_bytes.iter().filter(|(p, _)| self.tree.contains_key(p)) {
                self.gpu_processes_dirty |= self.gpu_processes.observe(pid, r.index, bytes, t_ns);
            }
        }
    }

    /// Stores `gpu_processes` as its blob when a process appeared on a GPU or its peak there rose.
    fn store_gpu_processes(&mut self, t_ns: u64) {
        if !self.gpu_processes_dirty {
            return;
        }
        let blob = Blob::GpuProcesses(self.gpu_processes.clone());
        self.writer.push(Record::Blob { t_ns, origin: Origin::default(), blob });
        self.gpu_processes_dirty = false;
    }

    /// Why the profile stopped being written, and the samples lost so far; None while all is written.
    pub fn write_failure(&self) -> Option<&WriteFailure> {
        self.writer.write_failure()
    }

    /// Ends the profile; the run lasted until the program ended (`program_ended`), else until now.
    pub fn finish(mut self, end: impl FnOnce(&mut RunMeta)) -> torchmem_core::Result<Profile> {
        let t_end = self.end_t_ns.unwrap_or_else(|| self.rel(torchmem_core::clock::monotonic_ns()));
        self.store_hwm(t_end);
        self.store_gpu_processes(t_end);
        if !self.outlived.is_empty() {
            let pids: Vec<u32> = self.outlived.iter().copied().collect();
            let blob = Blob::Outlived(Outlived { t_ns: t_end, pids });
            self.writer.push(Record::Blob { t_ns: t_end, origin: Origin::default(), blob });
        }
        self.drain_messages();
        self.folder.finish();
        self.push_aggregates();
        let duration = self.end_t_ns.unwrap_or_else(|| self.rel(torchmem_core::clock::monotonic_ns()));
        self.writer.finish_with(end, duration)
    }
}

#[cfg(test)]
mod tests {
    use super::pss_interval_for;

    #[test]
    fn pss_is_read_out_of_turn_when_rss_grew_half_again() {
        use super::pss_due_for_growth;
        assert!(!pss_due_for_growth(0, 100 << 20, 1000.0), "no read yet: the timer takes the first");
        assert!(!pss_due_for_growth(200 << 10, 250 << 10, 30.0));
        assert!(pss_due_for_growth(200 << 10, 300 << 10, 30.0));
        assert!(!pss_due_for_growth(200 << 10, 87 << 20, 5.0), "at least 20 ms apart");
    }

    #[test]
    fn pss_is_read_out_of_turn_when_the_tree_changed_but_not_too_often() {
        use super::pss_due_for_tree_change;
        assert!(pss_due_for_tree_change(1, 3, 30.0, 250.0));
        assert!(!pss_due_for_tree_change(3, 3, 3000.0, 250.0));
        assert!(!pss_due_for_tree_change(1, 3, 300.0, 3500.0), "a tenth of a stretched interval apart");
        assert!(pss_due_for_tree_change(1, 3, 400.0, 3500.0));
    }

    #[test]
    fn pss_reads_back_off_to_one_percent_of_the_time() {
        assert_eq!(pss_interval_for(250.0, 0.3), 250.0);
        assert_eq!(pss_interval_for(250.0, 12.0), 1200.0);
        assert_eq!(pss_interval_for(1000.0, 5.0), 1000.0);
    }
}
