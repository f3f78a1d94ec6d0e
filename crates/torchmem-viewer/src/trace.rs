//! An allocator trace as the viewer sees it: every allocation of one device as a band (event interval ×
//! packed byte offset), with its site, category and stack, the active-bytes level after every event, the
//! OOM events, and the segments at any moment. Built once from a `torchmem_snapshot::Snapshot` (a PyTorch
//! snapshot, an estimate's trace or a simulation's trace: all the same format).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use torchmem_snapshot::model::{Action, BlockState, FxBuild, Snapshot, StackId, NO_STACK};
use torchmem_snapshot::replay::device_trace;
use torchmem_snapshot::sites;

/// The free time of a block still alive at the end of the trace.
pub const ALIVE: u32 = u32::MAX;

/// One allocation: alive from event `t0` (its alloc) to event `t1` (its free_completed, or [`ALIVE`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alloc {
    pub t0: u32,
    pub t1: u32,
    /// Offset of the band's bottom in the packed layout (bytes).
    pub y: u64,
    pub size_bytes: u64,
    pub addr: u64,
    pub stack: StackId,
    /// Index into `Trace::sites`.
    pub site: u32,
    /// Index into [`CATEGORIES`].
    pub category: u8,
    /// Allocated before the recorded history (its alloc is not in the trace).
    pub before_history: bool,
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

/// The viewer's model of one device's trace.
pub struct Trace {
    pub snap: Snapshot,
    pub device: usize,
    /// Allocations sorted by `t0` (their index is the allocation id).
    pub allocs: Vec<Alloc>,
    /// Number of events (x axis: 0..events).
    pub events: u32,
    /// Requested bytes alive after each event (exact, pre-history blocks included); the LOD index takes it.
    pub active_bytes: Vec<u64>,
    /// The segment events (event, action, address, bytes): the trace itself is dropped once read.
    pub segment_events: Vec<(u32, Action, u64, u64)>,
    /// Height of the packed layout (≥ the peak of `active_bytes`).
    pub layout_bytes: u64,
    pub peak_bytes: u64,
    pub peak_event: u32,
    pub sites: Vec<String>,
    pub ooms: Vec<OomEvent>,
    /// `time_us` of every event (for the read-out).
    pub time_us: Vec<i64>,
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
fn annotation_spans(snap: &Snapshot, device: usize, time_us: &[i64]) -> Vec<AnnotationSpan> {
    let event_at = |t: i64| time_us.partition_point(|&x| x < t).min(time_us.len().saturating_sub(1)) as u32;
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
                return start;
            }
        }
        let y = self.top;
        self.top += size;
        y
    }

    fn insert_gap(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_size.insert((len, start));
    }

    fn give(&mut self, start: u64, size: u64) {
        let (mut start, mut len) = (start, size.max(1));
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

impl Trace {
    /// Builds the viewer's model of `device`'s trace (the device with the most events when `None`).
    pub fn build(snap: Snapshot, device: Option<usize>) -> Trace {
        let device = device.unwrap_or_else(|| {
            (0..snap.device_traces.len()).max_by_key(|&d| (snap.device_traces[d].len(), usize::MAX - d)).unwrap_or(0)
        });
        let entries = device_trace(&snap, device);
        let events = entries.len().max(1) as u32;
        let mut site_ids: HashMap<String, u32, FxBuild> = HashMap::default();
        let mut sites_v: Vec<String> = Vec::new();
        let mut stack_info: HashMap<StackId, (u32, u8), FxBuild> = HashMap::default();
        let mut info = |stack: StackId, snap: &Snapshot| -> (u32, u8) {
            if let Some(&v) = stack_info.get(&stack) {
                return v;
            }
            let label =
                if stack == NO_STACK { "(no frames recorded)".to_string() } else { sites::site_label(snap, stack) };
            let n = site_ids.len() as u32;
            let site = *site_ids.entry(label.clone()).or_insert_with(|| {
                sites_v.push(label);
                n
            });
            let v = (site, category_of(snap, stack));
            stack_info.insert(stack, v);
            v
        };
        // Pass 1: intervals (pre-history blocks start at event 0).
        let mut allocs: Vec<Alloc> = Vec::new();
        let mut open: HashMap<u64, usize, FxBuild> = HashMap::default();
        let mut ooms = Vec::new();
        let mut time_us = Vec::with_capacity(entries.len());
        let mut segment_events = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            time_us.push(e.time_us);
            match e.action() {
                a @ (Action::SegmentAlloc | Action::SegmentMap | Action::SegmentFree | Action::SegmentUnmap) => {
                    segment_events.push((i as u32, a, e.addr, e.size_bytes))
                }
                Action::Alloc => {
                    let (site, category) = info(e.stack, &snap);
                    open.insert(e.addr, allocs.len());
                    allocs.push(Alloc {
                        t0: i as u32,
                        t1: ALIVE,
                        y: 0,
                        size_bytes: e.size_bytes,
                        addr: e.addr,
                        stack: e.stack,
                        site,
                        category,
                        before_history: false,
                    });
                }
                Action::FreeCompleted => match open.remove(&e.addr) {
                    Some(k) => allocs[k].t1 = i as u32,
                    None => {
                        let (site, _) = info(e.stack, &snap);
                        allocs.push(Alloc {
                            t0: 0,
                            t1: i as u32,
                            y: 0,
                            size_bytes: e.size_bytes,
                            addr: e.addr,
                            stack: e.stack,
                            site,
                            category: 5,
                            before_history: true,
                        });
                    }
                },
                Action::Oom => ooms.push(OomEvent {
                    event: i as u32,
                    time_us: e.time_us,
                    requested_bytes: e.size_bytes,
                    device_free_bytes: snap.info(e).device_free_bytes,
                }),
                _ => {}
            }
        }
        for seg in snap.segments.iter().filter(|s| s.device == device as i64) {
            for b in seg.blocks.iter().filter(|b| b.state != BlockState::Inactive) {
                // Alive at the end but not by the trace: allocated before the recorded history.
                if !open.contains_key(&b.address) {
                    let (site, _) = info(b.stack, &snap);
                    allocs.push(Alloc {
                        t0: 0,
                        t1: ALIVE,
                        y: 0,
                        size_bytes: b.requested_bytes.max(1),
                        addr: b.address,
                        stack: b.stack,
                        site,
                        category: 5,
                        before_history: true,
                    });
                }
            }
        }
        allocs.sort_by_key(|a| (a.t0, !a.before_history));
        // Pass 2: packed offsets and the active level, in event order.
        let mut packer = Packer::default();
        // Which allocation each event frees (a free_completed frees one block).
        let mut freed_at = vec![u32::MAX; events as usize];
        for (k, a) in allocs.iter().enumerate() {
            if a.t1 != ALIVE {
                freed_at[a.t1 as usize] = k as u32;
            }
        }
        let mut active = vec![0u64; events as usize];
        let mut level: u64 = 0;
        let mut next = 0usize;
        let (mut peak, mut peak_event) = (0u64, 0u32);
        for t in 0..events {
            while next < allocs.len() && allocs[next].t0 == t {
                let a = &mut allocs[next];
                a.y = packer.take(a.size_bytes);
                level += a.size_bytes;
                next += 1;
            }
            // Then the event's free (after the placing: a block from before the history may be freed by
            // event 0, when it is placed).
            let k = freed_at[t as usize];
            if k != u32::MAX {
                let a = &allocs[k as usize];
                packer.give(a.y, a.size_bytes);
                level = level.saturating_sub(a.size_bytes);
            }
            active[t as usize] = level;
            if level > peak {
                peak = level;
                peak_event = t;
            }
        }
        let annotations = if time_us.is_empty() { Vec::new() } else { annotation_spans(&snap, device, &time_us) };
        // The bands, levels and segment events hold what the viewer needs of the trace: free it.
        let mut snap = snap;
        snap.device_traces = Vec::new();
        Trace {
            layout_bytes: packer.top.max(1),
            segment_events,
            snap,
            device,
            allocs,
            events,
            active_bytes: active,
            peak_bytes: peak,
            peak_event,
            sites: sites_v,
            ooms,
            time_us,
            annotations,
        }
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
                || site_hit.get(a.site as usize) == Some(&true);
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
        let (Some(&first), Some(&last)) = (self.time_us.first(), self.time_us.last()) else { return 0 };
        let n = self.time_us.len();
        let event_at = |t: i64| self.time_us.partition_point(|&x| x < t).min(n - 1) as u32;
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
        for a in self.allocs.iter().filter(|a| a.t0 <= t && (a.t1 == ALIVE || a.t1 > t)) {
            let e = out.entry(self.sites.get(a.site as usize).cloned().unwrap_or_default()).or_default();
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
        for a in self.allocs.iter().filter(|a| a.t0 <= t && (a.t1 == ALIVE || a.t1 > t)) {
            let path = paths.entry(a.stack).or_insert_with(|| {
                let frames = self.snap.stack(a.stack);
                let py: Vec<String> = frames
                    .iter()
                    .rev()
                    .filter(|&&f| self.snap.str(self.snap.frames[f as usize].filename).ends_with(".py"))
                    .map(|&f| self.snap.frame_text(f))
                    .collect();
                if py.is_empty() {
                    vec![self.sites.get(a.site as usize).cloned().unwrap_or_default()]
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
