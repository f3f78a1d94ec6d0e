//! The allocator's state at the trace's first entry, for traces that do not start from an empty allocator
//! (history switched on late, ring buffer wrapped): walk the trace backwards from the dump's segments and
//! blocks, as memory_viz does, then lay each segment out as live blocks with the free space between them
//! merged (torch never leaves two adjacent free blocks unmerged). Blocks freed during the trace but
//! allocated before it have no recorded block size: it is inferred from the recorded settings' rules.

use std::collections::HashMap;

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
    let mut expandable_bytes: i128 = 0;
    for s in snap.segments.iter().filter(|s| s.device == device) {
        if s.is_expandable {
            expandable_bytes += s.total_bytes as i128;
            continue;
        }
        segments.insert(
            s.address,
            StartSegment {
                addr: s.address,
                size_bytes: s.total_bytes,
                stream: s.stream,
                small: s.segment_type == "small",
            },
        );
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
                    },
                );
            }
            Action::SegmentMap => expandable_bytes -= e.size_bytes as i128,
            Action::SegmentUnmap => expandable_bytes += e.size_bytes as i128,
            _ => {}
        }
    }
    if expandable_bytes > 0 {
        return Err(format!(
            "device {device}: the trace starts with {expandable_bytes} bytes of expandable segments already mapped \
             (history was switched on late); their layout cannot be reconstructed. Record with \
             torch.cuda.memory._record_memory_history() before the first allocation"
        ));
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
    Ok(StartState { segments: segs, blocks, inferred_sizes: inferred })
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
