//! Trace replay: walks a device's allocator trace event by event and tracks which blocks are alive and
//! how many requested bytes that makes. Everything that needs "what was alive when" builds on this: the
//! traced peak (`summary`), the live blocks at a moment (`sites`, `html`) and, later, the allocator
//! simulator. Levels are the requested bytes the trace records (`alloc` adds, `free_completed` removes);
//! blocks allocated before the recorded history are recognised from frees without an alloc and from
//! end-state blocks (`segments`) that no recorded alloc explains.
//!
//! Layering: `model` ← `replay` ← {`summary`, `sites`} ← {`diff`, `html`, text rendering}.

use std::collections::HashMap;

use crate::model::*;

/// A block alive at some moment of the replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveBlock {
    pub addr: u64,
    pub size_bytes: u64,
    pub stack: StackId,
    /// True when the block was allocated before the recorded history (its stack may be the free's).
    pub before_history: bool,
}

/// What one trace entry did to the live set ([`LiveSet::apply`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// An `alloc`: the block is alive now.
    Alloc { addr: u64, size_bytes: u64, stack: StackId },
    /// A `free_completed` of a block the replay saw allocated (`block` is that allocation).
    Free { block: LiveBlock },
    /// A `free_completed` of a block allocated before the recorded history (size as the free records it).
    FreeWithoutAlloc { addr: u64, size_bytes: u64 },
    /// Any other action (segment events, `free_requested`, markers, `oom`): levels do not change.
    None,
}

/// The blocks alive while a trace is replayed, keyed by address, and their requested bytes.
///
/// Feed it a device's entries in order with [`LiveSet::apply`]. `current_bytes` starts at 0 and goes
/// below 0 when blocks allocated before the history are freed; add [`Replay::base_bytes`] for the true
/// level. The simulator extends this by keeping its own pool state next to the live set.
#[derive(Debug, Default, Clone)]
pub struct LiveSet {
    live: HashMap<u64, (u64, StackId), FxBuild>,
    /// Requested bytes of the recorded allocs still alive, minus the frees without a recorded alloc.
    pub current_bytes: i128,
}

impl LiveSet {
    pub fn new() -> Self {
        LiveSet::default()
    }

    /// Applies one trace entry.
    pub fn apply(&mut self, e: &TraceEntry) -> Change {
        match e.action() {
            Action::Alloc => {
                self.live.insert(e.addr, (e.size_bytes, e.stack));
                self.current_bytes += e.size_bytes as i128;
                Change::Alloc { addr: e.addr, size_bytes: e.size_bytes, stack: e.stack }
            }
            Action::FreeCompleted => match self.live.remove(&e.addr) {
                Some((size_bytes, stack)) => {
                    self.current_bytes -= size_bytes as i128;
                    Change::Free { block: LiveBlock { addr: e.addr, size_bytes, stack, before_history: false } }
                }
                None => {
                    self.current_bytes -= e.size_bytes as i128;
                    Change::FreeWithoutAlloc { addr: e.addr, size_bytes: e.size_bytes }
                }
            },
            _ => Change::None,
        }
    }

    /// Starts the replay with a block already alive (e.g. one of `live_at(snap, d, None)`, allocated before
    /// the recorded history): its bytes count in `current_bytes`, and its free becomes a [`Change::Free`].
    pub fn seed(&mut self, b: LiveBlock) {
        self.live.insert(b.addr, (b.size_bytes, b.stack));
        self.current_bytes += b.size_bytes as i128;
    }

    /// Whether a block allocated in the replay (or seeded) is alive at `addr`.
    pub fn contains(&self, addr: u64) -> bool {
        self.live.contains_key(&addr)
    }

    /// Number of blocks alive (allocated in the replay).
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// The blocks alive (allocated in the replay), by address.
    pub fn blocks(&self) -> Vec<LiveBlock> {
        let mut out: Vec<LiveBlock> = self
            .live
            .iter()
            .map(|(&addr, &(size_bytes, stack))| LiveBlock { addr, size_bytes, stack, before_history: false })
            .collect();
        out.sort_unstable_by_key(|b| b.addr);
        out
    }
}

/// The traced peak of one device: what `top_sites` and the page need to look at the peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevicePeak {
    pub device: usize,
    /// Position in the device trace after which the peak holds (`None`: before any event).
    pub index: Option<usize>,
    pub time_us: Option<i64>,
}

/// The outcome of replaying one device's trace.
#[derive(Debug, Clone, Default)]
pub struct Replay {
    /// Requested bytes alive before the first recorded event (blocks allocated before history).
    pub base_bytes: u64,
    /// Requested bytes alive at the traced peak, and where it happened.
    pub peak_bytes: u64,
    /// Position in the device trace after which the peak holds (`None`: before any event).
    pub peak_index: Option<usize>,
    pub peak_time_us: Option<i64>,
    pub end_bytes: u64,
    /// Frees (free_completed) of blocks whose alloc is not in the trace.
    pub frees_without_alloc: u64,
    pub frees_without_alloc_bytes: u64,
    /// Blocks alive at the end whose alloc is not in the trace.
    pub live_without_alloc: u64,
    pub live_without_alloc_bytes: u64,
}

/// Device `device`'s trace entries, in order (empty when it has none).
pub fn device_trace(snap: &Snapshot, device: usize) -> &[TraceEntry] {
    snap.device_traces.get(device).map(Vec::as_slice).unwrap_or(&[])
}

/// Device `device`'s trace entries, in order.
pub fn device_entries(snap: &Snapshot, device: usize) -> impl Iterator<Item = &TraceEntry> + '_ {
    device_trace(snap, device).iter()
}

/// The blocks that are not free at the end (the dump's segments) on one device.
pub fn end_blocks(snap: &Snapshot, device: usize) -> impl Iterator<Item = &Block> {
    snap.segments
        .iter()
        .filter(move |s| s.device == device as i64)
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.state != BlockState::Inactive)
}

/// Replays device `device`'s trace once.
pub fn replay(snap: &Snapshot, device: usize) -> Replay {
    let mut live = LiveSet::new();
    let mut r = Replay::default();
    let mut max_cur: i128 = 0;
    let mut max_at: Option<usize> = None;
    for (i, e) in device_entries(snap, device).enumerate() {
        match live.apply(e) {
            Change::None => continue,
            Change::FreeWithoutAlloc { size_bytes, .. } => {
                r.frees_without_alloc += 1;
                r.frees_without_alloc_bytes += size_bytes;
            }
            Change::Alloc { .. } | Change::Free { .. } => {}
        }
        let cur = live.current_bytes;
        if cur > max_cur || max_at.is_none() && cur >= max_cur {
            max_cur = cur;
            max_at = Some(i);
        }
    }
    for b in end_blocks(snap, device) {
        if !live.contains(b.address) {
            r.live_without_alloc += 1;
            r.live_without_alloc_bytes += b.requested_bytes;
        }
    }
    r.base_bytes = r.frees_without_alloc_bytes + r.live_without_alloc_bytes;
    // The lowest point of the level may be below zero if frees of pre-history blocks come first.
    let base = r.base_bytes as i128;
    r.end_bytes = (base + live.current_bytes).max(0) as u64;
    if max_cur <= 0 {
        r.peak_bytes = r.base_bytes;
        r.peak_index = None;
    } else {
        r.peak_bytes = (base + max_cur) as u64;
        r.peak_index = max_at;
        r.peak_time_us = max_at.map(|i| device_trace(snap, device)[i].time_us);
    }
    r
}

/// Blocks alive right after position `upto` of the device trace (`None`: before any event): the
/// blocks allocated in the trace by then (by address), then the blocks allocated before the recorded
/// history that are still alive then (freed later, in trace order, then alive at the end, in segment order).
pub fn live_at(snap: &Snapshot, device: usize, upto: Option<usize>) -> Vec<LiveBlock> {
    let mut live = LiveSet::new();
    // Per address: allocated inside the trace (to tell pre-history blocks apart), and alive at the end
    // of the trace (end-state blocks not alive then predate the history, as in `replay`). One map, one
    // lookup per event.
    const SEEN: u8 = 1;
    const LIVE_END: u8 = 2;
    let mut state: HashMap<u64, u8, FxBuild> = HashMap::default();
    let mut ghosts: Vec<LiveBlock> = Vec::new();
    for (i, e) in device_entries(snap, device).enumerate() {
        let before = upto.is_some_and(|u| i <= u);
        match e.action() {
            Action::Alloc => {
                *state.entry(e.addr).or_insert(0) = SEEN | LIVE_END;
                if before {
                    live.apply(e);
                }
            }
            Action::FreeCompleted => {
                let st = state.entry(e.addr).or_insert(0);
                let had_alloc = *st & SEEN != 0;
                *st = SEEN;
                if before {
                    live.apply(e);
                } else if !had_alloc {
                    // allocated before the recorded history and still alive at `upto`.
                    ghosts.push(LiveBlock {
                        addr: e.addr,
                        size_bytes: e.size_bytes,
                        stack: e.stack,
                        before_history: true,
                    });
                }
            }
            _ => {}
        }
    }
    let alive_at_end = |addr: u64| state.get(&addr).is_some_and(|s| s & LIVE_END != 0);
    for b in end_blocks(snap, device) {
        if !alive_at_end(b.address) {
            ghosts.push(LiveBlock {
                addr: b.address,
                size_bytes: b.requested_bytes,
                stack: b.stack,
                before_history: true,
            });
        }
    }
    // `live` was only fed the entries up to `upto`.
    let mut out = live.blocks();
    out.extend(ghosts);
    out
}

/// Position of the last event at or before `time_us` in a device trace (`None`: before the first).
pub fn index_at_time(snap: &Snapshot, device: usize, time_us: i64) -> Option<usize> {
    let mut found = None;
    for (i, e) in device_entries(snap, device).enumerate() {
        if e.time_us <= time_us {
            found = Some(i);
        } else {
            break;
        }
    }
    found
}

/// First and last `time_us` of a device's trace (`None` when it has no entries).
pub fn time_range_us(snap: &Snapshot, device: usize) -> Option<(i64, i64)> {
    let t = device_trace(snap, device);
    Some((t.first()?.time_us, t.last()?.time_us))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(action: Action, addr: u64, size_bytes: u64, time_us: i64) -> TraceEntry {
        TraceEntry::new(action, addr, size_bytes, time_us, NO_STACK, 0)
    }

    fn snap_of(entries: Vec<TraceEntry>, end_blocks: Vec<Block>) -> Snapshot {
        Snapshot {
            device_traces: vec![entries],
            entry_infos: vec![EntryInfo::default()],
            segments: vec![Segment {
                device: 0,
                address: 0,
                total_bytes: 1 << 20,
                allocated_bytes: 0,
                active_bytes: 0,
                requested_bytes: 0,
                stream: 0,
                segment_type: "large".into(),
                pool_id: (0, 0),
                is_expandable: false,
                blocks: end_blocks,
            }],
            ..Default::default()
        }
    }

    fn block(address: u64, size: u64) -> Block {
        Block { address, size_bytes: size, requested_bytes: size, state: BlockState::ActiveAllocated, stack: NO_STACK }
    }

    #[test]
    fn peak_end_and_history_gaps() {
        use Action::*;
        // 0x10 freed without alloc (pre-history, 100 B); 0x40 alive at the end without alloc (7 B).
        let s = snap_of(
            vec![
                entry(Alloc, 0x20, 300, 10),
                entry(FreeCompleted, 0x10, 100, 11),
                entry(Alloc, 0x30, 50, 12),
                entry(FreeRequested, 0x20, 300, 13),
                entry(FreeCompleted, 0x20, 300, 14),
            ],
            vec![block(0x30, 50), block(0x40, 7)],
        );
        let r = replay(&s, 0);
        assert_eq!((r.frees_without_alloc, r.frees_without_alloc_bytes), (1, 100));
        assert_eq!((r.live_without_alloc, r.live_without_alloc_bytes), (1, 7));
        assert_eq!(r.base_bytes, 107);
        // Levels: 107 → 407 (peak at entry 0) → 307 → 357 → 357 → 57.
        assert_eq!((r.peak_bytes, r.peak_index, r.peak_time_us), (407, Some(0), Some(10)));
        assert_eq!(r.end_bytes, 57);
        // At the peak: the 300 B block, then the pre-history ones (the freed one, then the end one).
        let at_peak = live_at(&s, 0, Some(0));
        let got: Vec<(u64, u64, bool)> = at_peak.iter().map(|b| (b.addr, b.size_bytes, b.before_history)).collect();
        assert_eq!(got, vec![(0x20, 300, false), (0x10, 100, true), (0x40, 7, true)]);
        let at_start: u64 = live_at(&s, 0, None).iter().map(|b| b.size_bytes).sum();
        assert_eq!(at_start, r.base_bytes);
        let at_end: u64 = live_at(&s, 0, Some(4)).iter().map(|b| b.size_bytes).sum();
        assert_eq!(at_end, r.end_bytes);
        assert_eq!(index_at_time(&s, 0, 9), None);
        assert_eq!(index_at_time(&s, 0, 12), Some(2));
        assert_eq!(index_at_time(&s, 0, 99), Some(4));
        assert_eq!(time_range_us(&s, 0), Some((10, 14)));
        assert_eq!(time_range_us(&s, 1), None);
    }

    #[test]
    fn live_set_reports_each_change() {
        let mut l = LiveSet::new();
        assert_eq!(l.apply(&entry(Action::Alloc, 1, 8, 0)), Change::Alloc { addr: 1, size_bytes: 8, stack: NO_STACK });
        assert_eq!(l.apply(&entry(Action::SegmentAlloc, 0, 1 << 20, 0)), Change::None);
        assert_eq!(
            l.apply(&entry(Action::FreeCompleted, 2, 4, 0)),
            Change::FreeWithoutAlloc { addr: 2, size_bytes: 4 }
        );
        assert_eq!(l.current_bytes, 4);
        assert!(l.contains(1) && l.len() == 1);
        assert!(
            matches!(l.apply(&entry(Action::FreeCompleted, 1, 8, 0)), Change::Free { block } if block.size_bytes == 8)
        );
        assert!(l.is_empty() && l.current_bytes == -4);
    }

    #[test]
    fn peak_before_any_event_when_levels_only_fall() {
        let s = snap_of(vec![entry(Action::FreeCompleted, 0x10, 64, 5)], vec![]);
        let r = replay(&s, 0);
        assert_eq!((r.peak_bytes, r.peak_index, r.end_bytes), (64, None, 0));
    }
}
