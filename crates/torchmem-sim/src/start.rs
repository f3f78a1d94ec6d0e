//! The allocator's state at the trace's first entry, for traces that do not start from an empty allocator
//! (history switched on late, ring buffer wrapped): walk the trace backwards from the dump's segments and
//! blocks, as memory_viz does, then lay each segment out as live blocks with the free space between them
//! merged (torch never leaves two adjacent free blocks unmerged). Blocks freed during the trace but
//! allocated before it have no recorded block size: it is inferred from the recorded settings' rules.
//!
//! Expandable segments mapped before the trace: the dump lists each contiguous mapped range of a
//! reservation (one reservation per stream and pool); walking the trace's maps and unmaps backwards gives
//! the ranges mapped at its start. The reservation's base is the lowest address seen in it (the first
//! mapping starts at the base), its size 9/8 of the device's memory, as torch reserves it.

use std::collections::{BTreeMap, HashMap};

use torchmem_snapshot::model::{Action, BlockState, Snapshot};

use crate::config::AllocConf;
use crate::replay::Entry;
use crate::rounding::{is_small, round_size, SMALL_BUFFER_BYTES, SMALL_SIZE_BYTES};

#[derive(Debug, Clone, PartialEq)]
pub struct StartSegment {
    pub addr: u64,
    pub size_bytes: u64,
    pub stream: i64,
    pub small: bool,
    /// A mapped range of an expandable segment (its reservation is in `StartState::reservations`).
    pub expandable: bool,
}

/// An expandable segment's reservation with pages mapped at the trace's start.
#[derive(Debug, Clone, PartialEq)]
pub struct StartReservation {
    pub stream: i64,
    pub small: bool,
    /// The lowest address seen in it (dump or trace): where its first mapping began.
    pub base: u64,
    /// The highest end seen in it.
    pub end_seen: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StartBlock {
    pub addr: u64,
    pub size_bytes: u64,
    pub requested_bytes: u64,
    pub stream: i64,
    /// Freed by the program, its free not yet completed.
    pub pending: bool,
}

#[derive(Debug, Clone, Default)]
pub struct StartState {
    pub segments: Vec<StartSegment>,
    /// Per segment (same order), its live blocks by address.
    pub blocks: Vec<Vec<StartBlock>>,
    /// Blocks whose size was inferred rather than read from the dump.
    pub inferred_sizes: usize,
    /// Expandable reservations with pages mapped at the start (their mapped ranges are in `segments`).
    pub reservations: Vec<StartReservation>,
}

impl StartState {
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }
    pub fn reserved_bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.size_bytes).sum()
    }
}

#[derive(Clone)]
struct Live {
    requested_bytes: u64,
    size_bytes: Option<u64>,
    stream: i64,
    pending: bool,
}

/// Reconstructs the state before `entries[0]` of `device`. Errors name what cannot be reconstructed.
pub fn reconstruct(
    snap: &Snapshot,
    device: i64,
    entries: &[Entry],
    recorded: &AllocConf,
) -> Result<StartState, String> {
    let mut segments: HashMap<u64, StartSegment> = HashMap::new();
    let mut live: HashMap<u64, Live> = HashMap::new();
    // Expandable: per (stream, small pool) the mapped ranges (start -> end) and the address hull seen.
    let mut mapped: BTreeMap<(i64, bool), BTreeMap<u64, u64>> = BTreeMap::new();
    let mut hull: BTreeMap<(i64, bool), (u64, u64)> = BTreeMap::new();
    for s in snap.segments.iter().filter(|s| s.device == device) {
        let small = s.segment_type == "small";
        if s.is_expandable {
            let group = (s.stream, small);
            add_range(mapped.entry(group).or_default(), s.address, s.address + s.total_bytes);
            let h = hull.entry(group).or_insert((s.address, s.address + s.total_bytes));
            *h = (h.0.min(s.address), h.1.max(s.address + s.total_bytes));
        } else {
            segments.insert(
                s.address,
                StartSegment { addr: s.address, size_bytes: s.total_bytes, stream: s.stream, small, expandable: false },
            );
        }
        for b in &s.blocks {
            let pending = match b.state {
                BlockState::ActiveAllocated => false,
                BlockState::ActivePendingFree => true,
                BlockState::Inactive => continue,
            };
            live.insert(
                b.address,
                Live { requested_bytes: b.requested_bytes, size_bytes: Some(b.size_bytes), stream: s.stream, pending },
            );
        }
    }
    for e in entries.iter().rev() {
        match e.action {
            Action::Alloc => {
                live.remove(&e.addr);
            }
            Action::FreeCompleted => {
                live.insert(
                    e.addr,
                    Live { requested_bytes: e.size_bytes, size_bytes: None, stream: e.stream, pending: true },
                );
            }
            Action::FreeRequested => {
                live.entry(e.addr)
                    .or_insert(Live {
                        requested_bytes: e.size_bytes,
                        size_bytes: None,
                        stream: e.stream,
                        pending: false,
                    })
                    .pending = false;
            }
            Action::SegmentAlloc => {
                segments.remove(&e.addr);
            }
            Action::SegmentFree => {
                segments.insert(
                    e.addr,
                    StartSegment {
                        addr: e.addr,
                        size_bytes: e.size_bytes,
                        stream: e.stream,
                        small: e.size_bytes == SMALL_BUFFER_BYTES,
                        expandable: false,
                    },
                );
            }
            Action::SegmentMap | Action::SegmentUnmap => {
                // The reservation it belongs to: the nearest one of its stream the dump shows.
                let end = e.addr + e.size_bytes;
                let group = hull
                    .iter()
                    .filter(|((stream, _), _)| *stream == e.stream)
                    .min_by_key(|(_, &(lo, hi))| if e.addr >= hi { e.addr - hi } else { lo.saturating_sub(e.addr) })
                    .map(|(g, _)| *g);
                match group {
                    Some(g) => {
                        let h = hull.get_mut(&g).expect("found above");
                        *h = (h.0.min(e.addr), h.1.max(end));
                        let ranges = mapped.entry(g).or_default();
                        if e.action == Action::SegmentMap {
                            remove_range(ranges, e.addr, end); // mapped in the trace: not before it
                        } else {
                            add_range(ranges, e.addr, end); // unmapped in the trace: mapped before it
                        }
                    }
                    // A map with no reservation in the dump was undone by the trace (all unmapped again);
                    // an unmap there means pages mapped at the start in a reservation the dump does not show.
                    None if e.action == Action::SegmentUnmap => {
                        return Err(format!(
                            "device {device}: the trace unmaps expandable-segment pages at {:#x} that were mapped \
                             before it, in a reservation the dump no longer shows; their layout cannot be \
                             reconstructed. Record with torch.cuda.memory._record_memory_history() before the first \
                             allocation",
                            e.addr
                        ));
                    }
                    None => {}
                }
            }
            _ => {}
        }
    }
    let mut reservations = Vec::new();
    for (&(stream, small), ranges) in &mapped {
        if ranges.is_empty() {
            continue; // nothing mapped at the start: the replay reserves it at its first map, as torch did
        }
        let (base, end_seen) = hull[&(stream, small)];
        reservations.push(StartReservation { stream, small, base, end_seen });
        for (&a, &b) in ranges {
            segments.insert(a, StartSegment { addr: a, size_bytes: b - a, stream, small, expandable: true });
        }
    }
    let mut segs: Vec<StartSegment> = segments.into_values().collect();
    segs.sort_by_key(|s| s.addr);
    let mut per_seg: Vec<Vec<(u64, Live)>> = vec![Vec::new(); segs.len()];
    let mut lives: Vec<(u64, Live)> = live.into_iter().collect();
    lives.sort_by_key(|(a, _)| *a);
    for (addr, l) in lives {
        let idx = segs.partition_point(|s| s.addr <= addr);
        let inside = idx > 0 && addr < segs[idx - 1].addr + segs[idx - 1].size_bytes;
        if !inside {
            return Err(format!(
                "device {device}: a block at {addr:#x} live at the trace's start lies in no segment; the snapshot \
                 is inconsistent (was it edited?)"
            ));
        }
        per_seg[idx - 1].push((addr, l));
    }
    let mut inferred = 0usize;
    let mut blocks = Vec::with_capacity(segs.len());
    for (seg, list) in segs.iter().zip(per_seg) {
        let end = seg.addr + seg.size_bytes;
        let mut out: Vec<StartBlock> = Vec::with_capacity(list.len());
        for i in 0..list.len() {
            let (addr, l) = &list[i];
            let next_start = list.get(i + 1).map(|(a, _)| *a).unwrap_or(end);
            let size = match l.size_bytes {
                Some(s) => s,
                None => {
                    inferred += 1;
                    infer_size(recorded, l.requested_bytes, next_start.saturating_sub(*addr))
                }
            };
            if addr + size > next_start {
                return Err(format!(
                    "device {device}: blocks at {addr:#x} and {next_start:#x} overlap at the trace's start; the \
                     snapshot is inconsistent"
                ));
            }
            out.push(StartBlock {
                addr: *addr,
                size_bytes: size,
                requested_bytes: l.requested_bytes,
                stream: l.stream,
                pending: l.pending,
            });
        }
        blocks.push(out);
    }
    Ok(StartState { segments: segs, blocks, inferred_sizes: inferred, reservations })
}

/// Adds `[a, b)` to a set of disjoint ranges (start -> end), merging what touches it.
fn add_range(ranges: &mut BTreeMap<u64, u64>, a: u64, b: u64) {
    let (mut lo, mut hi) = (a, b);
    let touching: Vec<(u64, u64)> = ranges.range(..=b).filter(|(_, &e)| e >= a).map(|(&s, &e)| (s, e)).collect();
    for (s, e) in touching {
        ranges.remove(&s);
        lo = lo.min(s);
        hi = hi.max(e);
    }
    ranges.insert(lo, hi);
}

/// Removes `[a, b)` from a set of disjoint ranges, splitting the ranges it cuts.
fn remove_range(ranges: &mut BTreeMap<u64, u64>, a: u64, b: u64) {
    let cut: Vec<(u64, u64)> = ranges.range(..b).filter(|(_, &e)| e > a).map(|(&s, &e)| (s, e)).collect();
    for (s, e) in cut {
        ranges.remove(&s);
        if s < a {
            ranges.insert(s, a);
        }
        if e > b {
            ranges.insert(b, e);
        }
    }
}

/// The block size a request got under the recorded settings, given the room up to the next live block:
/// the rounded size, plus the unsplit rest when the split rule kept it (≤ 1 MiB in the large pool).
fn infer_size(conf: &AllocConf, requested_bytes: u64, room_bytes: u64) -> u64 {
    let rounded = round_size(conf, requested_bytes);
    if is_small(rounded) || conf.expandable_segments || room_bytes < rounded {
        return rounded;
    }
    let rest = room_bytes - rounded;
    let kept = if rounded < conf.max_split_size_bytes {
        rest <= SMALL_SIZE_BYTES
    } else {
        rest < conf.max_non_split_rounding_bytes
    };
    if kept {
        room_bytes
    } else {
        rounded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inferred_sizes_follow_the_split_rule() {
        let c = AllocConf::default();
        let mb = 1 << 20;
        assert_eq!(infer_size(&c, 1000, 4096), 1024, "small pool: exact");
        assert_eq!(infer_size(&c, 3 * mb, 3 * mb + mb / 2), 3 * mb + mb / 2, "rest ≤ 1 MiB stays in the block");
        assert_eq!(infer_size(&c, 3 * mb, 5 * mb), 3 * mb, "rest > 1 MiB was split off");
    }
}
