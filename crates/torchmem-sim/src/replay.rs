//! The driver: replays one device's trace (alloc / free_requested / free_completed per stream, explicit
//! `empty_cache` calls, recorded OOMs) through the allocator model from the state at the trace's start, and,
//! under the recorded settings, checks the replay against the recording (segment events and peaks).

use std::collections::HashMap;

use serde::Serialize;
use torchmem_snapshot::model::{Action, FxBuild, Snapshot, StackId};

use crate::allocator::{Allocator, OomFailure, SegEvent, SegKind, Stats};
use crate::config::AllocConf;
use crate::device::Device;
use crate::pool::{Block, NONE};
use crate::start::{reconstruct, StartState};

/// `totalGlobalMem` assumed when neither the caller nor `--device-memory` gives one: an H200's 143,771 MiB.
/// It only sizes expandable segments' address space (9/8 of it) and turns a memory fraction into bytes.
pub const DEFAULT_TOTAL_GLOBAL_BYTES: u64 = 143_771 << 20;

/// What to simulate.
#[derive(Debug, Clone, Default)]
pub struct SimOptions {
    /// None: the settings the snapshot recorded.
    pub conf: Option<AllocConf>,
    /// A per-process cap in bytes (`set_per_process_memory_fraction(limit / total)`).
    pub memory_limit_bytes: Option<u64>,
    /// A fraction of `device_total_bytes`, converted as torch does (`size_t(fraction * total)`).
    pub memory_fraction: Option<f64>,
    /// The memory the allocator can get from the device (cudaMalloc fails past it).
    pub device_memory_bytes: Option<u64>,
    /// `totalGlobalMem` (default: `device_memory_bytes`, else an H200).
    pub device_total_bytes: Option<u64>,
    /// Keep the segment events and OOM details (off for the fast `--min-memory` search).
    pub detailed: bool,
    /// Complete every free at `free_requested` (how a replay through the real allocator frees).
    pub frees_at_request: bool,
    /// The memory limit / fraction given is the one the recording ran under (a snapshot does not record
    /// it): still check the replay against the recording.
    pub limits_as_recorded: bool,
    /// In a what-if, place new segments at the recording's addresses for that size when free.
    pub recorded_addresses: bool,
    /// Give the allocator the device memory it could have had at the recording's OOM
    /// (`recorded_oom_capacity_bytes`; overrides `device_memory_bytes` when the trace has one).
    pub device_memory_from_oom: bool,
    /// New segments' addresses from the driver model (`Device::driver_model`): for traces with no addresses of
    /// their own (the estimator's).
    pub driver_addresses: bool,
}

/// The first difference between the replay and the recording.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    /// Position in the sequence of segment events.
    pub event_index: usize,
    /// Trace entry (index in this device's trace) where it happened.
    pub entry: u32,
    pub expected: Option<SegEvent>,
    pub got: Option<SegEvent>,
    pub what: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Comparison {
    pub matches: bool,
    pub segment_events: usize,
    pub recorded_segment_events: usize,
    pub recorded_peak_reserved_bytes: u64,
    pub divergence: Option<Divergence>,
}

/// A live block at the OOM.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LiveBlock {
    pub addr: u64,
    pub size_bytes: u64,
    pub requested_bytes: u64,
    /// Trace entry that allocated it (None: before the trace).
    pub entry: Option<u32>,
    pub frame: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OomReport {
    /// Index in this device's trace of the allocation that failed.
    pub entry: u32,
    pub time_us: i64,
    /// The time of the device trace's first entry: `time_us - trace_start_us` is the time into the trace
    /// (`snapshot --top --at` counts from the same start).
    pub trace_start_us: i64,
    /// What the simulated allocator refused, and with what allocated and reserved.
    #[serde(flatten)]
    pub failure: OomFailure,
    /// Innermost first.
    pub frames: Vec<String>,
    pub live_blocks: usize,
    /// The largest live blocks.
    pub largest_live: Vec<LiveBlock>,
    /// The recording failed here too.
    pub recorded: bool,
}

/// One device's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeviceResult {
    pub device: i64,
    pub entries: usize,
    pub settings: String,
    pub recorded_settings: String,
    pub memory_limit_bytes: Option<u64>,
    pub device_memory_bytes: Option<u64>,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub peak_active_bytes: u64,
    pub peak_requested_bytes: u64,
    /// reserved − allocated right after the allocation that set the reserved peak.
    pub reserved_unallocated_at_peak_bytes: u64,
    pub num_cuda_malloc: u64,
    pub num_cuda_free: u64,
    pub num_map: u64,
    pub num_unmap: u64,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub stats: Stats,
    pub oom: Option<OomReport>,
    /// The recorded OOM entries that did not fail in the replay.
    pub recorded_ooms_avoided: Vec<u32>,
    pub comparison: Option<Comparison>,
    pub starts_empty: bool,
    pub start_reserved_bytes: u64,
    pub start_segments: usize,
    pub notes: Vec<String>,
}

/// One trace entry, as the simulator needs it (decoupled from the snapshot crate's packed form).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Entry {
    pub action: Action,
    pub addr: u64,
    pub size_bytes: u64,
    pub stream: i64,
    pub time_us: i64,
    pub stack: StackId,
    /// Free device bytes an `oom` entry reports.
    pub device_free_bytes: Option<u64>,
}

/// This device's trace entries.
pub fn entries_of(snap: &Snapshot, device: i64) -> Vec<Entry> {
    snap.device_traces
        .get(device as usize)
        .map(|v| {
            v.iter()
                .map(|e| Entry {
                    action: e.action(),
                    addr: e.addr,
                    size_bytes: e.size_bytes,
                    stream: snap.info(e).stream,
                    time_us: e.time_us,
                    stack: e.stack,
                    device_free_bytes: snap.info(e).device_free_bytes,
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A prepared device: its entries, stream ranks, start state and recorded events (reused across runs).
pub struct Prepared<'a> {
    pub snap: &'a Snapshot,
    pub device: i64,
    pub entries: Vec<Entry>,
    pub stream_rank: HashMap<i64, u16, FxBuild>,
    pub recorded_conf: AllocConf,
    pub recorded_conf_str: String,
    pub start: StartState,
    pub recorded_events: Vec<SegEvent>,
    /// Entries that begin an explicit `empty_cache()` (a run of segment frees no allocation caused).
    pub empty_cache_at: Vec<bool>,
    /// Per entry, the allocation it allocates or frees, as a slot number (`NONE`: none); the start state's
    /// live blocks take the first slots. Saves hashing addresses during every replay.
    pub slot: Vec<u32>,
    pub slots: usize,
    /// Frees of addresses that no allocation (in the trace or before it) holds.
    pub unknown_frees: usize,
    /// At the recording's first OOM: what the allocator held plus what the device still had free — the most
    /// memory the allocator could have had there (`--device-memory recorded`).
    pub recorded_oom_capacity_bytes: Option<u64>,
}

/// Devices with a trace or segments, in order.
pub fn devices(snap: &Snapshot) -> Vec<i64> {
    let mut d: Vec<i64> = (0..snap.device_traces.len() as i64)
        .filter(|&i| !snap.device_traces[i as usize].is_empty() || snap.segments.iter().any(|s| s.device == i))
        .collect();
    for s in &snap.segments {
        if !d.contains(&s.device) {
            d.push(s.device);
        }
    }
    d.sort_unstable();
    d
}

fn seg_kind(a: Action) -> Option<SegKind> {
    match a {
        Action::SegmentAlloc => Some(SegKind::SegmentAlloc),
        Action::SegmentFree => Some(SegKind::SegmentFree),
        Action::SegmentMap => Some(SegKind::SegmentMap),
        Action::SegmentUnmap => Some(SegKind::SegmentUnmap),
        _ => None,
    }
}

impl<'a> Prepared<'a> {
    pub fn new(snap: &'a Snapshot, device: i64) -> Result<Prepared<'a>, String> {
        if let Some(s) = snap.segments.iter().find(|s| s.device == device && s.pool_id != (0, 0)) {
            return Err(format!(
                "device {device}: segment at {:#x} belongs to private pool {:?} (CUDA graph capture or \
                 torch.cuda.MemPool); the trace does not say which allocations went to that pool, so the \
                 simulator cannot replay it. Simulate a recording made outside graph capture and MemPools",
                s.address, s.pool_id
            ));
        }
        let entries = entries_of(snap, device);
        let (recorded_conf, recorded_conf_str) = AllocConf::from_snapshot(&snap.allocator_settings);
        let mut streams: Vec<i64> = entries.iter().map(|e| e.stream).collect();
        streams.extend(snap.segments.iter().filter(|s| s.device == device).map(|s| s.stream));
        streams.sort_unstable_by_key(|&s| s as u64);
        streams.dedup();
        if streams.len() > u16::MAX as usize {
            return Err(format!("device {device}: {} streams; at most 65535 are supported", streams.len()));
        }
        let stream_rank = streams.iter().enumerate().map(|(i, &s)| (s, i as u16)).collect();
        let start = reconstruct(snap, device, &entries, &recorded_conf)?;
        // Explicit empty_cache: a run of segment frees/unmaps not followed by a new segment or an OOM.
        let n = entries.len();
        let mut empty_cache_at = vec![false; n];
        let mut owner = vec![n as u32; n];
        let mut i = 0;
        while i < n {
            if matches!(entries[i].action, Action::SegmentFree | Action::SegmentUnmap) {
                let start_run = i;
                let mut j = i;
                while j < n && matches!(entries[j].action, Action::SegmentFree | Action::SegmentUnmap) {
                    j += 1;
                }
                let mut k = j;
                while k < n && entries[k].action == Action::FreeCompleted {
                    k += 1;
                }
                let internal =
                    k < n && matches!(entries[k].action, Action::SegmentAlloc | Action::SegmentMap | Action::Oom);
                if !internal {
                    empty_cache_at[start_run] = true;
                    for o in owner.iter_mut().take(j).skip(start_run) {
                        *o = start_run as u32;
                    }
                }
                i = j;
            } else {
                i += 1;
            }
        }
        // Other segment events belong to the next allocation (or recorded OOM).
        let mut next_alloc = n as u32;
        for idx in (0..n).rev() {
            match entries[idx].action {
                Action::Alloc | Action::Oom => next_alloc = idx as u32,
                a if seg_kind(a).is_some() && owner[idx] == n as u32 => owner[idx] = next_alloc,
                _ => {}
            }
        }
        // Slots: the start's live blocks first (seed order), then one per allocation.
        let mut live: HashMap<u64, u32, FxBuild> = HashMap::default();
        let mut slots = 0u32;
        for b in start.blocks.iter().flatten() {
            live.insert(b.addr, slots);
            slots += 1;
        }
        let mut slot = vec![NONE; n];
        let mut unknown_frees = 0usize;
        for (k, e) in entries.iter().enumerate() {
            match e.action {
                Action::Alloc => {
                    live.insert(e.addr, slots);
                    slot[k] = slots;
                    slots += 1;
                }
                Action::FreeRequested => match live.get(&e.addr) {
                    Some(&s) => slot[k] = s,
                    None => unknown_frees += 1,
                },
                Action::FreeCompleted => {
                    if let Some(s) = live.remove(&e.addr) {
                        slot[k] = s;
                    }
                }
                _ => {}
            }
        }
        let mut recorded_oom_capacity_bytes = None;
        let mut reserved = start.reserved_bytes();
        for e in &entries {
            match e.action {
                Action::SegmentAlloc | Action::SegmentMap => reserved += e.size_bytes,
                Action::SegmentFree | Action::SegmentUnmap => reserved = reserved.saturating_sub(e.size_bytes),
                Action::Oom => {
                    if let Some(free) = e.device_free_bytes {
                        recorded_oom_capacity_bytes = Some(reserved + free);
                        break;
                    }
                }
                _ => {}
            }
        }
        let recorded_events = entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| {
                seg_kind(e.action).map(|kind| SegEvent {
                    kind,
                    addr: e.addr,
                    size_bytes: e.size_bytes,
                    entry: owner[i],
                })
            })
            .collect();
        Ok(Prepared {
            snap,
            device,
            entries,
            stream_rank,
            recorded_conf,
            recorded_conf_str,
            start,
            recorded_events,
            empty_cache_at,
            slot,
            slots: slots as usize,
            unknown_frees,
            recorded_oom_capacity_bytes,
        })
    }

    fn rank(&self, stream: i64) -> u16 {
        self.stream_rank.get(&stream).copied().unwrap_or(0)
    }

    /// Replays the trace under `opts`.
    pub fn run(&self, opts: &SimOptions) -> DeviceResult {
        let same_settings = opts.conf.as_ref().is_none_or(|c| *c == self.recorded_conf)
            // (`device_memory_from_oom` is the recording's own capacity: still comparable.)
            && ((opts.memory_limit_bytes.is_none()
                && opts.memory_fraction.is_none()
                && (opts.device_memory_bytes.is_none() || opts.device_memory_from_oom))
                || opts.limits_as_recorded);
        let conf = opts.conf.clone().unwrap_or_else(|| self.recorded_conf.clone());
        let total = opts.device_total_bytes.or(opts.device_memory_bytes).unwrap_or(DEFAULT_TOTAL_GLOBAL_BYTES);
        let fraction = opts.memory_fraction.or(conf.per_process_memory_fraction);
        let allowed = match (opts.memory_limit_bytes, fraction) {
            (Some(l), _) => Some(l),
            (None, Some(f)) => Some((f * total as f64) as u64),
            _ => None,
        };
        let device_memory = match (opts.device_memory_from_oom, self.recorded_oom_capacity_bytes) {
            (true, Some(c)) => Some(c),
            _ => opts.device_memory_bytes,
        };
        let mut a = Allocator::new(conf.clone(), allowed, Device::new(device_memory, total));
        a.keep_events = opts.detailed;
        a.device.driver_model = opts.driver_addresses;
        if opts.recorded_addresses {
            for ev in self.recorded_events.iter().filter(|e| e.kind == SegKind::SegmentAlloc) {
                a.device.recorded_by_size.entry(ev.size_bytes).or_default().push(ev.addr);
            }
        }
        // Under the recorded settings new segments take the recording's addresses (while the device calls are
        // the recording's). Not in a what-if: following the recording there, even up to the first different
        // call, matched the GPU less often (105 of 132 rows exact) than the synthetic addresses (111).
        if same_settings {
            a.hints = self.recorded_events.clone();
            a.follow_hints = true;
        }
        // Slot -> block id of the allocation (NONE once its free completed).
        let mut block_of = vec![NONE; self.slots];
        self.seed(&mut a, &mut block_of);
        let start_reserved = a.stats.reserved_bytes;
        let mut oom: Option<OomReport> = None;
        let mut avoided = Vec::new();
        let mut notes = Vec::new();
        let unknown_frees = self.unknown_frees;
        for (k, e) in self.entries.iter().enumerate() {
            a.entry = k as u32;
            match e.action {
                Action::Alloc => match a.malloc(e.size_bytes, self.rank(e.stream)) {
                    Ok(id) => block_of[self.slot[k] as usize] = id,
                    Err(f) => {
                        oom = Some(self.oom_report(&a, k, e, f, false, opts.detailed));
                        break;
                    }
                },
                Action::FreeRequested => {
                    let s = self.slot[k];
                    if s != NONE && block_of[s as usize] != NONE {
                        let id = block_of[s as usize];
                        a.free_requested(id);
                        if opts.frees_at_request {
                            a.free_completed(id);
                            block_of[s as usize] = NONE;
                        }
                    }
                }
                Action::FreeCompleted => {
                    let s = self.slot[k];
                    if s != NONE && block_of[s as usize] != NONE {
                        a.free_completed(block_of[s as usize]);
                        block_of[s as usize] = NONE;
                    }
                }
                Action::SegmentFree | Action::SegmentUnmap if self.empty_cache_at[k] => a.release_cached_blocks(),
                Action::Oom => match a.malloc(e.size_bytes, self.rank(e.stream)) {
                    Ok(_) => avoided.push(k as u32),
                    Err(f) => {
                        if oom.is_none() {
                            oom = Some(self.oom_report(&a, k, e, f, true, opts.detailed));
                        }
                    }
                },
                _ => {}
            }
        }
        if unknown_frees > 0 {
            notes.push(format!("{unknown_frees} frees of addresses the trace never allocated were ignored"));
        }
        if !avoided.is_empty() {
            notes.push(format!(
                "the recorded out-of-memory error at entry {} does not happen under these settings; the replay \
                 goes on with the recorded program, which had handled the error",
                avoided[0]
            ));
        }
        if opts.device_memory_from_oom && self.recorded_oom_capacity_bytes.is_none() {
            notes.push(
                "--device-memory recorded: the trace has no out-of-memory entry with the device's free \
                        memory; the device was left unlimited"
                    .to_string(),
            );
        }
        if let (Some(c), false) = (self.recorded_oom_capacity_bytes, opts.device_memory_from_oom) {
            notes.push(format!(
                "the recording ran out of memory with {} held by the allocator or free on the device; ask what-ifs \
                 at that capacity with --device-memory recorded",
                torchmem_snapshot::fmt::bytes(c)
            ));
        }
        if !self.start.is_empty() {
            notes.push(format!(
                "the trace does not start from an empty allocator ({} segments, {} reserved at its start, \
                 reconstructed from the dump); a what-if keeps those blocks' layout",
                self.start.segments.len(),
                torchmem_snapshot::fmt::bytes(self.start.reserved_bytes())
            ));
        }
        let comparison = if same_settings && opts.detailed { Some(self.compare(&a, start_reserved)) } else { None };
        let s = a.stats.clone();
        let (mut n_malloc, mut n_map) = (0, 0);
        let (mut n_free, mut n_unmap) = (0, 0);
        for ev in &a.events {
            match ev.kind {
                SegKind::SegmentAlloc => n_malloc += 1,
                SegKind::SegmentFree => n_free += 1,
                SegKind::SegmentMap => n_map += 1,
                SegKind::SegmentUnmap => n_unmap += 1,
            }
        }
        if !opts.detailed {
            // Events were not kept: split the device counters by mode.
            if conf.expandable_segments {
                n_map = s.num_device_alloc;
                n_unmap = s.num_device_free;
            } else {
                n_malloc = s.num_device_alloc;
                n_free = s.num_device_free;
            }
        }
        DeviceResult {
            device: self.device,
            entries: self.entries.len(),
            settings: conf.describe(),
            recorded_settings: self.recorded_conf.describe(),
            memory_limit_bytes: allowed,
            device_memory_bytes: device_memory,
            peak_allocated_bytes: s.peak_allocated_bytes,
            peak_reserved_bytes: s.peak_reserved_bytes,
            peak_active_bytes: s.peak_active_bytes,
            peak_requested_bytes: s.peak_requested_bytes,
            reserved_unallocated_at_peak_bytes: a.unallocated_at_peak_bytes,
            num_cuda_malloc: n_malloc,
            num_cuda_free: n_free,
            num_map: n_map,
            num_unmap: n_unmap,
            num_alloc_retries: s.num_alloc_retries,
            num_ooms: s.num_ooms,
            stats: s,
            oom,
            recorded_ooms_avoided: avoided,
            comparison,
            starts_empty: self.start.is_empty(),
            start_reserved_bytes: start_reserved,
            start_segments: self.start.segments.len(),
            notes,
        }
    }

    /// Puts the start state into the allocator.
    fn seed(&self, a: &mut Allocator, block_of: &mut [u32]) {
        let mut next_slot = 0usize;
        for r in &self.start.reservations {
            a.seed_reservation(r.base, r.end_seen, self.rank(r.stream), r.small);
        }
        for (seg, live) in self.start.segments.iter().zip(&self.start.blocks) {
            let stream = self.rank(seg.stream);
            let first = if seg.expandable {
                a.seed_mapped_range(seg.addr, seg.size_bytes, stream, seg.small)
            } else {
                a.seed_segment(seg.addr, seg.size_bytes, stream, seg.small)
            };
            // The blocks around it in its expandable reservation (unmapped ranges), else none.
            let (outer_prev, outer_next) = (a.arena.get(first).prev, a.arena.get(first).next);
            let pool = if seg.small { 0u8 } else { 1u8 };
            // Lay out [free gap][live]... as a linked chain.
            let end = seg.addr + seg.size_bytes;
            let mut pieces: Vec<Block> = Vec::new();
            let mut cursor = seg.addr;
            let proto = a.arena.get(first).clone();
            for b in live {
                if b.addr > cursor {
                    pieces.push(Block { addr: cursor, size_bytes: b.addr - cursor, ..proto.clone() });
                }
                pieces.push(Block {
                    addr: b.addr,
                    size_bytes: b.size_bytes,
                    requested_bytes: b.requested_bytes,
                    allocated: !b.pending,
                    pending: b.pending,
                    ..proto.clone()
                });
                cursor = b.addr + b.size_bytes;
            }
            if cursor < end {
                pieces.push(Block { addr: cursor, size_bytes: end - cursor, ..proto.clone() });
            }
            let mut ids = vec![first];
            for _ in 1..pieces.len() {
                ids.push(a.arena.alloc(proto.clone()));
            }
            if outer_prev != NONE {
                a.arena.get_mut(outer_prev).next = ids[0];
            }
            if outer_next != NONE {
                a.arena.get_mut(outer_next).prev = *ids.last().expect("one piece at least");
            }
            for (i, (mut p, &id)) in pieces.into_iter().zip(&ids).enumerate() {
                p.prev = if i == 0 { outer_prev } else { ids[i - 1] };
                p.next = ids.get(i + 1).copied().unwrap_or(outer_next);
                p.pool = pool;
                p.stream = stream;
                let (allocated, pending, size, req) = (p.allocated, p.pending, p.size_bytes, p.requested_bytes);
                *a.arena.get_mut(id) = p;
                if allocated || pending {
                    if allocated {
                        a.stats.allocated_bytes += size;
                    } else {
                        a.pending.push(id);
                    }
                    a.stats.active_bytes += size;
                    a.stats.requested_bytes += req;
                    block_of[next_slot] = id;
                    next_slot += 1;
                } else {
                    a.pools[pool as usize].insert_free(&mut a.arena, id);
                }
            }
        }
        let s = &mut a.stats;
        s.peak_allocated_bytes = s.allocated_bytes;
        s.peak_active_bytes = s.active_bytes;
        s.peak_requested_bytes = s.requested_bytes;
        a.unallocated_at_peak_bytes = s.reserved_bytes - s.allocated_bytes;
    }

    fn oom_report(
        &self,
        a: &Allocator,
        k: usize,
        e: &Entry,
        f: OomFailure,
        recorded: bool,
        detailed: bool,
    ) -> OomReport {
        let frames: Vec<String> = if detailed { self.user_frames(e.stack) } else { Vec::new() };
        let mut live = if detailed { a.live_blocks() } else { Vec::new() };
        let live_count = live.len();
        live.sort_by(|x, y| y.1.cmp(&x.1).then(x.0.cmp(&y.0)));
        let largest_live = live
            .iter()
            .take(5)
            .map(|&(addr, size, req, entry)| {
                let entry = (entry != u32::MAX).then_some(entry);
                let frame = entry.and_then(|i| self.user_frames(self.entries[i as usize].stack).into_iter().next());
                LiveBlock { addr, size_bytes: size, requested_bytes: req, entry, frame }
            })
            .collect();
        OomReport {
            entry: k as u32,
            time_us: e.time_us,
            trace_start_us: self.entries.first().map_or(e.time_us, |first| first.time_us),
            failure: f,
            frames,
            live_blocks: live_count,
            largest_live,
            recorded,
        }
    }

    /// The frames worth showing, innermost first: Python frames when the stack has them, else the C++ frames
    /// above the allocator's own (unwinding, gathering, `malloc`, `empty_*`).
    fn user_frames(&self, stack: StackId) -> Vec<String> {
        let st = self.snap.stack(stack);
        let file = |fr: u32| self.snap.frames.get(fr as usize).map(|f| self.snap.str(f.filename)).unwrap_or("");
        let py: Vec<String> =
            st.iter().filter(|&&fr| file(fr).ends_with(".py")).map(|&fr| self.snap.frame_text(fr)).collect();
        if !py.is_empty() {
            return py;
        }
        let internal = ["unwind", "CapturedTraceback", "gather", "CachingAllocator", "empty_generic", "empty_cuda"];
        let skip = st.iter().rposition(|&fr| internal.iter().any(|k| self.snap.frame_text(fr).contains(k)));
        st.iter().skip(skip.map(|i| i + 1).unwrap_or(0)).map(|&fr| self.snap.frame_text(fr)).collect()
    }

    /// Replayed vs recorded segment events and peak reserved.
    fn compare(&self, a: &Allocator, start_reserved: u64) -> Comparison {
        let rec = &self.recorded_events;
        let got = &a.events;
        let mut divergence = None;
        for i in 0..rec.len().max(got.len()) {
            let (r, g) = (rec.get(i), got.get(i));
            let same = match (r, g) {
                (Some(r), Some(g)) => {
                    r.kind == g.kind && r.size_bytes == g.size_bytes && r.addr == g.addr && r.entry == g.entry
                }
                _ => false,
            };
            if !same {
                let entry = match (r, g) {
                    (Some(r), Some(g)) => r.entry.min(g.entry),
                    (Some(r), None) => r.entry,
                    (None, Some(g)) => g.entry,
                    (None, None) => 0,
                };
                let what = match (r, g) {
                    (Some(_), None) => "the replay has fewer segment events".to_string(),
                    (None, Some(_)) => "the replay has more segment events".to_string(),
                    (Some(r), Some(g)) if r.entry != g.entry => {
                        format!("the event happens at entry {} in the replay, {} in the recording", g.entry, r.entry)
                    }
                    _ => "different event".to_string(),
                };
                divergence = Some(Divergence { event_index: i, entry, expected: r.copied(), got: g.copied(), what });
                break;
            }
        }
        let mut reserved = start_reserved;
        let mut peak = reserved;
        for r in rec {
            match r.kind {
                SegKind::SegmentAlloc | SegKind::SegmentMap => reserved += r.size_bytes,
                SegKind::SegmentFree | SegKind::SegmentUnmap => reserved = reserved.saturating_sub(r.size_bytes),
            }
            peak = peak.max(reserved);
        }
        let matches = divergence.is_none() && peak == a.stats.peak_reserved_bytes;
        Comparison {
            matches,
            segment_events: got.len(),
            recorded_segment_events: rec.len(),
            recorded_peak_reserved_bytes: peak,
            divergence,
        }
    }
}
