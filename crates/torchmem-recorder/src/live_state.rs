//! A run's one live state, no terminal here:
//!
//! - `LiveState` folds the recorder's record batches (or a finished profile's records, `replay_profile`) into
//!   a `LiveSnapshot`: the latest readings of one run (tree, processes, PyTorch's allocator per process and
//!   device, the open phase, step and epoch), its peaks and a short history for the sparklines. The snapshot
//!   is what a recorder publishes in its state file (`sinks::live`) and what `run --live` draws.
//! - `LiveHandle` is the one `LiveState` of a run, shared: `sinks::Sinks::flush` folds each batch into it
//!   once (`LiveHandle::fold`), and every live view renders from it (the state file, `run --live`, the
//!   status line, the Prometheus gauges); none keeps a fold of its own.
//!
//! A value never measured stays `None` (no CUDA: no allocator numbers, never 0).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};
use torchmem_core::model::{opt_max, Edge, MarkerKind, Origin, Profile};
use torchmem_core::record::Blob;
use torchmem_core::store::Record;

use crate::sinks::{RecordBatch, RunContext};

/// The state file's format name; a reader skips files of another format.
pub const FORMAT: &str = "torchmem-live/1";
/// One history point per this much run time.
pub const HISTORY_INTERVAL_MS: u64 = 500;
/// History points kept (two minutes at `HISTORY_INTERVAL_MS`).
pub const HISTORY_POINTS: usize = 240;

/// A PSS or USS read at an earlier sample (they are read every --pss-interval, RSS every --interval), kept
/// next to a newer RSS only while it does not exceed it: at one moment PSS <= RSS always, so a larger carried
/// value only says the memory fell since; it is dropped (shown `-`) until the next reading pairs them again.
fn carried(earlier: Option<u64>, rss_now_bytes: u64) -> Option<u64> {
    earlier.filter(|&b| b <= rss_now_bytes)
}

/// The whole profiled tree, now and at its peak.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TreeMemory {
    pub rss_bytes: Option<u64>,
    pub pss_bytes: Option<u64>,
    pub uss_bytes: Option<u64>,
    pub process_count: u32,
    pub peak_rss_bytes: Option<u64>,
    pub peak_pss_bytes: Option<u64>,
    /// PyTorch's allocator summed over the tree's processes and devices (None: no allocator reading).
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    /// The highest of the summed readings and of any one process's own peak counter.
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
}

/// One GPU as the recorder's last NVML reading saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuNow {
    pub index: u32,
    pub name: String,
    pub used_bytes: u64,
    pub total_bytes: u64,
    /// NVML's per-process bytes summed over the profiled tree.
    pub tree_bytes: Option<u64>,
}

/// PyTorch's caching allocator of one process on one device.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TorchNow {
    pub device: u32,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
}

/// One process of the profiled tree.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessNow {
    pub pid: u32,
    pub ppid: u32,
    pub command: String,
    pub rss_bytes: Option<u64>,
    pub pss_bytes: Option<u64>,
    pub uss_bytes: Option<u64>,
    /// NVML's used bytes for this pid, summed over devices.
    pub gpu_bytes: Option<u64>,
    pub torch: Vec<TorchNow>,
    /// The innermost phase open now.
    pub phase: Option<String>,
    /// The last step and epoch started.
    pub step: Option<i64>,
    pub epoch: Option<i64>,
    pub rank: Option<u32>,
}

impl ProcessNow {
    pub fn allocated_bytes(&self) -> Option<u64> {
        (!self.torch.is_empty()).then(|| self.torch.iter().map(|t| t.allocated_bytes).sum())
    }
    pub fn reserved_bytes(&self) -> Option<u64> {
        (!self.torch.is_empty()).then(|| self.torch.iter().map(|t| t.reserved_bytes).sum())
    }
    pub fn peak_allocated_bytes(&self) -> Option<u64> {
        self.torch.iter().map(|t| t.peak_allocated_bytes).max()
    }
}

/// The sparklines' data: one point per `interval_ms` of run time, oldest first, at most `HISTORY_POINTS`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    pub interval_ms: u64,
    pub rss_bytes: Vec<u64>,
    /// Empty while no allocator reading came.
    pub allocated_bytes: Vec<u64>,
    pub reserved_bytes: Vec<u64>,
}

/// One run's latest state: the content of a recorder's state file.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LiveSnapshot {
    pub format: String,
    /// The `torchmem run` process (the state file is `<recorder_pid>.json`).
    pub recorder_pid: u32,
    /// Its start time in clock ticks since boot (/proc/PID/stat field 22): tells a reused pid apart.
    pub recorder_start_ticks: Option<u64>,
    /// The program torchmem started.
    pub program_pid: Option<u32>,
    pub hostname: String,
    pub command: Vec<String>,
    /// The profile being written.
    pub profile: Option<String>,
    pub started_unix_s: f64,
    /// When the recorder wrote this state.
    pub updated_unix_s: f64,
    pub elapsed_s: f64,
    /// The run has ended (a replayed profile, or the recorder's last word).
    pub finished: bool,
    pub exit_code: Option<i32>,
    pub tree: TreeMemory,
    pub gpus: Vec<GpuNow>,
    /// Why `gpus` is empty (no NVML, `--no-gpu`).
    #[serde(default)]
    pub gpu_note: Option<String>,
    pub processes: Vec<ProcessNow>,
    pub history: History,
}

impl LiveSnapshot {
    /// The command as one line.
    pub fn command_line(&self) -> String {
        self.command.join(" ")
    }

    /// The program's process, else the first one.
    pub fn main_process(&self) -> Option<&ProcessNow> {
        self.processes.iter().find(|p| Some(p.pid) == self.program_pid).or_else(|| self.processes.first())
    }
}

/// One process's spans as its markers opened them (markers without a pid: key None).
#[derive(Debug, Clone, Default)]
pub(crate) struct Spans {
    pub(crate) step: Option<i64>,
    steps_started: i64,
    pub(crate) epoch: Option<i64>,
    epochs_started: i64,
    /// Open phases, innermost last.
    pub(crate) phases_open: Vec<String>,
    /// Every phase name seen (the metrics' 0/1 phase gauges).
    pub(crate) phases_seen: BTreeSet<String>,
    /// The last boundary's breakdown (`Marker::breakdown`), per device.
    pub(crate) breakdown: Vec<torchmem_core::model::DeviceBreakdown>,
}

/// Folds record batches into a run's latest state: the one fold behind every live output (`top`'s state
/// file and `run --live` through `sinks::live`, the status line, the Prometheus sink's gauges). A
/// `LiveSnapshot` is its serialisable view. A recorder holds one, in a `LiveHandle`.
#[derive(Debug, Default, Clone)]
pub struct LiveState {
    pub(crate) base: LiveSnapshot,
    device_names: BTreeMap<u32, String>,
    /// NVML's UUID of each device (the metrics' `UUID` label, to join DCGM's series).
    pub(crate) device_uuids: BTreeMap<u32, String>,
    pub(crate) processes: BTreeMap<u32, ProcessNow>,
    /// Each process's pid, rank, local rank and world size, from its hello, samples and markers.
    pub(crate) identity: BTreeMap<u32, Origin>,
    /// PyTorch's allocator per (pid, device); the peaks are the highest since the start.
    pub(crate) torch: BTreeMap<(Option<u32>, u32), TorchNow>,
    pub(crate) spans: BTreeMap<Option<u32>, Spans>,
    pub(crate) gpus: BTreeMap<u32, GpuNow>,
    /// NVML's per-process bytes per (device, pid), as the last tick read them.
    pub(crate) gpu_process: BTreeMap<(u32, u32), u64>,
    next_history_ns: u64,
    t_ns: u64,
    /// Batches folded in (`apply`): one per recorder flush, whatever the number of views.
    folds: u64,
}

fn push_point(v: &mut Vec<u64>, x: u64) {
    if v.len() == HISTORY_POINTS {
        v.remove(0);
    }
    v.push(x);
}

impl LiveState {
    pub fn new(ctx: &RunContext, recorder_pid: u32, program_pid: Option<u32>, profile: Option<String>) -> Self {
        let mut st = Self::blank(&ctx.hostname, &ctx.command, ctx.started_unix_s, recorder_pid, program_pid, profile);
        st.device_names = ctx.devices.iter().map(|d| (d.index, d.name.clone())).collect();
        st.device_uuids = ctx.devices.iter().map(|d| (d.index, d.uuid.clone())).collect();
        st
    }

    fn blank(
        hostname: &str,
        command: &[String],
        started_unix_s: f64,
        recorder_pid: u32,
        program_pid: Option<u32>,
        profile: Option<String>,
    ) -> Self {
        LiveState {
            base: LiveSnapshot {
                format: FORMAT.into(),
                recorder_pid,
                program_pid,
                hostname: hostname.to_string(),
                command: command.to_vec(),
                profile,
                started_unix_s,
                history: History { interval_ms: HISTORY_INTERVAL_MS, ..Default::default() },
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// Sets the recorder's start ticks (read from /proc by the sink).
    pub fn set_recorder_start_ticks(&mut self, ticks: Option<u64>) {
        self.base.recorder_start_ticks = ticks;
    }

    fn apply_record(&mut self, r: &Record) {
        match r {
            Record::Cpu(s) => {
                let t = &mut self.base.tree;
                t.rss_bytes = Some(s.rss_bytes);
                t.process_count = s.process_count;
                t.peak_rss_bytes = opt_max(t.peak_rss_bytes, Some(s.rss_bytes));
                if s.pss_bytes.is_some() {
                    t.pss_bytes = s.pss_bytes;
                    t.peak_pss_bytes = opt_max(t.peak_pss_bytes, s.pss_bytes);
                } else {
                    t.pss_bytes = carried(t.pss_bytes, s.rss_bytes);
                }
                t.uss_bytes = s.uss_bytes.or(carried(t.uss_bytes, s.rss_bytes));
            }
            Record::ProcessSeen(p) => {
                let e = self.processes.entry(p.pid).or_default();
                e.pid = p.pid;
                e.ppid = p.ppid;
                if !p.cmdline.is_empty() {
                    e.command = p.cmdline.clone();
                }
            }
            Record::Process(s) => {
                let e = self.processes.entry(s.pid).or_default();
                e.pid = s.pid;
                e.rss_bytes = Some(s.rss_bytes);
                e.pss_bytes = s.pss_bytes.or(carried(e.pss_bytes, s.rss_bytes));
                e.uss_bytes = s.uss_bytes.or(carried(e.uss_bytes, s.rss_bytes));
                e.gpu_bytes = s.gpu_bytes.or(e.gpu_bytes);
            }
            Record::Gpu(g) => {
                let name = self.device_names.get(&g.device).cloned().unwrap_or_default();
                self.gpus.insert(
                    g.device,
                    GpuNow {
                        index: g.device,
                        name,
                        used_bytes: g.used_bytes,
                        total_bytes: g.total_bytes,
                        tree_bytes: g.process_bytes,
                    },
                );
            }
            // A process's hello: its rank from its first series on, not from its first marker.
            Record::Blob { blob: Blob::Identity(i), .. } => {
                if let Some(pid) = i.origin.pid {
                    self.identity.insert(pid, i.origin);
                }
            }
            Record::Torch(t) => {
                if let Some(pid) = t.origin.pid {
                    self.identity.insert(pid, t.origin);
                }
                // A sample's peak is the allocator's since torchmem's last window reset (the ledger folds
                // what a reset took into the next sample): the peak since the start is the highest of them,
                // as the profile's peak is.
                let before = self.torch.get(&(t.origin.pid, t.device));
                let (peak_alloc, peak_res) = before.map_or((0, 0), |b| (b.peak_allocated_bytes, b.peak_reserved_bytes));
                self.torch.insert(
                    (t.origin.pid, t.device),
                    TorchNow {
                        device: t.device,
                        allocated_bytes: t.allocated_bytes,
                        reserved_bytes: t.reserved_bytes,
                        peak_allocated_bytes: t.peak_allocated_bytes.max(peak_alloc),
                        peak_reserved_bytes: t.peak_reserved_bytes.max(peak_res),
                    },
                );
                let tree = &mut self.base.tree;
                let alloc: u64 = self.torch.values().map(|t| t.allocated_bytes).sum();
                let reserved: u64 = self.torch.values().map(|t| t.reserved_bytes).sum();
                tree.allocated_bytes = Some(alloc);
                tree.reserved_bytes = Some(reserved);
                tree.peak_allocated_bytes = opt_max(tree.peak_allocated_bytes, Some(alloc.max(t.peak_allocated_bytes)));
                tree.peak_reserved_bytes = opt_max(tree.peak_reserved_bytes, Some(reserved.max(t.peak_reserved_bytes)));
            }
            Record::Marker(m) => self.apply_marker(m),
            _ => {}
        }
    }

    fn apply_marker(&mut self, m: &torchmem_core::model::Marker) {
        if let Some(pid) = m.origin.pid {
            self.identity.insert(pid, m.origin);
        }
        let s = self.spans.entry(m.origin.pid).or_default();
        if let Some(b) = m.breakdown.as_ref().filter(|b| !b.is_empty()) {
            s.breakdown = b.clone();
        }
        match (m.kind, m.edge) {
            (MarkerKind::Step, Edge::Start) => {
                s.step = Some(m.index.unwrap_or(s.steps_started));
                s.steps_started += 1;
            }
            (MarkerKind::Epoch, Edge::Start) => {
                s.epoch = Some(m.index.unwrap_or(s.epochs_started));
                s.epochs_started += 1;
            }
            (MarkerKind::Phase, Edge::Start) => {
                s.phases_open.push(m.name.clone());
                s.phases_seen.insert(m.name.clone());
            }
            (MarkerKind::Phase, Edge::End) => {
                if let Some(i) = s.phases_open.iter().rposition(|p| *p == m.name) {
                    s.phases_open.truncate(i);
                }
            }
            _ => {}
        }
    }

    /// Folds one batch in. Markers come from `batch.markers` (every marker, before folding); a kept
    /// `Record::Marker` in `records` is the same marker again and is skipped.
    pub fn apply(&mut self, batch: &RecordBatch) {
        self.folds += 1;
        for r in &batch.records {
            if !matches!(r, Record::Marker(_)) {
                self.apply_record(r);
            }
        }
        for m in &batch.markers {
            self.apply_marker(m);
        }
        if !batch.gpu_processes.is_empty() {
            self.gpu_process = batch.gpu_processes.iter().map(|g| ((g.device, g.pid), g.used_bytes)).collect();
        }
        for pid in &batch.exited_pids {
            self.exit(*pid);
        }
        self.advance(batch.t_ns);
    }

    fn exit(&mut self, pid: u32) {
        self.processes.remove(&pid);
        self.identity.remove(&pid);
        self.torch.retain(|(p, _), _| *p != Some(pid));
        self.gpu_process.retain(|(_, p), _| *p != pid);
        self.spans.remove(&Some(pid));
        let tree = &mut self.base.tree;
        if self.torch.is_empty() {
            tree.allocated_bytes = None;
            tree.reserved_bytes = None;
        } else {
            tree.allocated_bytes = Some(self.torch.values().map(|t| t.allocated_bytes).sum());
            tree.reserved_bytes = Some(self.torch.values().map(|t| t.reserved_bytes).sum());
        }
    }

    /// Moves the clock to `t_ns` (since the run's start), adding a history point when one is due.
    pub fn advance(&mut self, t_ns: u64) {
        self.t_ns = self.t_ns.max(t_ns);
        if self.t_ns < self.next_history_ns {
            return;
        }
        self.next_history_ns = self.t_ns + HISTORY_INTERVAL_MS * 1_000_000;
        let tree = &self.base.tree;
        let h = &mut self.base.history;
        if let Some(rss) = tree.rss_bytes {
            push_point(&mut h.rss_bytes, rss);
        }
        if let (Some(a), Some(r)) = (tree.allocated_bytes, tree.reserved_bytes) {
            push_point(&mut h.allocated_bytes, a);
            push_point(&mut h.reserved_bytes, r);
        }
    }

    /// Says why there are no GPU readings.
    pub fn set_gpu_note(&mut self, note: Option<String>) {
        self.base.gpu_note = note;
    }

    /// The run ended and its per-process series with it (a metrics textfile left behind must not show a
    /// finished job's memory as current): every process, allocator and span reading goes, and the tree's;
    /// the devices' NVML readings stay.
    pub fn end_of_run(&mut self) {
        let pids: Vec<u32> = self.processes.keys().chain(self.identity.keys()).copied().collect();
        for pid in pids {
            self.exit(pid);
        }
        self.torch.clear();
        self.spans.clear();
        let tree = &mut self.base.tree;
        tree.rss_bytes = None;
        tree.pss_bytes = None;
        tree.uss_bytes = None;
        tree.allocated_bytes = None;
        tree.reserved_bytes = None;
    }

    /// The batches folded in so far.
    pub fn folds(&self) -> u64 {
        self.folds
    }

    /// The run ended.
    pub fn finish(&mut self, exit_code: Option<i32>) {
        self.base.finished = true;
        self.base.exit_code = exit_code;
    }

    /// The state now, stamped `updated_unix_s`.
    pub fn snapshot(&self, updated_unix_s: f64) -> LiveSnapshot {
        let mut snap = self.base.clone();
        snap.updated_unix_s = updated_unix_s;
        snap.elapsed_s = self.t_ns as f64 / 1e9;
        snap.gpus = self.gpus.values().cloned().collect();
        let orphan_spans = self.spans.get(&None);
        snap.processes = self
            .processes
            .values()
            .map(|p| {
                let mut p = p.clone();
                p.torch =
                    self.torch.iter().filter(|((pid, _), _)| *pid == Some(p.pid)).map(|(_, t)| t.clone()).collect();
                let gpu: Vec<u64> =
                    self.gpu_process.iter().filter(|((_, pid), _)| *pid == p.pid).map(|(_, b)| *b).collect();
                if !gpu.is_empty() {
                    p.gpu_bytes = Some(gpu.iter().sum());
                }
                // Markers without a pid (an old client) belong to the program itself.
                let spans = self.spans.get(&Some(p.pid)).or(orphan_spans.filter(|_| Some(p.pid) == snap.program_pid));
                if let Some(s) = spans {
                    p.phase = s.phases_open.last().cloned();
                    p.step = s.step;
                    p.epoch = s.epoch;
                }
                p.rank = self.identity.get(&p.pid).and_then(|o| o.rank);
                p
            })
            .collect();
        snap
    }
}

/// The one live state of a run, shared between the recorder (which folds each batch into it once, from
/// `sinks::Sinks::flush`) and every view of it: the state file (`sinks::live::LiveSink`), the Prometheus
/// sink and its HTTP thread, `run --live` and `run --status`. Cloning it shares the same state.
#[derive(Debug, Clone, Default)]
pub struct LiveHandle(Arc<RwLock<LiveState>>);

impl LiveHandle {
    pub fn new(state: LiveState) -> Self {
        LiveHandle(Arc::new(RwLock::new(state)))
    }

    /// The live state of a run this process records (its pid and start time tell a reused pid apart).
    pub fn for_run(ctx: &RunContext) -> Self {
        let me = std::process::id();
        let mut state = LiveState::new(ctx, me, None, None);
        state.set_recorder_start_ticks(crate::sinks::live::start_ticks(me));
        Self::new(state)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, LiveState> {
        self.0.write().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the state (a view renders from it; keep it short, the recorder waits).
    pub fn read<R>(&self, f: impl FnOnce(&LiveState) -> R) -> R {
        f(&self.0.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The program torchmem started and the profile it writes (shown by `top` and `run --live`).
    pub fn set_program(&self, program_pid: u32, profile: &Path) {
        let profile = std::fs::canonicalize(profile).unwrap_or_else(|_| profile.to_path_buf());
        let mut st = self.write();
        st.base.program_pid = Some(program_pid);
        st.base.profile = Some(profile.display().to_string());
    }

    /// Says why the run has no GPU readings (shown by `run --live`).
    pub fn set_gpu_note(&self, note: Option<String>) {
        self.write().set_gpu_note(note);
    }

    /// Folds one batch in: the run's only fold (`sinks::Sinks` calls it once per batch, before any sink).
    pub fn fold(&self, batch: &RecordBatch) {
        self.write().apply(batch);
    }

    /// The run ended.
    pub fn finish(&self, exit_code: Option<i32>) {
        self.write().finish(exit_code);
    }

    /// The state now, each process's RSS read fresh from /proc (`sinks::live::refresh_process_rss`).
    pub fn snapshot(&self) -> LiveSnapshot {
        let mut snap = self.read(|s| s.snapshot(torchmem_core::clock::unix_time_s()));
        crate::sinks::live::refresh_process_rss(&mut snap);
        snap
    }

    /// The batches folded in so far (tests: one per flush).
    pub fn folds(&self) -> u64 {
        self.read(LiveState::folds)
    }
}

/// A finished (or partly written) profile's last state, its history rebuilt from its samples: every record
/// in time order, folded as the recorder would have. The phase, step and epoch come from the kept markers
/// (a long loop's later steps are folded into totals, so the step shown is the last kept one).
pub fn replay_profile(profile: &Profile) -> LiveSnapshot {
    let meta = &profile.meta;
    let profile_path = Some(profile.path.display().to_string());
    let mut st = LiveState::blank(&meta.hostname, &meta.command, meta.started_unix_s, 0, None, profile_path);
    st.device_names = meta.gpu_names.iter().enumerate().map(|(i, name)| (i as u32, name.clone())).collect();
    let mut timed: Vec<(u64, Record)> = Vec::new();
    timed.extend(profile.processes.iter().map(|p| (p.first_t_ns, Record::ProcessSeen(p.clone()))));
    timed.extend(profile.cpu.iter().map(|s| (s.t_ns, Record::Cpu(s.clone()))));
    timed.extend(profile.process_samples.iter().map(|s| (s.t_ns, Record::Process(s.clone()))));
    timed.extend(profile.gpu.iter().map(|s| (s.t_ns, Record::Gpu(s.clone()))));
    timed.extend(profile.torch.iter().map(|s| (s.t_ns, Record::Torch(s.clone()))));
    timed.extend(profile.markers.iter().map(|m| (m.t_ns, Record::Marker(m.clone()))));
    timed.sort_by_key(|(t, _)| *t);
    for (t, r) in &timed {
        st.advance(*t);
        st.apply_record(r);
    }
    let end_ns = meta.duration_ns.or(timed.last().map(|(t, _)| *t)).unwrap_or(0);
    st.advance(end_ns);
    // The table's rows are the processes' last readings (taken at the PSS moments); the tree's line shows
    // the tree at that same moment, not a later RSS-only sample that no row adds up to.
    if let Some(full) = profile.cpu.iter().rev().find(|c| c.pss_bytes.is_some()) {
        let t = &mut st.base.tree;
        t.rss_bytes = Some(full.rss_bytes);
        t.pss_bytes = full.pss_bytes;
        t.uss_bytes = full.uss_bytes;
        t.process_count = full.process_count;
    }
    st.base.program_pid = profile.processes.iter().min_by_key(|p| p.first_t_ns).map(|p| p.pid);
    if meta.exit_code.is_some() || meta.duration_ns.is_some() {
        st.finish(meta.exit_code);
    }
    st.snapshot(meta.started_unix_s + end_ns as f64 / 1e9)
}

/// A fake run for unit tests of pure logic (here and in the live view): records built by hand.
#[doc(hidden)]
pub mod fixtures {
    use super::*;
    use torchmem_core::model::{CpuSample, Marker, ProcessInfo, ProcessSample, TorchSample};

    /// A marker as the Python API sends it (built from JSON so fields added later keep their defaults).
    pub fn marker(pid: u32, kind: &str, edge: &str, name: &str, index: Option<i64>) -> Marker {
        serde_json::from_value(serde_json::json!({
            "t_ns": 1, "kind": kind, "edge": edge, "name": name, "index": index, "memory": {},
            "origin": {"pid": pid}, "device": null
        }))
        .unwrap()
    }

    pub fn torch(pid: u32, alloc_mib: u64, peak_mib: u64) -> TorchSample {
        TorchSample {
            t_ns: 1,
            device: 0,
            allocated_bytes: alloc_mib << 20,
            reserved_bytes: (alloc_mib + 64) << 20,
            peak_allocated_bytes: peak_mib << 20,
            peak_reserved_bytes: (peak_mib + 64) << 20,
            active_bytes: 0,
            inactive_split_bytes: 0,
            origin: Origin { pid: Some(pid), rank: Some(0), ..Default::default() },
        }
    }

    pub fn process(pid: u32, cmd: &str, rss_mib: u64) -> Vec<Record> {
        vec![
            Record::ProcessSeen(ProcessInfo { pid, ppid: 1, cmdline: cmd.into(), first_t_ns: 0, last_t_ns: 0 }),
            Record::Process(ProcessSample {
                t_ns: 1,
                pid,
                rss_bytes: rss_mib << 20,
                pss_bytes: Some((rss_mib - 1) << 20),
                uss_bytes: None,
                gpu_bytes: None,
            }),
        ]
    }

    pub fn cpu(rss_mib: u64) -> Record {
        Record::Cpu(CpuSample { t_ns: 1, rss_bytes: rss_mib << 20, pss_bytes: None, uss_bytes: None, process_count: 2 })
    }

    /// A run of two processes: 4242 (the program, in phase backward of step 7, epoch 1) and 4243.
    pub fn two_process_run() -> LiveSnapshot {
        let ctx = RunContext {
            hostname: "h1".into(),
            command: vec!["train.py".into(), "--fast".into()],
            started_unix_s: 1000.0,
            ..Default::default()
        };
        let mut st = LiveState::new(&ctx, 4241, Some(4242), Some("/tmp/p.sqlite".into()));
        for (i, rss) in [100u64, 150, 300, 200].into_iter().enumerate() {
            let mut records = process(4242, "python train.py --fast", rss);
            records.extend(process(4243, "python -c worker", 50));
            records.push(cpu(rss + 50));
            records.push(Record::Torch(torch(4242, rss / 2, rss)));
            let markers = if i == 0 {
                vec![
                    marker(4242, "epoch", "start", "epoch", Some(1)),
                    marker(4242, "step", "start", "step", Some(7)),
                    marker(4242, "phase", "start", "forward", None),
                    marker(4242, "phase", "end", "forward", None),
                    marker(4242, "phase", "start", "backward", None),
                ]
            } else {
                vec![]
            };
            let batch = RecordBatch {
                records,
                markers,
                gpu_processes: vec![],
                exited_pids: vec![],
                t_ns: i as u64 * HISTORY_INTERVAL_MS * 1_000_000,
            };
            st.apply(&batch);
        }
        st.snapshot(1002.0)
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::*;
    use super::*;
    use crate::sinks::GpuProcessBytes;
    use torchmem_core::model::{CpuSample, ProcessInfo, ProcessSample};

    #[test]
    fn batches_fold_into_the_latest_state_with_peaks_and_history() {
        let s = two_process_run();
        assert_eq!(s.format, FORMAT);
        assert_eq!(s.tree.rss_bytes, Some(250 << 20));
        assert_eq!(s.tree.peak_rss_bytes, Some(350 << 20), "the highest tree RSS seen, not the last");
        assert_eq!(s.history.rss_bytes, vec![150 << 20, 200 << 20, 350 << 20, 250 << 20]);
        assert_eq!(s.history.allocated_bytes, vec![50 << 20, 75 << 20, 150 << 20, 100 << 20]);
        assert_eq!(s.tree.peak_allocated_bytes, Some(300 << 20), "torch's own peak counter counts");
        let main = s.main_process().unwrap();
        assert_eq!(main.pid, 4242);
        assert_eq!(main.phase.as_deref(), Some("backward"));
        assert_eq!((main.step, main.epoch, main.rank), (Some(7), Some(1), Some(0)));
        assert_eq!(main.allocated_bytes(), Some(100 << 20));
        let worker = s.processes.iter().find(|p| p.pid == 4243).unwrap();
        assert_eq!((worker.phase.as_ref(), worker.allocated_bytes(), worker.step), (None, None, None));
        assert!((s.elapsed_s - 1.5).abs() < 1e-9);
    }

    #[test]
    fn an_exited_process_leaves_and_nvml_per_process_bytes_attach() {
        let mut st = LiveState::new(&RunContext::default(), 1, Some(10), None);
        let mut records = process(10, "a", 20);
        records.extend(process(11, "b", 30));
        records.push(Record::Torch(torch(11, 5, 5)));
        st.apply(&RecordBatch {
            records,
            gpu_processes: vec![
                GpuProcessBytes { device: 0, pid: 10, used_bytes: 7 << 20 },
                GpuProcessBytes { device: 1, pid: 10, used_bytes: 1 << 20 },
            ],
            ..Default::default()
        });
        let s = st.snapshot(0.0);
        assert_eq!(s.processes.iter().find(|p| p.pid == 10).unwrap().gpu_bytes, Some(8 << 20));
        assert_eq!(s.tree.allocated_bytes, Some(5 << 20));
        st.apply(&RecordBatch { exited_pids: vec![11], ..Default::default() });
        let s = st.snapshot(0.0);
        assert_eq!(s.processes.iter().map(|p| p.pid).collect::<Vec<_>>(), vec![10]);
        assert_eq!(s.tree.allocated_bytes, None, "no allocator left: no number, never 0");
        assert_eq!(s.tree.peak_allocated_bytes, Some(5 << 20), "the peak stays");
    }

    #[test]
    fn pss_is_never_shown_above_an_rss_read_at_another_moment() {
        let ctx = RunContext::default();
        let mut st = LiveState::new(&ctx, 1, Some(7), None);
        let sample = |rss_mib: u64, pss_mib: Option<u64>| {
            let pss_bytes = pss_mib.map(|m| m << 20);
            RecordBatch {
                records: vec![
                    Record::Process(ProcessSample {
                        t_ns: 1,
                        pid: 7,
                        rss_bytes: rss_mib << 20,
                        pss_bytes,
                        uss_bytes: pss_bytes,
                        gpu_bytes: None,
                    }),
                    Record::Cpu(CpuSample {
                        t_ns: 1,
                        rss_bytes: rss_mib << 20,
                        pss_bytes,
                        uss_bytes: None,
                        process_count: 1,
                    }),
                ],
                ..Default::default()
            }
        };
        st.apply(&sample(995, Some(990)));
        let snap = st.snapshot(0.0);
        assert_eq!((snap.tree.pss_bytes, snap.processes[0].pss_bytes), (Some(990 << 20), Some(990 << 20)));
        // RSS grew, PSS not read this time: the earlier PSS still fits under it and is kept.
        st.apply(&sample(1000, None));
        assert_eq!(st.snapshot(0.0).processes[0].pss_bytes, Some(990 << 20));
        // RSS fell below the earlier PSS: that PSS is of another moment and would read PSS > RSS.
        st.apply(&sample(989, None));
        let snap = st.snapshot(0.0);
        assert_eq!((snap.tree.pss_bytes, snap.processes[0].pss_bytes, snap.processes[0].uss_bytes), (None, None, None));
        assert_eq!(snap.tree.peak_pss_bytes, Some(990 << 20), "the peak is a reading of its own moment");
        st.apply(&sample(989, Some(980)));
        assert_eq!(st.snapshot(0.0).processes[0].pss_bytes, Some(980 << 20));
    }

    #[test]
    fn a_replayed_profile_shows_the_tree_and_its_rows_at_one_moment() {
        let mib = |m: u64| m << 20;
        let cpu = |t_ns, rss, pss: Option<u64>| CpuSample {
            t_ns,
            rss_bytes: mib(rss),
            pss_bytes: pss.map(mib),
            uss_bytes: pss.map(mib),
            process_count: 1,
        };
        let profile = Profile {
            processes: vec![ProcessInfo {
                pid: 7,
                ppid: 1,
                cmdline: "python t.py".into(),
                first_t_ns: 1,
                last_t_ns: 3,
            }],
            // The last full reading (rows and tree) at t=2; an RSS-only tree sample after it at t=3.
            cpu: vec![cpu(1, 500, Some(490)), cpu(2, 785, Some(780)), cpu(3, 898, None)],
            process_samples: vec![ProcessSample {
                t_ns: 2,
                pid: 7,
                rss_bytes: mib(785),
                pss_bytes: Some(mib(780)),
                uss_bytes: Some(mib(770)),
                gpu_bytes: None,
            }],
            ..Default::default()
        };
        let snap = replay_profile(&profile);
        assert_eq!(snap.processes[0].rss_bytes, Some(mib(785)));
        assert_eq!((snap.tree.rss_bytes, snap.tree.pss_bytes), (Some(mib(785)), Some(mib(780))));
        assert_eq!(snap.tree.peak_rss_bytes, Some(mib(898)), "the peak still counts every sample");
    }

    #[test]
    fn history_keeps_the_last_points_only() {
        let mut st = LiveState::new(&RunContext::default(), 1, None, None);
        for i in 0..(HISTORY_POINTS as u64 + 10) {
            st.apply(&RecordBatch {
                records: vec![cpu(i + 1)],
                t_ns: i * HISTORY_INTERVAL_MS * 1_000_000,
                ..Default::default()
            });
        }
        let h = st.snapshot(0.0).history;
        assert_eq!(h.rss_bytes.len(), HISTORY_POINTS);
        assert_eq!(*h.rss_bytes.first().unwrap(), 11 << 20);
        assert!(h.allocated_bytes.is_empty(), "no allocator readings: no series");
    }
}
