//! Reads the JSON form of a snapshot (`json.dump` of `torch.cuda.memory._snapshot()`, as memory_viz
//! also accepts) into the same [`Snapshot`] model, streaming through serde.

use std::io::Read;

use serde::Deserialize;

use crate::model::*;

#[derive(Deserialize)]
struct JFrame {
    #[serde(default)]
    filename: String,
    #[serde(default)]
    line: i64,
    #[serde(default)]
    name: String,
}

#[derive(Deserialize)]
struct JBlock {
    address: u64,
    size: u64,
    #[serde(default)]
    requested_size: u64,
    state: String,
    #[serde(default)]
    frames: Option<Vec<JFrame>>,
}

#[derive(Deserialize)]
struct JSegment {
    #[serde(default)]
    device: i64,
    address: u64,
    total_size: u64,
    #[serde(default)]
    allocated_size: u64,
    #[serde(default)]
    active_size: u64,
    #[serde(default)]
    requested_size: u64,
    #[serde(default)]
    stream: i64,
    #[serde(default)]
    segment_type: String,
    #[serde(default)]
    segment_pool_id: Option<(i64, i64)>,
    #[serde(default)]
    is_expandable: bool,
    #[serde(default)]
    blocks: Vec<JBlock>,
}

#[derive(Deserialize)]
struct JTrace {
    action: String,
    #[serde(default)]
    addr: u64,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    stream: i64,
    #[serde(default)]
    time_us: i64,
    #[serde(default)]
    device_free: Option<u64>,
    #[serde(default)]
    frames: Option<Vec<JFrame>>,
    #[serde(default)]
    user_metadata: String,
    #[serde(default)]
    compile_context: String,
}

#[derive(Deserialize)]
struct JAnnotation {
    #[serde(default)]
    name: String,
    #[serde(default)]
    stage: String,
    #[serde(default)]
    device: i64,
    #[serde(default)]
    time_us: i64,
}

#[derive(Deserialize)]
struct JSnapshot {
    #[serde(default)]
    segments: Option<Vec<JSegment>>,
    #[serde(default)]
    device_traces: Option<Vec<Option<Vec<JTrace>>>>,
    #[serde(default)]
    allocator_settings: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    external_annotations: Vec<JAnnotation>,
}

fn stack(i: &mut Interner, frames: Option<Vec<JFrame>>) -> StackId {
    let ids: Vec<u32> = frames
        .unwrap_or_default()
        .into_iter()
        .map(|f| {
            let fr = Frame { filename: i.string(&f.filename), name: i.string(&f.name), line: f.line };
            i.frame(fr)
        })
        .collect();
    i.stack(ids)
}

fn state(s: &str) -> Result<BlockState, String> {
    Ok(match s {
        "active_allocated" => BlockState::ActiveAllocated,
        "active_pending_free" => BlockState::ActivePendingFree,
        "inactive" => BlockState::Inactive,
        other => return Err(format!("unknown block state {other:?}")),
    })
}

/// Why a JSON file is not read.
#[derive(Debug, Clone, PartialEq)]
pub enum JsonError {
    /// Not valid JSON, or values of the wrong type (serde's message, with line and column).
    Syntax(String),
    /// Valid JSON that is not an allocator snapshot (`null`, `{}`).
    NotASnapshot(String),
}

/// Reads a JSON snapshot.
pub fn read_json<R: Read>(reader: R) -> Result<Snapshot, JsonError> {
    let j: Option<JSnapshot> = serde_json::from_reader(reader).map_err(|e| JsonError::Syntax(e.to_string()))?;
    let Some(j) = j else {
        return Err(JsonError::NotASnapshot(
            "the JSON is null, not an object with 'segments' and 'device_traces'. Was it written by json.dump(torch.cuda.memory._snapshot())?".into(),
        ));
    };
    if j.segments.is_none() && j.device_traces.is_none() {
        return Err(JsonError::NotASnapshot(
            "the top-level object has neither 'segments' nor 'device_traces'. Was it written by json.dump(torch.cuda.memory._snapshot())?".into(),
        ));
    }
    read_parsed(j).map_err(JsonError::Syntax)
}

fn read_parsed(j: JSnapshot) -> Result<Snapshot, String> {
    let mut it = Interner::new();
    let mut snap = Snapshot::default();
    for (si, s) in j.segments.unwrap_or_default().into_iter().enumerate() {
        let mut blocks = Vec::with_capacity(s.blocks.len());
        for b in s.blocks {
            blocks.push(Block {
                address: b.address,
                size_bytes: b.size,
                requested_bytes: b.requested_size,
                state: state(&b.state).map_err(|e| format!("segments[{si}]: {e}"))?,
                stack: stack(&mut it, b.frames),
            });
        }
        snap.segments.push(Segment {
            device: s.device,
            address: s.address,
            total_bytes: s.total_size,
            allocated_bytes: s.allocated_size,
            active_bytes: s.active_size,
            requested_bytes: s.requested_size,
            stream: s.stream,
            segment_type: s.segment_type,
            pool_id: s.segment_pool_id.unwrap_or((0, 0)),
            is_expandable: s.is_expandable,
            blocks,
        });
    }
    for dev in j.device_traces.unwrap_or_default() {
        let mut entries = Vec::new();
        for t in dev.unwrap_or_default() {
            let stack = stack(&mut it, t.frames);
            let info = EntryInfo {
                stream: t.stream,
                device_free_bytes: t.device_free,
                user_metadata: it.string(&t.user_metadata),
                compile_context: it.string(&t.compile_context),
            };
            let info = it.info(info).ok_or("more distinct trace-entry streams and metadata than torchmem stores")?;
            entries.push(TraceEntry::new(Action::parse(&t.action), t.addr, t.size, t.time_us, stack, info));
        }
        snap.device_traces.push(entries);
    }
    snap.allocator_settings = j.allocator_settings;
    snap.annotations = j
        .external_annotations
        .into_iter()
        .map(|a| Annotation { name: a.name, stage: a.stage, device: a.device, time_us: a.time_us })
        .collect();
    snap.strings = it.strings;
    snap.frames = it.frames;
    snap.stacks = it.stacks;
    snap.entry_infos = it.infos;
    Ok(snap)
}
