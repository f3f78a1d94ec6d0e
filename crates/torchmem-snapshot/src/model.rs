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
        for &b in chunks.remainder() {
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
        self.hash
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

/// One allocator event (`device_traces[d][i]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceEntry {
    pub action: Action,
    pub addr: u64,
    /// Requested bytes for alloc/free, segment bytes for segment_*, failed request for oom.
    pub size_bytes: u64,
    pub stream: i64,
    pub time_us: i64,
    /// Free device bytes reported by an `oom` entry.
    pub device_free_bytes: Option<u64>,
    pub stack: StackId,
    /// `user_metadata` string id (`_set_memory_metadata`); 0 is "".
    pub user_metadata: u32,
    pub compile_context: u32,
}

/// Block state in a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    ActiveAllocated,
    ActivePendingFree,
    Inactive,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Block {
    pub address: u64,
    pub size_bytes: u64,
    pub requested_bytes: u64,
    pub state: BlockState,
    pub stack: StackId,
}

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
#[derive(Debug, Default)]
pub struct Snapshot {
    pub strings: Vec<String>,
    pub frames: Vec<Frame>,
    /// Frame ids, innermost first.
    pub stacks: Vec<Vec<u32>>,
    pub segments: Vec<Segment>,
    /// Trace entries of all devices, in file order.
    pub traces: Vec<TraceEntry>,
    /// For each device ordinal, indices into `traces`.
    pub device_traces: Vec<Vec<u32>>,
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
