//! An allocator trace as the viewer sees it: every allocation of one device as a band (event interval ×
//! packed byte offset), with its site, category and stack, the active-bytes level after every event, the
//! OOM events, and the segments at any moment. Built once from a `torchmem_snapshot::Snapshot` (a PyTorch
//! snapshot, an estimate's trace or a simulation's trace: all the same format).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use torchmem_snapshot::model::{Action, BlockState, FxBuild, Snapshot, StackId, TraceEntry, NO_STACK};
use torchmem_snapshot::sites;

/// The free time of a block still alive at the end of the trace.
pub const ALIVE: u32 = u32::MAX;

/// One allocation: alive from event `t0` (its alloc) to event `t1` (its free_completed, or [`ALIVE`]).
/// 36 bytes (packed to 4): its site and category are per stack (`Trace::site`, `Trace::category`), and
/// whether it predates the recorded history is its place (the first `Trace::n_before` allocations).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, packed(4))]
pub struct Alloc {
    pub t0: u32,
    pub t1: u32,
    /// Offset of the band's bottom in the packed layout (bytes).
    pub y: u64,
    pub size_bytes: u64,
    pub addr: u64,
    pub stack: StackId,
}

/// What an allocation is, from its stack.
pub const CATEGORIES: [&str; 6] =
    ["parameters", "gradients / backward", "optimizer state", "activations / forward", "other", "before the trace"];

/// An `oom` event of the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct OomEvent {
    pub event: u32,
    pub time_us: i64,
    pub requested_bytes: u64,
    pub device_free_bytes: Option<u64>,
}

/// `time_us` of every event: 4 bytes an event (offsets from the first) while they fit, else 8.
#[derive(Debug, Clone)]
pub enum Times {
    Offsets { base: i64, offsets: Vec<u32> },
    Wide(Vec<i64>),
}

impl Default for Times {
    fn default() -> Self {
        Times::Offsets { base: 0, offsets: Vec::new() }
    }
}

impl Times {
    #[inline]
    pub fn push(&mut self, t: i64) {
        match self {
            Times::Offsets { base, offsets } => {
                if offsets.is_empty() {
                    *base = t;
                }
                match u32::try_from(t.wrapping_sub(*base)) {
                    Ok(d) if t >= *base => offsets.push(d),
                    _ => {
                        let b = *base;
                        let mut wide: Vec<i64> = offsets.iter().map(|&d| b + d as i64).collect();
                        wide.push(t);
                        *self = Times::Wide(wide);
                    }
                }
            }
            Times::Wide(v) => v.push(t),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Times::Offsets { offsets, .. } => offsets.len(),
            Times::Wide(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn get(&self, e: usize) -> Option<i64> {
        match self {
            Times::Offsets { base, offsets } => offsets.get(e).map(|&d| base + d as i64),
            Times::Wide(v) => v.get(e).copied(),
        }
    }

    pub fn first(&self) -> Option<i64> {
        self.get(0)
    }

    pub fn last(&self) -> Option<i64> {
        self.get(self.len().wrapping_sub(1))
    }

    /// The first event whose time is not before `t` (the last event when none): times are in order.
    pub fn event_at(&self, t: i64) -> u32 {
        let n = self.len();
        let k = match self {
            Times::Offsets { base, offsets } => {
                if t <= *base {
                    0
                } else {
                    let d = u32::try_from(t - base).unwrap_or(u32::MAX);
                    offsets.partition_point(|&x| x < d)
                }
            }
            Times::Wide(v) => v.partition_point(|&x| x < t),
        };
        k.min(n.saturating_sub(1)) as u32
    }

    fn shrink(&mut self) {
        match self {
            Times::Offsets { offsets, .. } => offsets.shrink_to_fit(),
            Times::Wide(v) => v.shrink_to_fit(),
        }
    }
}

/// The viewer's model of one device's trace.
pub struct Trace {
    /// The snapshot without its trace entries (strings, frames, stacks, segments, annotations).
    pub snap: Snapshot,
    pub device: usize,
    /// Allocations sorted by `t0` (their index is the allocation id); the first `n_before` predate the
    /// recorded history.
    pub allocs: Vec<Alloc>,
    pub n_before: u32,
    /// Number of events (x axis: 0..events).
    pub events: u32,
    /// Requested bytes alive after each event (exact, pre-history blocks included); the LOD index takes it.
    pub active_bytes: Vec<u64>,
    /// The segment events (event, action, address, bytes): the trace itself is never kept.
    pub segment_events: Vec<(u32, Action, u64, u64)>,
    /// Height of the packed layout (≥ the peak of `active_bytes`).
    pub layout_bytes: u64,
    pub peak_bytes: u64,
    pub peak_event: u32,
    pub sites: Vec<String>,
    /// Site (index into `sites`) and category of each stack id; the last entry is for `NO_STACK`.
    stack_site: Vec<u32>,
    stack_cat: Vec<u8>,
    pub ooms: Vec<OomEvent>,
    /// `time_us` of every event (for the read-out).
    pub time_us: Times,
    /// `record_function` / `_set_memory_metadata` spans of this device, as event intervals.
    pub annotations: Vec<AnnotationSpan>,
}

/// An annotation's START..END, mapped onto the event axis.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AnnotationSpan {
    /// "annotation" (record_function), or a profile's lane: "epoch", "step", "phase", "mark".
    pub lane: &'static str,
    pub name: String,
    pub e0: u32,
    pub e1: u32,
}

/// Pairs START/END annotations by name (innermost first) and maps their times to events.
fn annotation_spans(snap: &Snapshot, device: usize, time_us: &Times) -> Vec<AnnotationSpan> {
    let event_at = |t: i64| time_us.event_at(t);
    let mut open: HashMap<&str, Vec<i64>> = HashMap::new();
    let mut out = Vec::new();
    for a in snap.annotations.iter().filter(|a| a.device == device as i64 || a.device < 0) {
        match a.stage.to_ascii_uppercase().as_str() {
            "START" => open.entry(a.name.as_str()).or_default().push(a.time_us),
            "END" => {
                if let Some(t0) = open.get_mut(a.name.as_str()).and_then(Vec::pop) {
                    out.push(AnnotationSpan {
                        lane: "annotation",
                        name: a.name.clone(),
                        e0: event_at(t0),
                        e1: event_at(a.time_us),
                    });
                }
            }
            _ => out.push(AnnotationSpan {
                lane: "annotation",
                name: a.name.clone(),
                e0: event_at(a.time_us),
                e1: event_at(a.time_us),
            }),
        }
    }
    out.sort_by_key(|s| (s.e0, s.e1));
    out
}

/// Packs intervals on a line (best fit by size, coalescing on free): bands never overlap and never move.
#[derive(Default)]
struct Packer {
    by_start: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    top: u64,
    /// The highest `top` ever (the layout's height).
    high: u64,
}

impl Packer {
    fn take(&mut self, size: u64) -> u64 {
        let size = size.max(1);
        if let Some(&(len, start)) = self.by_size.range((size, 0)..).next() {
            self.by_size.remove(&(len, start));
            self.by_start.remove(&start);
            if len > size {
                self.insert_gap(start + size, len - size);
            }
            return start;
        }
        // Grow the top, using a gap that touches it.
        if let Some((&start, &len)) = self.by_start.iter().next_back() {
            if start + len == self.top {
                self.by_start.remove(&start);
                self.by_size.remove(&(len, start));
                self.top = start + size;
                self.high = self.high.max(self.top);
                return start;
            }
        }
        let y = self.top;
        self.top += size;
        self.high = self.high.max(self.top);
        y
    }

    fn insert_gap(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_size.insert((len, start));
    }

    fn give(&mut self, start: u64, size: u64) {
        let (mut start, mut len) = (start, size.max(1));
        // Freed at the top: the top comes down (and takes a gap that touches it).
        if start + len == self.top {
            self.top = start;
            if let Some((&s, &l)) = self.by_start.iter().next_back() {
                if s + l == self.top {
                    self.by_start.remove(&s);
                    self.by_size.remove(&(l, s));
                    self.top = s;
                }
            }
            return;
        }
        if let Some((&s, &l)) = self.by_start.range(..start).next_back() {
            if s + l == start {
                self.by_start.remove(&s);
                self.by_size.remove(&(l, s));
                start = s;
                len += l;
            }
        }
        if let Some(&l) = self.by_start.get(&(start + len)) {
            self.by_start.remove(&(start + len));
            self.by_size.remove(&(l, start + len));
            len += l;
        }
        self.insert_gap(start, len);
    }
}

fn category_of(snap: &Snapshot, stack: StackId) -> u8 {
    let frames = snap.stack(stack);
    let mut forward = false;
    for &f in frames {
        let fr = &snap.frames[f as usize];
        let file = snap.str(fr.filename);
        let name = snap.str(fr.name);
        if file.contains("torch/optim/") || name.contains("optimizer") {
            return 2;
        }
        if name.contains("backward") || name.starts_with("torch::autograd::") || file.contains("torch/autograd/") {
            return 1;
        }
        if file.ends_with("torch/nn/modules/module.py") && matches!(name, "_apply" | "to" | "cuda" | "__init__") {
            return 0;
        }
        if name == "forward" || name == "_call_impl" || name.starts_with("at::_ops::") {
            forward = true;
        }
    }
    if forward {
        3
    } else {
        4
    }
}

/// Builds one device's bands while its trace entries stream in (one event at a time, in order): the
/// allocations of the trace are placed in the packed layout as they come (above the blocks from before
/// the history, whose total is known only at the end), the level is kept per event, and nothing of the
/// entries themselves is kept.
#[derive(Default)]
pub struct TraceBuilder {
    events: u32,
    time_us: Times,
    /// The trace's allocations, in event order, `y` above the pre-history blocks.
    allocs: Vec<Alloc>,
    /// Blocks freed by the trace but not allocated in it (t0 = 0), in the order of their frees.
    before: Vec<Alloc>,
    open: HashMap<u64, u32, FxBuild>,
    packer: Packer,
    /// Bytes alive after each event, pre-history blocks left out.
    level: Vec<u64>,
    cur: u64,
    segment_events: Vec<(u32, Action, u64, u64)>,
    /// (event, time, requested bytes, entry info id)
    ooms: Vec<(u32, i64, u64, u32)>,
}

impl TraceBuilder {
    /// Number of events read.
    pub fn events(&self) -> u32 {
        self.events
    }

    /// Takes the next entries of the trace.
    pub fn push(&mut self, entries: &[TraceEntry]) {
        for e in entries {
            self.push_one(e);
        }
    }

    #[inline]
    fn push_one(&mut self, e: &TraceEntry) {
        let i = self.events;
        self.events += 1;
        self.time_us.push(e.time_us);
        match e.action() {
            a @ (Action::SegmentAlloc | Action::SegmentMap | Action::SegmentFree | Action::SegmentUnmap) => {
                self.segment_events.push((i, a, e.addr, e.size_bytes))
            }
            Action::Alloc => {
                let y = self.packer.take(e.size_bytes);
                self.cur += e.size_bytes;
                self.open.insert(e.addr, self.allocs.len() as u32);
                self.allocs.push(Alloc { t0: i, t1: ALIVE, y, size_bytes: e.size_bytes, addr: e.addr, stack: e.stack });
            }
            Action::FreeCompleted => match self.open.remove(&e.addr) {
                Some(k) => {
                    let a = &mut self.allocs[k as usize];
                    a.t1 = i;
                    let (y, size) = (a.y, a.size_bytes);
                    self.packer.give(y, size);
                    self.cur = self.cur.saturating_sub(size);
                }
                None => self.before.push(Alloc {
                    t0: 0,
                    t1: i,
                    y: 0,
                    size_bytes: e.size_bytes,
                    addr: e.addr,
                    stack: e.stack,
                }),
            },
            Action::Oom => self.ooms.push((i, e.time_us, e.size_bytes, e.info())),
            _ => {}
        }
        self.level.push(self.cur);
    }

    /// The viewer's model of `device`'s trace, from the entries read and the snapshot (its end state,
    /// frames and annotations; its trace entries are not needed and are dropped).
    pub fn finish(self, mut snap: Snapshot, device: usize) -> Trace {
        let TraceBuilder {
            events,
            mut time_us,
            allocs: mut trace_allocs,
            mut before,
            open,
            packer,
            level,
            segment_events,
            ooms,
            ..
        } = self;
        snap.device_traces = Vec::new();
        // Alive at the end but not by the trace: allocated before the recorded history.
        let freed_before = before.len();
        for seg in snap.segments.iter().filter(|s| s.device == device as i64) {
            for b in seg.blocks.iter().filter(|b| b.state != BlockState::Inactive) {
                if !open.contains_key(&b.address) {
                    before.push(Alloc {
                        t0: 0,
                        t1: ALIVE,
                        y: 0,
                        size_bytes: b.requested_bytes.max(1),
                        addr: b.address,
                        stack: b.stack,
                    });
                }
            }
        }
        drop(open);
        // The pre-history blocks are all alive at event 0: stacked from 0 in order; the trace's bands
        // go above them.
        let mut h = 0u64;
        for a in before.iter_mut() {
            a.y = h;
            h += a.size_bytes.max(1);
        }
        let n_before = before.len() as u32;
        if h > 0 {
            for a in trace_allocs.iter_mut() {
                a.y += h;
            }
        }
        // The level: the trace's own plus the pre-history blocks still alive (those freed by the trace
        // leave at their free).
        let mut active = level;
        if active.is_empty() {
            active.push(0);
        }
        let mut pre_alive: u64 = before.iter().map(|a| a.size_bytes).sum();
        let mut frees = before[..freed_before].iter().map(|a| (a.t1, a.size_bytes)).peekable();
        let (mut peak, mut peak_event) = (0u64, 0u32);
        for (t, v) in active.iter_mut().enumerate() {
            while let Some(&(t1, size)) = frees.peek() {
                if t1 as usize > t {
                    break;
                }
                pre_alive = pre_alive.saturating_sub(size);
                frees.next();
            }
            *v += pre_alive;
            if *v > peak {
                peak = *v;
                peak_event = t as u32;
            }
        }
        let allocs = if before.is_empty() {
            trace_allocs
        } else {
            trace_allocs.splice(0..0, before);
            trace_allocs
        };
        let mut allocs = allocs;
        allocs.shrink_to_fit();
        time_us.shrink();
        // Site and category per stack, in the order the allocations first use them.
        let n_stacks = snap.stacks.len();
        let mut stack_site = vec![u32::MAX; n_stacks + 1];
        let mut stack_cat = vec![4u8; n_stacks + 1];
        let mut site_ids: HashMap<String, u32, FxBuild> = HashMap::default();
        let mut sites: Vec<String> = Vec::new();
        for a in &allocs {
            let stack = a.stack;
            let k = if stack == NO_STACK { n_stacks } else { (stack as usize).min(n_stacks) };
            if stack_site[k] != u32::MAX {
                continue;
            }
            let label =
                if stack == NO_STACK { "(no frames recorded)".to_string() } else { sites::site_label(&snap, stack) };
            let n = site_ids.len() as u32;
            stack_site[k] = *site_ids.entry(label.clone()).or_insert_with(|| {
                sites.push(label);
                n
            });
            stack_cat[k] = category_of(&snap, stack);
        }
        let ooms = ooms
            .into_iter()
            .map(|(event, time_us, requested_bytes, info)| OomEvent {
                event,
                time_us,
                requested_bytes,
                device_free_bytes: snap.entry_infos.get(info as usize).and_then(|i| i.device_free_bytes),
            })
            .collect();
        let annotations = if time_us.is_empty() { Vec::new() } else { annotation_spans(&snap, device, &time_us) };
        Trace {
            layout_bytes: (h + packer.high).max(1),
            segment_events,
            snap,
            device,
            allocs,
            n_before,
            events: events.max(1),
            active_bytes: active,
            peak_bytes: peak,
            peak_event,
            sites,
            stack_site,
            stack_cat,
            ooms,
            time_us,
            annotations,
        }
    }
}

impl Trace {
    /// Builds the viewer's model of `device`'s trace (the device with the most events when `None`) from a
    /// snapshot that holds its trace entries.
    pub fn build(mut snap: Snapshot, device: Option<usize>) -> Trace {
        let device = device.unwrap_or_else(|| {
            (0..snap.device_traces.len()).max_by_key(|&d| (snap.device_traces[d].len(), usize::MAX - d)).unwrap_or(0)
        });
        let mut b = TraceBuilder::default();
        if device < snap.device_traces.len() {
            let entries = std::mem::take(&mut snap.device_traces[device]);
            b.push(&entries);
        }
        b.finish(snap, device)
    }

    /// A trace of the given allocations (no stacks, one site) for the pure logic's unit tests.
    #[cfg(test)]
    pub(crate) fn fake(allocs: Vec<Alloc>, events: u32) -> Trace {
        Trace {
            snap: Snapshot::default(),
            device: 0,
            allocs,
            n_before: 0,
            events,
            active_bytes: Vec::new(),
            segment_events: Vec::new(),
            layout_bytes: 1,
            peak_bytes: 0,
            peak_event: 0,
            sites: vec!["site".into()],
            stack_site: vec![0],
            stack_cat: vec![3],
            ooms: Vec::new(),
            time_us: Times::default(),
            annotations: Vec::new(),
        }
    }

    fn stack_slot(&self, stack: StackId) -> usize {
        let n = self.stack_site.len() - 1;
        if stack == NO_STACK {
            n
        } else {
            (stack as usize).min(n)
        }
    }

    /// The allocation site (index into `sites`) of allocation `id`.
    pub fn site(&self, id: u32) -> u32 {
        let s = self.allocs[id as usize].stack;
        self.stack_site[self.stack_slot(s)]
    }

    /// The category (index into [`CATEGORIES`]) of allocation `id`.
    pub fn category(&self, id: u32) -> u8 {
        if id < self.n_before {
            return 5;
        }
        let s = self.allocs[id as usize].stack;
        self.stack_cat[self.stack_slot(s)]
    }

    /// Allocation `id` was allocated before the recorded history.
    pub fn before_history(&self, id: u32) -> bool {
        id < self.n_before
    }

    /// The whole stack of an allocation, innermost first (`file:line:function`).
    pub fn stack_text(&self, stack: StackId) -> Vec<String> {
        self.snap.stack(stack).iter().map(|&f| self.snap.frame_text(f)).collect()
    }

    /// Allocation ids whose stack has a frame containing `query` (case-insensitive; `file:line` or an op or
    /// function name), at most `limit`, and how many match in all.
    pub fn search(&self, query: &str, limit: usize) -> (Vec<u32>, usize) {
        let q = query.trim().to_lowercase();
        if q.is_empty() {
            return (Vec::new(), 0);
        }
        let frames: Vec<bool> =
            (0..self.snap.frames.len() as u32).map(|f| self.snap.frame_text(f).to_lowercase().contains(&q)).collect();
        let stacks: Vec<bool> =
            self.snap.stacks.iter().map(|s| s.iter().any(|&f| frames.get(f as usize) == Some(&true))).collect();
        let site_hit: Vec<bool> = self.sites.iter().map(|s| s.to_lowercase().contains(&q)).collect();
        let mut out = Vec::new();
        let mut n = 0;
        for (i, a) in self.allocs.iter().enumerate() {
            let hit = (a.stack != NO_STACK && stacks.get(a.stack as usize) == Some(&true))
                || site_hit.get(self.site(i as u32) as usize) == Some(&true);
            if hit {
                n += 1;
                if out.len() < limit {
                    out.push(i as u32);
                }
            }
        }
        (out, n)
    }

    /// The segments alive after event `t`, each with the allocations alive in it then (address order).
    pub fn segments_at(&self, t: u32) -> Vec<SegmentAt> {
        // Undo the segment events after `t`, from the dump's end state backwards.
        let mut segs: BTreeMap<u64, u64> = self
            .snap
            .segments
            .iter()
            .filter(|s| s.device == self.device as i64)
            .map(|s| (s.address, s.total_bytes))
            .collect();
        let later = self.segment_events.partition_point(|s| s.0 <= t);
        for &(_, action, addr, size) in self.segment_events[later..].iter().rev() {
            match action {
                Action::SegmentAlloc | Action::SegmentMap => {
                    // Undo a map: the mapped range leaves (an expandable segment shrinks).
                    if segs.get(&addr) == Some(&size) {
                        segs.remove(&addr);
                    } else if let Some((&a, &len)) = segs.range(..=addr).next_back() {
                        if a + len == addr + size && len > size {
                            segs.insert(a, len - size);
                        } else {
                            segs.remove(&addr);
                        }
                    }
                }
                _ => {
                    segs.insert(addr, size);
                }
            }
        }
        let mut out: Vec<SegmentAt> =
            segs.iter().map(|(&a, &s)| SegmentAt { address: a, total_bytes: s, blocks: Vec::new() }).collect();
        for (i, a) in self.allocs.iter().enumerate() {
            if a.t0 > t {
                break;
            }
            if a.t1 != ALIVE && a.t1 <= t {
                continue;
            }
            let k = out.partition_point(|s| s.address <= a.addr);
            if k == 0 {
                continue;
            }
            let s = &mut out[k - 1];
            if a.addr < s.address + s.total_bytes {
                s.blocks.push((a.addr - s.address, a.size_bytes, i as u32));
            }
        }
        for s in &mut out {
            s.blocks.sort_unstable();
        }
        out.sort_by_key(|s| std::cmp::Reverse(s.total_bytes));
        out
    }
}

impl Trace {
    /// Adds a run profile's epoch / step / phase spans as lanes, mapped by wall clock (the profile's start
    /// time plus its offsets) onto this trace's events; spans outside the trace's time are left out.
    /// Returns how many were added.
    pub fn add_profile_lanes(&mut self, view: &crate::profile::ProfileView) -> usize {
        let (Some(first), Some(last)) = (self.time_us.first(), self.time_us.last()) else { return 0 };
        let event_at = |t: i64| self.time_us.event_at(t);
        let mut added = Vec::new();
        for s in &view.spans {
            let (t0, t1) = (view.unix_us(s.t0_ns), view.unix_us(s.t1_ns));
            if t1 < first || t0 > last {
                continue;
            }
            added.push(AnnotationSpan { lane: s.lane, name: s.name.clone(), e0: event_at(t0), e1: event_at(t1) });
        }
        let k = added.len();
        self.annotations.extend(added);
        self.annotations.sort_by_key(|s| (s.e0, s.e1));
        k
    }
}

impl Trace {
    /// Bytes alive after event `t` per allocation site (label, bytes, count).
    pub fn sites_at(&self, t: u32) -> HashMap<String, (u64, u64)> {
        let mut out: HashMap<String, (u64, u64)> = HashMap::new();
        for (i, a) in self.allocs.iter().enumerate().filter(|(_, a)| a.t0 <= t && (a.t1 == ALIVE || a.t1 > t)) {
            let e = out.entry(self.sites.get(self.site(i as u32) as usize).cloned().unwrap_or_default()).or_default();
            e.0 += a.size_bytes;
            e.1 += 1;
        }
        out
    }
}

/// A node of the icicle: a frame (outermost first from the root) and the bytes alive under it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IcicleNode {
    pub name: String,
    pub bytes: u64,
    pub children: Vec<IcicleNode>,
}

impl Trace {
    /// The composition of the memory alive after event `t` as a tree of Python stacks, outermost frame at
    /// the root (C++-only stacks under their site); children below `min_share` of the total are merged into
    /// "(smaller)", at most `max_depth` levels.
    pub fn icicle_at(&self, t: u32, min_share: f64, max_depth: usize) -> IcicleNode {
        struct N {
            name: String,
            bytes: u64,
            children: HashMap<String, usize>,
        }
        let mut nodes = vec![N { name: "all".into(), bytes: 0, children: HashMap::new() }];
        let mut paths: HashMap<StackId, Vec<String>, FxBuild> = HashMap::default();
        for (i, a) in self.allocs.iter().enumerate().filter(|(_, a)| a.t0 <= t && (a.t1 == ALIVE || a.t1 > t)) {
            let path = paths.entry(a.stack).or_insert_with(|| {
                let frames = self.snap.stack(a.stack);
                let py: Vec<String> = frames
                    .iter()
                    .rev()
                    .filter(|&&f| self.snap.str(self.snap.frames[f as usize].filename).ends_with(".py"))
                    .map(|&f| self.snap.frame_text(f))
                    .collect();
                if py.is_empty() {
                    vec![self.sites.get(self.site(i as u32) as usize).cloned().unwrap_or_default()]
                } else {
                    py
                }
            });
            let mut cur = 0;
            nodes[0].bytes += a.size_bytes;
            for name in path.iter().take(max_depth) {
                let next = match nodes[cur].children.get(name) {
                    Some(&k) => k,
                    None => {
                        nodes.push(N { name: name.clone(), bytes: 0, children: HashMap::new() });
                        let k = nodes.len() - 1;
                        nodes[cur].children.insert(name.clone(), k);
                        k
                    }
                };
                nodes[next].bytes += a.size_bytes;
                cur = next;
            }
        }
        let min_bytes = (nodes[0].bytes as f64 * min_share) as u64;
        fn build(nodes: &[N], k: usize, min_bytes: u64) -> IcicleNode {
            let mut kids: Vec<usize> = nodes[k].children.values().copied().collect();
            kids.sort_by_key(|&c| std::cmp::Reverse(nodes[c].bytes));
            let mut children = Vec::new();
            let mut small = 0;
            for c in kids {
                if nodes[c].bytes >= min_bytes.max(1) {
                    children.push(build(nodes, c, min_bytes));
                } else {
                    small += nodes[c].bytes;
                }
            }
            if small > 0 {
                children.push(IcicleNode { name: "(smaller)".into(), bytes: small, children: Vec::new() });
            }
            IcicleNode { name: nodes[k].name.clone(), bytes: nodes[k].bytes, children }
        }
        build(&nodes, 0, min_bytes)
    }
}

/// One segment at a moment: its blocks as (offset, requested bytes, allocation id).
#[derive(Debug, Clone, serde::Serialize)]
pub struct SegmentAt {
    pub address: u64,
    pub total_bytes: u64,
    pub blocks: Vec<(u64, u64, u32)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Real H200 snapshots: the level's peak is the snapshot crate's traced peak, the bands never overlap,
    /// and the blocks in the segments at any moment add up to the level then.
    #[test]
    fn real_snapshots_give_the_traced_peak_and_consistent_segments() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
        for name in
            ["snapshots/snapshot_mlp_adam_pystacks.pickle", "sim-h200/gpt2_adamw_amp__replay__cap_oom.pickle.gz"]
        {
            let snap = torchmem_snapshot::read_path(&dir.join(name)).unwrap();
            let want = torchmem_snapshot::replay::replay(&snap, 0);
            let t = Trace::build(snap, Some(0));
            assert_eq!(t.peak_bytes, want.peak_bytes, "{name}");
            assert!(t.layout_bytes >= t.peak_bytes);
            for e in [0, t.events / 3, t.peak_event, t.events - 1] {
                let alive: u64 =
                    t.allocs.iter().filter(|a| a.t0 <= e && (a.t1 == ALIVE || a.t1 > e)).map(|a| a.size_bytes).sum();
                assert_eq!(alive, t.active_bytes[e as usize], "{name} @ {e}");
                let in_segments: u64 = t.segments_at(e).iter().flat_map(|s| s.blocks.iter().map(|b| b.1)).sum();
                assert_eq!(in_segments, alive, "{name} @ {e}");
            }
            // Bands alive at the same moment never overlap in the layout.
            let mut at_peak: Vec<&Alloc> =
                t.allocs.iter().filter(|a| a.t0 <= t.peak_event && (a.t1 == ALIVE || a.t1 > t.peak_event)).collect();
            at_peak.sort_by_key(|a| a.y);
            for w in at_peak.windows(2) {
                assert!(w[0].y + w[0].size_bytes.max(1) <= w[1].y, "{name}: overlapping bands");
            }
        }
        let snap =
            torchmem_snapshot::read_path(&dir.join("sim-h200/gpt2_adamw_amp__replay__cap_oom.pickle.gz")).unwrap();
        assert_eq!(Trace::build(snap, None).ooms.len(), 1);
    }

    #[test]
    fn packer_never_overlaps_and_reuses_freed_gaps() {
        let mut p = Packer::default();
        let a = p.take(100);
        let b = p.take(50);
        assert_eq!((a, b), (0, 100));
        p.give(a, 100);
        let c = p.take(60);
        assert_eq!(c, 0);
        let d = p.take(40);
        assert_eq!(d, 60);
        p.give(b, 50);
        p.give(c, 60);
        p.give(d, 40);
        // Everything coalesced back into one gap touching the top.
        let e = p.take(300);
        assert_eq!(e, 0);
        assert_eq!(p.top, 300);
    }
}
