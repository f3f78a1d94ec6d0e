//! The in-memory allocator snapshot: interned strings, frames and stacks, segments with their blocks,
//! and per-device trace entries. Memory scales with unique frames/stacks, not with references.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A small, fast, non-cryptographic hasher (FxHash) for the interners' keys.
#[derive(Default, Clone, Copy)]
pub struct FxHasher {
    hash: u64,
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.write_u64(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let mut rest = chunks.remainder();
        // Stacks are u32 frame ids: an odd count leaves 4 bytes, taken in one step.
        if rest.len() >= 4 {
            self.write_u64(u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as u64);
            rest = &rest[4..];
        }
        for &b in rest {
            self.write_u64(b as u64);
        }
    }
    fn write_u64(&mut self, i: u64) {
        self.hash = (self.hash.rotate_left(5) ^ i).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64);
    }
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
    fn finish(&self) -> u64 {
        // The product's low bits are poor for keys with zero low bits (block addresses are multiples of
        // 512), and the table indexes by the low bits: move the well-mixed high bits down.
        self.hash.rotate_left(26)
    }
}

pub type FxBuild = BuildHasherDefault<FxHasher>;

/// Index into `Snapshot::stacks`; `NO_STACK` when the event or block has no frames.
pub type StackId = u32;
pub const NO_STACK: StackId = u32::MAX;

/// One source frame (strings are ids into `Snapshot::strings`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Frame {
    pub filename: u32,
    pub name: u32,
    pub line: i64,
}

/// What a trace entry records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
    Snapshot,
    Oom,
    Annotate,
    Other,
}

impl Action {
    pub fn parse(s: &str) -> Action {
        match s {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "segment_map" => Action::SegmentMap,
            "segment_unmap" => Action::SegmentUnmap,
            "snapshot" => Action::Snapshot,
            "oom" => Action::Oom,
            "annotate" => Action::Annotate,
            _ => Action::Other,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Snapshot => "snapshot",
            Action::Oom => "oom",
            Action::Annotate => "annotate",
            Action::Other => "other",
        }
    }

    pub const ALL: [Action; 11] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Snapshot,
        Action::Oom,
        Action::Annotate,
        Action::Other,
    ];
}

/// Index into `Snapshot::entry_infos`.
pub type InfoId = u32;

/// Largest [`InfoId`]: distinct (stream, metadata, compile context, device_free) combinations a snapshot
/// may hold (real ones have a handful).
pub const MAX_INFO_ID: InfoId = (1 << 28) - 1;

/// One allocator event (`device_traces[d][i]`), 32 bytes: the fields every replay reads, plus the id of
/// its rarely varying rest ([`EntryInfo`], interned in `Snapshot::entry_infos`), so that a 10-million-entry
/// trace fits in a few hundred MB.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEntry {
    /// Block address (0 when the entry has none, e.g. `oom`).
    pub addr: u64,
    /// Requested bytes for alloc/free, segment bytes for segment_*, failed request for oom.
    pub size_bytes: u64,
    /// The entry's `time_us` (wall clock, Unix epoch microseconds).
    pub time_us: i64,
    pub stack: StackId,
    /// The action in the top 4 bits, the [`InfoId`] in the low 28.
    packed: u32,
}

impl TraceEntry {
    pub fn new(action: Action, addr: u64, size_bytes: u64, time_us: i64, stack: StackId, info: InfoId) -> Self {
        debug_assert!(info <= MAX_INFO_ID);
        TraceEntry { addr, size_bytes, time_us, stack, packed: (action as u32) << 28 | (info & MAX_INFO_ID) }
    }

    /// What the entry records.
    pub fn action(&self) -> Action {
        Action::ALL[((self.packed >> 28) as usize).min(Action::ALL.len() - 1)]
    }

    /// Id of the entry's [`EntryInfo`] (`Snapshot::info`).
    pub fn info(&self) -> InfoId {
        self.packed & MAX_INFO_ID
    }
}

/// The fields of a trace entry that take few distinct values: stream, `device_free`, `user_metadata` and
/// `compile_context`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct EntryInfo {
    /// The CUDA stream (`cudaStream_t` as an integer; 0 is the default stream).
    pub stream: i64,
    /// Free device bytes reported by an `oom` entry.
    pub device_free_bytes: Option<u64>,
    /// `user_metadata` string id (`_set_memory_metadata`); 0 is "".
    pub user_metadata: u32,
    /// `compile_context` string id; 0 is "".
    pub compile_context: u32,
}

/// Block state in a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    ActiveAllocated,
    ActivePendingFree,
    Inactive,
}

/// A block of a segment, as the dump saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Block {
    pub address: u64,
    pub size_bytes: u64,
    pub requested_bytes: u64,
    pub state: BlockState,
    pub stack: StackId,
}

/// A segment (one `cudaMalloc`, or an expandable segment) with its blocks in address order.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    pub device: i64,
    pub address: u64,
    pub total_bytes: u64,
    pub allocated_bytes: u64,
    pub active_bytes: u64,
    pub requested_bytes: u64,
    pub stream: i64,
    pub segment_type: String,
    pub pool_id: (i64, i64),
    pub is_expandable: bool,
    pub blocks: Vec<Block>,
}

/// A `record_function` annotation or `_set_memory_metadata` marker.
#[derive(Debug, Clone, PartialEq)]
pub struct Annotation {
    pub name: String,
    pub stage: String,
    pub device: i64,
    pub time_us: i64,
}

/// A whole snapshot.
#[derive(Debug, Default, PartialEq)]
pub struct Snapshot {
    pub strings: Vec<String>,
    pub frames: Vec<Frame>,
    /// Frame ids, innermost first.
    pub stacks: Vec<Vec<u32>>,
    pub segments: Vec<Segment>,
    /// For each device ordinal, its trace entries in order.
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// The interned [`EntryInfo`]s that trace entries point to (`TraceEntry::info`).
    pub entry_infos: Vec<EntryInfo>,
    /// `allocator_settings` as plain JSON.
    pub allocator_settings: serde_json::Map<String, serde_json::Value>,
    pub annotations: Vec<Annotation>,
}

impl Snapshot {
    pub fn str(&self, id: u32) -> &str {
        self.strings.get(id as usize).map(String::as_str).unwrap_or("")
    }

    pub fn stack(&self, id: StackId) -> &[u32] {
        if id == NO_STACK {
            return &[];
        }
        self.stacks.get(id as usize).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn frame_text(&self, frame_id: u32) -> String {
        match self.frames.get(frame_id as usize) {
            Some(f) => format!("{}:{}:{}", self.str(f.filename), f.line, self.str(f.name)),
            None => "?".into(),
        }
    }

    /// The stream, `device_free`, metadata and compile context of a trace entry.
    pub fn info(&self, e: &TraceEntry) -> EntryInfo {
        self.entry_infos.get(e.info() as usize).copied().unwrap_or_default()
    }

    /// Number of trace entries over all devices.
    pub fn trace_entries(&self) -> usize {
        self.device_traces.iter().map(Vec::len).sum()
    }
}

/// Interns strings, frames and stacks while a snapshot is decoded.
#[derive(Default)]
pub struct Interner {
    pub strings: Vec<String>,
    string_ids: HashMap<String, u32, FxBuild>,
    pub frames: Vec<Frame>,
    frame_ids: HashMap<Frame, u32, FxBuild>,
    pub stacks: Vec<Vec<u32>>,
    stack_ids: HashMap<Vec<u32>, u32, FxBuild>,
    pub infos: Vec<EntryInfo>,
    info_ids: HashMap<EntryInfo, InfoId, FxBuild>,
    last_info: Option<(EntryInfo, InfoId)>,
}

impl Interner {
    pub fn new() -> Self {
        let mut i = Interner::default();
        i.string("");
        i
    }

    pub fn string(&mut self, s: &str) -> u32 {
        if let Some(&id) = self.string_ids.get(s) {
            return id;
        }
        let id = self.strings.len() as u32;
        self.strings.push(s.to_string());
        self.string_ids.insert(s.to_string(), id);
        id
    }

    pub fn frame(&mut self, f: Frame) -> u32 {
        if let Some(&id) = self.frame_ids.get(&f) {
            return id;
        }
        let id = self.frames.len() as u32;
        self.frames.push(f);
        self.frame_ids.insert(f, id);
        id
    }

    /// Interns a stack given as a slice (allocates only for a new stack).
    pub fn stack_slice(&mut self, frames: &[u32]) -> StackId {
        if frames.is_empty() {
            return NO_STACK;
        }
        if let Some(&id) = self.stack_ids.get(frames) {
            return id;
        }
        self.stack(frames.to_vec())
    }

    /// Interns an entry's [`EntryInfo`]; `None` past [`MAX_INFO_ID`] distinct ones.
    pub fn info(&mut self, info: EntryInfo) -> Option<InfoId> {
        if let Some((last, id)) = self.last_info {
            if last == info {
                return Some(id);
            }
        }
        let id = match self.info_ids.get(&info) {
            Some(&id) => id,
            None => {
                let id = self.infos.len() as InfoId;
                if id > MAX_INFO_ID {
                    return None;
                }
                self.infos.push(info);
                self.info_ids.insert(info, id);
                id
            }
        };
        self.last_info = Some((info, id));
        Some(id)
    }

    pub fn stack(&mut self, frames: Vec<u32>) -> StackId {
        if frames.is_empty() {
            return NO_STACK;
        }
        if let Some(&id) = self.stack_ids.get(&frames) {
            return id;
        }
        let id = self.stacks.len() as u32;
        self.stacks.push(frames.clone());
        self.stack_ids.insert(frames, id);
        id
    }
}
