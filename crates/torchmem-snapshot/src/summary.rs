//! The snapshot summary: per-device totals now (from segments) and at the traced peak (from the
//! trace), fragmentation per segment, counts of each trace action, whether the ring buffer wrapped
//! and how much history is missing, OOM events and allocator settings; plus its text rendering.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::fmt::{bytes, pct, since_start};
use crate::model::*;
use crate::replay::{replay, DevicePeak};

/// Fragmentation of one segment.
#[derive(Debug, Clone, Serialize)]
pub struct SegmentInfo {
    pub device: i64,
    pub address: u64,
    pub segment_type: String,
    pub stream: i64,
    pub pool_id: (i64, i64),
    pub is_expandable: bool,
    pub total_bytes: u64,
    pub allocated_bytes: u64,
    pub active_bytes: u64,
    pub requested_bytes: u64,
    /// Inactive bytes inside a segment that also holds active blocks (PyTorch's inactive_split).
    pub inactive_split_bytes: u64,
    pub largest_free_block_bytes: u64,
    pub blocks: usize,
}

/// An `oom` trace entry.
#[derive(Debug, Clone, Serialize)]
pub struct OomEvent {
    pub size_bytes: u64,
    pub device_free_bytes: Option<u64>,
    pub time_us: i64,
}

/// What is known about history lost before the first recorded event.
#[derive(Debug, Clone, Serialize)]
pub struct History {
    /// true/false when the snapshot says so (`trace_alloc_overflowed`), else a best guess or null.
    pub wrapped: Option<bool>,
    pub max_entries: Option<u64>,
    pub frees_without_alloc: u64,
    pub frees_without_alloc_bytes: u64,
    pub live_without_alloc: u64,
    pub live_without_alloc_bytes: u64,
    pub note: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct DeviceSummary {
    pub device: usize,
    pub segments: usize,
    pub reserved_bytes: u64,
    pub allocated_bytes: u64,
    pub active_bytes: u64,
    pub requested_bytes: u64,
    /// reserved − allocated: what the OOM message calls "reserved by PyTorch but unallocated".
    pub reserved_unallocated_bytes: u64,
    pub inactive_split_bytes: u64,
    pub largest_free_block_bytes: u64,
    pub blocks_allocated: usize,
    pub blocks_pending_free: usize,
    pub blocks_inactive: usize,
    pub trace_entries: usize,
    pub first_time_us: Option<i64>,
    pub last_time_us: Option<i64>,
    /// Requested bytes alive at the traced peak / at the end, replaying the trace.
    pub peak_requested_bytes: u64,
    pub peak_time_us: Option<i64>,
    pub peak_index: Option<usize>,
    pub end_requested_bytes: u64,
    pub history: History,
    pub ooms: Vec<OomEvent>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub devices: Vec<DeviceSummary>,
    pub action_counts: BTreeMap<String, u64>,
    pub segments: Vec<SegmentInfo>,
    pub unique_frames: usize,
    pub unique_stacks: usize,
    pub trace_entries: usize,
    pub allocator_settings: serde_json::Map<String, serde_json::Value>,
    pub annotations: usize,
}

fn segment_info(s: &Segment) -> SegmentInfo {
    let mut allocated = 0u64;
    let mut active = 0u64;
    let mut requested = 0u64;
    let mut inactive = 0u64;
    let mut largest_free = 0u64;
    for b in &s.blocks {
        match b.state {
            BlockState::ActiveAllocated => {
                allocated += b.size_bytes;
                active += b.size_bytes;
                requested += b.requested_bytes;
            }
            BlockState::ActivePendingFree => {
                active += b.size_bytes;
                requested += b.requested_bytes;
            }
            BlockState::Inactive => {
                inactive += b.size_bytes;
                largest_free = largest_free.max(b.size_bytes);
            }
        }
    }
    // A segment with no active block is one free (releasable) block, not a split.
    let inactive_split = if active > 0 { inactive } else { 0 };
    SegmentInfo {
        device: s.device,
        address: s.address,
        segment_type: s.segment_type.clone(),
        stream: s.stream,
        pool_id: s.pool_id,
        is_expandable: s.is_expandable,
        total_bytes: s.total_bytes,
        allocated_bytes: allocated,
        active_bytes: active,
        requested_bytes: requested,
        inactive_split_bytes: inactive_split,
        largest_free_block_bytes: largest_free,
        blocks: s.blocks.len(),
    }
}

/// True for counts that look like a configured `max_entries` (1, 2, 5 × 10^k or a power of two).
fn round_count(n: usize) -> bool {
    if n < 10 {
        return false;
    }
    if n.is_power_of_two() {
        return true;
    }
    let mut m = n;
    while m % 10 == 0 {
        m /= 10;
    }
    matches!(m, 1 | 2 | 5)
}

/// Summarizes a snapshot.
pub fn summarize(snap: &Snapshot) -> Summary {
    let segments: Vec<SegmentInfo> = snap.segments.iter().map(segment_info).collect();
    let max_seg_dev = snap.segments.iter().map(|s| s.device.max(0) as usize + 1).max().unwrap_or(0);
    let n_dev = max_seg_dev.max(snap.device_traces.len());
    let mut by_action = [0u64; Action::ALL.len()];
    for t in snap.device_traces.iter().flatten() {
        by_action[t.action() as usize] += 1;
    }
    let action_counts: BTreeMap<String, u64> =
        Action::ALL.iter().zip(by_action).filter(|(_, n)| *n > 0).map(|(a, n)| (a.name().to_string(), n)).collect();
    let overflowed = snap.allocator_settings.get("trace_alloc_overflowed").and_then(|v| v.as_bool());
    let max_entries = snap.allocator_settings.get("trace_alloc_max_entries").and_then(|v| v.as_u64());
    let mut devices = Vec::new();
    for d in 0..n_dev {
        let segs: Vec<&SegmentInfo> = segments.iter().filter(|s| s.device == d as i64).collect();
        let trace = snap.device_traces.get(d).map(Vec::as_slice).unwrap_or(&[]);
        if segs.is_empty() && trace.is_empty() {
            continue;
        }
        let mut blocks = (0, 0, 0);
        for s in snap.segments.iter().filter(|s| s.device == d as i64) {
            for b in &s.blocks {
                match b.state {
                    BlockState::ActiveAllocated => blocks.0 += 1,
                    BlockState::ActivePendingFree => blocks.1 += 1,
                    BlockState::Inactive => blocks.2 += 1,
                }
            }
        }
        let r = replay(snap, d);
        let reserved: u64 = segs.iter().map(|s| s.total_bytes).sum();
        let allocated: u64 = segs.iter().map(|s| s.allocated_bytes).sum();
        let wrapped = match overflowed {
            Some(v) => Some(v),
            None if r.frees_without_alloc > 0 && round_count(trace.len()) => Some(true),
            None if trace.is_empty() => None,
            None if r.frees_without_alloc == 0 && r.live_without_alloc == 0 => Some(false),
            None => None,
        };
        let note = match wrapped {
            Some(true) => format!(
                "the ring buffer wrapped: {} trace entries kept{}; {} frees ({}) and {} live blocks ({}) have no recorded alloc. Raise max_entries to keep more",
                trace.len(),
                max_entries.map(|m| format!(" (max_entries={m})")).unwrap_or_default(),
                r.frees_without_alloc,
                bytes(r.frees_without_alloc_bytes),
                r.live_without_alloc,
                bytes(r.live_without_alloc_bytes)
            ),
            Some(false) => "complete: every freed or live block has its alloc in the trace".to_string(),
            None if trace.is_empty() => "no trace recorded (record with _record_memory_history(enabled='all'))".to_string(),
            None => format!(
                "{} frees ({}) and {} live blocks ({}) were allocated before the first recorded event: recording started after them, or the ring buffer wrapped",
                r.frees_without_alloc,
                bytes(r.frees_without_alloc_bytes),
                r.live_without_alloc,
                bytes(r.live_without_alloc_bytes)
            ),
        };
        let ooms = trace
            .iter()
            .filter(|t| t.action() == Action::Oom)
            .map(|t| OomEvent {
                size_bytes: t.size_bytes,
                device_free_bytes: snap.info(t).device_free_bytes,
                time_us: t.time_us,
            })
            .collect();
        devices.push(DeviceSummary {
            device: d,
            segments: segs.len(),
            reserved_bytes: reserved,
            allocated_bytes: allocated,
            active_bytes: segs.iter().map(|s| s.active_bytes).sum(),
            requested_bytes: segs.iter().map(|s| s.requested_bytes).sum(),
            reserved_unallocated_bytes: reserved.saturating_sub(allocated),
            inactive_split_bytes: segs.iter().map(|s| s.inactive_split_bytes).sum(),
            largest_free_block_bytes: segs.iter().map(|s| s.largest_free_block_bytes).max().unwrap_or(0),
            blocks_allocated: blocks.0,
            blocks_pending_free: blocks.1,
            blocks_inactive: blocks.2,
            trace_entries: trace.len(),
            first_time_us: trace.first().map(|t| t.time_us),
            last_time_us: trace.last().map(|t| t.time_us),
            peak_requested_bytes: r.peak_bytes,
            peak_time_us: r.peak_time_us,
            peak_index: r.peak_index,
            end_requested_bytes: r.end_bytes,
            history: History {
                wrapped,
                max_entries,
                frees_without_alloc: r.frees_without_alloc,
                frees_without_alloc_bytes: r.frees_without_alloc_bytes,
                live_without_alloc: r.live_without_alloc,
                live_without_alloc_bytes: r.live_without_alloc_bytes,
                note,
            },
            ooms,
        });
    }
    Summary {
        devices,
        action_counts,
        segments,
        unique_frames: snap.frames.len(),
        unique_stacks: snap.stacks.len(),
        trace_entries: snap.trace_entries(),
        allocator_settings: snap.allocator_settings.clone(),
        annotations: snap.annotations.len(),
    }
}

impl Summary {
    /// Each device's traced peak (what `sites::top_sites` and the page look at).
    pub fn peaks(&self) -> Vec<DevicePeak> {
        self.devices
            .iter()
            .map(|d| DevicePeak { device: d.device, index: d.peak_index, time_us: d.peak_time_us })
            .collect()
    }
}

/// Renders the summary as text (`torchmem snapshot FILE`).
pub fn render_text(s: &Summary, name: &str) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "Allocator snapshot {name}");
    let _ = writeln!(
        o,
        "  {} segments, {} trace entries, {} unique frames in {} unique stacks",
        s.segments.len(),
        s.trace_entries,
        s.unique_frames,
        s.unique_stacks
    );
    for d in &s.devices {
        let _ = writeln!(o, "\nDevice {}", d.device);
        let _ = writeln!(
            o,
            "  now (segments)     reserved {:>12}  allocated {:>12}  active {:>12}  requested {:>12}",
            bytes(d.reserved_bytes),
            bytes(d.allocated_bytes),
            bytes(d.active_bytes),
            bytes(d.requested_bytes)
        );
        let _ = writeln!(
            o,
            "  reserved but unallocated {} ({:.1}% of reserved); inactive split {}; largest free block {}",
            bytes(d.reserved_unallocated_bytes),
            pct(d.reserved_unallocated_bytes, d.reserved_bytes),
            bytes(d.inactive_split_bytes),
            bytes(d.largest_free_block_bytes)
        );
        let _ = writeln!(
            o,
            "  blocks: {} allocated, {} pending free, {} inactive",
            d.blocks_allocated, d.blocks_pending_free, d.blocks_inactive
        );
        if d.trace_entries > 0 {
            let span_ms = match (d.first_time_us, d.last_time_us) {
                (Some(a), Some(b)) => (b - a) as f64 / 1000.0,
                _ => 0.0,
            };
            let _ = writeln!(
                o,
                "  trace: {} entries over {:.1} ms (times below are since its first entry)",
                d.trace_entries, span_ms
            );
            let start = d.first_time_us.unwrap_or(0);
            let _ = writeln!(
                o,
                "  traced peak {} requested at {} (entry {}); at the end {}",
                bytes(d.peak_requested_bytes),
                d.peak_time_us.map(|t| since_start(t, start)).unwrap_or_else(|| "the start".into()),
                d.peak_index.map(|i| i.to_string()).unwrap_or_else(|| "-".into()),
                bytes(d.end_requested_bytes)
            );
        }
        let _ = writeln!(o, "  history: {}", d.history.note);
        for oom in &d.ooms {
            let _ = writeln!(
                o,
                "  OOM at {}: tried to allocate {} with {} free on the device",
                since_start(oom.time_us, d.first_time_us.unwrap_or(oom.time_us)),
                bytes(oom.size_bytes),
                oom.device_free_bytes.map(bytes).unwrap_or_else(|| "?".into())
            );
        }
    }
    if !s.action_counts.is_empty() {
        let _ = writeln!(o, "\nTrace actions");
        for (a, n) in &s.action_counts {
            let _ = writeln!(o, "  {a:<16} {n:>10}");
        }
    }
    let mut frag: Vec<&SegmentInfo> = s.segments.iter().filter(|g| g.inactive_split_bytes > 0).collect();
    frag.sort_by_key(|g| std::cmp::Reverse(g.inactive_split_bytes));
    if !frag.is_empty() {
        let _ = writeln!(
            o,
            "\nMost fragmented segments (inactive split bytes; {} of {} segments have some)",
            frag.len(),
            s.segments.len()
        );
        let _ = writeln!(
            o,
            "  {:>18} {:>6} {:>12} {:>12} {:>12} {:>12} {:>6}",
            "address", "type", "total", "allocated", "inactive", "largest free", "blocks"
        );
        for g in frag.iter().take(10) {
            let _ = writeln!(
                o,
                "  {:>#18x} {:>6} {:>12} {:>12} {:>12} {:>12} {:>6}",
                g.address,
                g.segment_type,
                bytes(g.total_bytes),
                bytes(g.allocated_bytes),
                bytes(g.inactive_split_bytes),
                bytes(g.largest_free_block_bytes),
                g.blocks
            );
        }
    }
    if !s.allocator_settings.is_empty() {
        let _ = writeln!(o, "\nAllocator settings");
        for (k, v) in &s.allocator_settings {
            if k == "roundup_power2_divisions" {
                let nonzero = v.as_object().map(|m| m.values().any(|x| x.as_i64().unwrap_or(0) != 0)).unwrap_or(false);
                if !nonzero {
                    let _ = writeln!(o, "  {k:<36} (all 0)");
                    continue;
                }
            }
            let _ = writeln!(o, "  {k:<36} {v}");
        }
    }
    o
}
