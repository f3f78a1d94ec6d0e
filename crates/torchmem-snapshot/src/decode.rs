//! Turns an unpickled snapshot into the typed [`Snapshot`]. While the pickle streams in, the
//! [`SnapshotCompactor`] replaces each finished frame, block and trace-entry dict by a small handle,
//! and each frame list by an interned stack id, so memory follows unique objects, not file size.

use std::io::Read;

use std::collections::HashMap;
use std::rc::Rc;

use crate::model::*;
use crate::pickle::{self, dict_get, Compactor, Value};

pub(crate) const K_ACTION: u8 = 1;
pub(crate) const K_ADDR: u8 = 2;
pub(crate) const K_SIZE: u8 = 3;
pub(crate) const K_STREAM: u8 = 4;
pub(crate) const K_TIME_US: u8 = 5;
pub(crate) const K_DEVICE_FREE: u8 = 6;
pub(crate) const K_USER_METADATA: u8 = 7;
pub(crate) const K_COMPILE_CONTEXT: u8 = 8;
pub(crate) const K_FRAMES: u8 = 9;
pub(crate) const K_STATE: u8 = 10;
pub(crate) const K_ADDRESS: u8 = 11;
pub(crate) const K_REQUESTED_SIZE: u8 = 12;
pub(crate) const K_BLOCKS: u8 = 13;
pub(crate) const K_FILENAME: u8 = 14;
pub(crate) const K_LINE: u8 = 15;
pub(crate) const K_NAME: u8 = 16;

const KIND_FRAME: u8 = 1;
const KIND_STACK: u8 = 2;
const KIND_TRACE: u8 = 3;
const KIND_BLOCK: u8 = 4;

/// Collects typed records while the unpickler runs.
pub struct SnapshotCompactor {
    pub interner: Interner,
    pub traces: Vec<TraceEntry>,
    pub blocks: Vec<Block>,
    /// Key strings are memoized once in real snapshots: map their `Rc` address to a key id (the `Rc`
    /// is kept alive here so an address is never reused for another string).
    key_ids: HashMap<usize, u8, FxBuild>,
    key_keep: Vec<Rc<String>>,
    scratch_ids: Vec<u32>,
    /// Same idea for string values: `Rc` address → (interned id, action).
    value_ids: HashMap<usize, (u32, Action), FxBuild>,
}

/// The error for a snapshot with more distinct entry infos than a [`TraceEntry`] can point to.
pub(crate) fn too_many_infos() -> String {
    format!("more than {MAX_INFO_ID} distinct (stream, device_free, user_metadata, compile_context) combinations in the trace")
}

pub(crate) fn key_of_str(s: &str) -> u8 {
    match s {
        "action" => K_ACTION,
        "addr" => K_ADDR,
        "size" => K_SIZE,
        "stream" => K_STREAM,
        "time_us" => K_TIME_US,
        "device_free" => K_DEVICE_FREE,
        "user_metadata" => K_USER_METADATA,
        "compile_context" => K_COMPILE_CONTEXT,
        "frames" => K_FRAMES,
        "state" => K_STATE,
        "address" => K_ADDRESS,
        "requested_size" => K_REQUESTED_SIZE,
        "blocks" => K_BLOCKS,
        "filename" => K_FILENAME,
        "line" => K_LINE,
        "name" => K_NAME,
        _ => 0,
    }
}

impl Default for SnapshotCompactor {
    fn default() -> Self {
        SnapshotCompactor {
            interner: Interner::new(),
            traces: Vec::new(),
            blocks: Vec::new(),
            key_ids: HashMap::default(),
            key_keep: Vec::new(),
            scratch_ids: Vec::new(),
            value_ids: HashMap::default(),
        }
    }
}

pub(crate) fn has(items: &[(Value, Value)], key: &str) -> bool {
    items.iter().any(|(k, _)| k.as_str() == Some(key))
}

fn req_u64(items: &[(Value, Value)], key: &str, what: &str) -> Result<u64, String> {
    match dict_get(items, key) {
        Some(v) => {
            v.as_u64().ok_or_else(|| format!("{what}: '{key}' should be a non-negative int, found {}", v.type_name()))
        }
        None => Err(format!("{what}: key '{key}' is missing")),
    }
}

fn opt_u64(items: &[(Value, Value)], key: &str, what: &str) -> Result<Option<u64>, String> {
    match dict_get(items, key) {
        None | Some(Value::None) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("{what}: '{key}' should be a non-negative int, found {}", v.type_name())),
    }
}

/// Signed fields that may hold a pointer-sized value (streams): accept i64 or u64.
fn opt_i64(items: &[(Value, Value)], key: &str, what: &str) -> Result<i64, String> {
    match dict_get(items, key) {
        None | Some(Value::None) => Ok(0),
        Some(v) => v
            .as_i64()
            .or_else(|| v.as_u64().map(|u| u as i64))
            .ok_or_else(|| format!("{what}: '{key}' should be an int, found {}", v.type_name())),
    }
}

fn opt_str(items: &[(Value, Value)], key: &str, what: &str) -> Result<Option<String>, String> {
    match dict_get(items, key) {
        None | Some(Value::None) => Ok(None),
        Some(Value::Str(s)) => Ok(Some(s.to_string())),
        Some(v) => Err(format!("{what}: '{key}' should be a str, found {}", v.type_name())),
    }
}

fn u64_of(v: &Value, key: &str, what: &str) -> Result<Option<u64>, String> {
    match v {
        Value::None => Ok(None),
        v => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("{what}: '{key}' should be a non-negative int, found {}", v.type_name())),
    }
}

fn i64_of(v: &Value, key: &str, what: &str) -> Result<i64, String> {
    match v {
        Value::None => Ok(0),
        v => v
            .as_i64()
            .or_else(|| v.as_u64().map(|u| u as i64))
            .ok_or_else(|| format!("{what}: '{key}' should be an int, found {}", v.type_name())),
    }
}

fn str_of<'a>(v: &'a Value, key: &str, what: &str) -> Result<&'a str, String> {
    match v {
        Value::None => Ok(""),
        Value::Str(s) => Ok(s.as_str()),
        v => Err(format!("{what}: '{key}' should be a str, found {}", v.type_name())),
    }
}

impl SnapshotCompactor {
    fn key(&mut self, k: &Value) -> u8 {
        let Value::Str(rc) = k else { return 0 };
        let ptr = Rc::as_ptr(rc) as usize;
        if let Some(&id) = self.key_ids.get(&ptr) {
            return id;
        }
        let id = key_of_str(rc);
        if self.key_keep.len() < 4096 {
            self.key_keep.push(rc.clone());
            self.key_ids.insert(ptr, id);
        }
        id
    }

    /// Interned id and action of a string value (cached by `Rc` address).
    fn str_value(&mut self, v: &Value, key: &str, what: &str) -> Result<(u32, Action), String> {
        let Value::Str(rc) = v else {
            return Ok((self.interner.string(str_of(v, key, what)?), Action::Other));
        };
        let ptr = Rc::as_ptr(rc) as usize;
        if let Some(&r) = self.value_ids.get(&ptr) {
            return Ok(r);
        }
        let r = (self.interner.string(rc), Action::parse(rc));
        if self.key_keep.len() < 1 << 16 {
            self.key_keep.push(rc.clone());
            self.value_ids.insert(ptr, r);
        }
        Ok(r)
    }

    fn frame(&mut self, items: &[(Value, Value)]) -> Result<u32, String> {
        let (mut filename, mut name, mut line) = (0u32, 0u32, 0i64);
        for (k, v) in items {
            match self.key(k) {
                K_FILENAME => filename = self.interner.string(str_of(v, "filename", "frame")?),
                K_NAME => name = self.interner.string(str_of(v, "name", "frame")?),
                K_LINE => line = i64_of(v, "line", "frame")?,
                _ => {}
            }
        }
        Ok(self.interner.frame(Frame { filename, name, line }))
    }

    /// Interns a `frames` value; a list becomes a stack id and is recorded for memo replacement.
    fn stack_of(
        &mut self,
        v: Option<&Value>,
        what: &str,
        replaced: &mut Vec<(Value, Value)>,
    ) -> Result<StackId, String> {
        match v {
            None | Some(Value::None) => Ok(NO_STACK),
            Some(Value::Opaque { kind: KIND_STACK, id }) => Ok(*id),
            Some(list @ Value::List(l)) => {
                let mut ids = std::mem::take(&mut self.scratch_ids);
                ids.clear();
                for f in l.items.borrow().iter() {
                    match f {
                        Value::Opaque { kind: KIND_FRAME, id } => ids.push(*id),
                        Value::Dict(d) => {
                            let items = d.items.borrow();
                            ids.push(self.frame(&items)?);
                        }
                        other => return Err(format!("{what}: a frame should be a dict, found {}", other.type_name())),
                    }
                }
                let id = self.interner.stack_slice(&ids);
                self.scratch_ids = ids;
                replaced.push((list.clone(), Value::Opaque { kind: KIND_STACK, id }));
                Ok(id)
            }
            Some(v) => Err(format!("{what}: 'frames' should be a list, found {}", v.type_name())),
        }
    }

    fn trace(&mut self, items: &[(Value, Value)], replaced: &mut Vec<(Value, Value)>) -> Result<TraceEntry, String> {
        let what = "trace entry";
        let (mut action, mut addr, mut size_bytes, mut time_us) = (Action::Other, 0u64, 0u64, 0i64);
        let mut info = EntryInfo::default();
        let mut action_seen = false;
        let mut frames: Option<&Value> = None;
        for (k, v) in items {
            match self.key(k) {
                K_ACTION => {
                    if !matches!(v, Value::Str(_)) {
                        return Err(format!("{what}: 'action' should be a str, found {}", v.type_name()));
                    }
                    action = self.str_value(v, "action", what)?.1;
                    action_seen = true;
                }
                K_ADDR => addr = u64_of(v, "addr", what)?.unwrap_or(0),
                K_SIZE => size_bytes = u64_of(v, "size", what)?.unwrap_or(0),
                K_STREAM => info.stream = i64_of(v, "stream", what)?,
                K_TIME_US => time_us = i64_of(v, "time_us", what)?,
                K_DEVICE_FREE => info.device_free_bytes = u64_of(v, "device_free", what)?,
                K_USER_METADATA => info.user_metadata = self.str_value(v, "user_metadata", what)?.0,
                K_COMPILE_CONTEXT => info.compile_context = self.str_value(v, "compile_context", what)?.0,
                K_FRAMES => frames = Some(v),
                _ => {}
            }
        }
        if !action_seen {
            return Err(format!("{what}: 'action' is missing"));
        }
        let stack = self.stack_of(frames, what, replaced)?;
        let info = self.interner.info(info).ok_or_else(too_many_infos)?;
        Ok(TraceEntry::new(action, addr, size_bytes, time_us, stack, info))
    }

    fn block(&mut self, items: &[(Value, Value)], replaced: &mut Vec<(Value, Value)>) -> Result<Block, String> {
        let what = "block";
        let mut state = None;
        let (mut address, mut size, mut requested) = (None, None, 0u64);
        let mut frames: Option<&Value> = None;
        for (k, v) in items {
            match self.key(k) {
                K_STATE => {
                    state = Some(match str_of(v, "state", what)? {
                        "active_allocated" => BlockState::ActiveAllocated,
                        "active_pending_free" => BlockState::ActivePendingFree,
                        "inactive" => BlockState::Inactive,
                        other => return Err(format!("{what}: unknown state {other:?}")),
                    })
                }
                K_ADDRESS => address = u64_of(v, "address", what)?,
                K_SIZE => size = u64_of(v, "size", what)?,
                K_REQUESTED_SIZE => requested = u64_of(v, "requested_size", what)?.unwrap_or(0),
                K_FRAMES => frames = Some(v),
                _ => {}
            }
        }
        Ok(Block {
            address: address.ok_or_else(|| format!("{what}: key 'address' is missing"))?,
            size_bytes: size.ok_or_else(|| format!("{what}: key 'size' is missing"))?,
            requested_bytes: requested,
            state: state.ok_or_else(|| format!("{what}: 'state' is missing"))?,
            stack: self.stack_of(frames, what, replaced)?,
        })
    }
}

impl Compactor for SnapshotCompactor {
    fn on_dict(
        &mut self,
        items: &[(Value, Value)],
        replaced: &mut Vec<(Value, Value)>,
    ) -> Result<Option<Value>, String> {
        match DictKind::of_keys(items.iter().map(|(k, _)| self.key(k)), items.len()) {
            DictKind::Trace => {
                let t = self.trace(items, replaced)?;
                let id = self.traces.len() as u32;
                self.traces.push(t);
                Ok(Some(Value::Opaque { kind: KIND_TRACE, id }))
            }
            DictKind::Block => {
                let b = self.block(items, replaced)?;
                let id = self.blocks.len() as u32;
                self.blocks.push(b);
                Ok(Some(Value::Opaque { kind: KIND_BLOCK, id }))
            }
            DictKind::Frame => {
                let id = self.frame(items)?;
                Ok(Some(Value::Opaque { kind: KIND_FRAME, id }))
            }
            DictKind::Other => Ok(None),
        }
    }
}

/// What a snapshot dict is, by its keys: the one rule of both decoders (`SnapshotCompactor::on_dict` here,
/// `direct`'s fast reader).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DictKind {
    /// Not a record: kept as a plain dict.
    Other,
    /// A trace entry (it has an `action`).
    Trace,
    /// A block (`state`, `size` and `address`, and no `blocks`: a segment has blocks).
    Block,
    /// A stack frame (`filename`, `line` and `name`, at most 8 keys).
    Frame,
}

impl DictKind {
    /// From the dict's key codes (`K_*`, another key any other code) and its number of pairs.
    pub(crate) fn of_keys(keys: impl Iterator<Item = u8>, pairs: usize) -> DictKind {
        let mut seen = 0u64;
        for k in keys.filter(|&k| k < 64) {
            seen |= 1 << k;
        }
        let has = |k: u8| seen & (1 << k) != 0;
        if has(K_ACTION) {
            DictKind::Trace
        } else if has(K_STATE) && has(K_SIZE) && has(K_ADDRESS) && !has(K_BLOCKS) {
            DictKind::Block
        } else if has(K_FILENAME) && has(K_LINE) && has(K_NAME) && pairs <= 8 {
            DictKind::Frame
        } else {
            DictKind::Other
        }
    }
}

/// Plain JSON for small generic values (allocator settings); depth-limited.
pub fn value_to_json(v: &Value, depth: usize) -> serde_json::Value {
    use serde_json::Value as J;
    if depth > 16 {
        return J::Null;
    }
    match v {
        Value::None => J::Null,
        Value::Bool(b) => J::Bool(*b),
        Value::Int(i) => J::from(*i),
        Value::BigInt(_) => v.as_u64().map(J::from).unwrap_or(J::Null),
        Value::Float(f) => serde_json::Number::from_f64(*f).map(J::Number).unwrap_or(J::Null),
        Value::Str(s) => J::String(s.to_string()),
        Value::Bytes(b) => J::String(format!("<{} bytes>", b.len())),
        Value::List(l) => J::Array(l.items.borrow().iter().take(10_000).map(|x| value_to_json(x, depth + 1)).collect()),
        Value::Tuple(t) => J::Array(t.iter().take(10_000).map(|x| value_to_json(x, depth + 1)).collect()),
        Value::Dict(d) => {
            let mut m = serde_json::Map::new();
            for (k, val) in d.items.borrow().iter().take(10_000) {
                let key = match k {
                    Value::Str(s) => s.to_string(),
                    other => format!("{}", value_to_json(other, depth + 1)),
                };
                m.insert(key, value_to_json(val, depth + 1));
            }
            J::Object(m)
        }
        Value::Opaque { .. } => J::Null,
    }
}

fn list_items(v: &Value, what: &str) -> Result<Vec<Value>, String> {
    match v {
        Value::List(l) => Ok(l.items.borrow().clone()),
        Value::Tuple(t) => Ok(t.as_ref().clone()),
        other => Err(format!("{what} should be a list, found {}", other.type_name())),
    }
}

fn dict_items(v: &Value, what: &str) -> Result<Vec<(Value, Value)>, String> {
    match v {
        Value::Dict(d) => Ok(d.items.borrow().clone()),
        other => Err(format!("{what} should be a dict, found {}", other.type_name())),
    }
}

fn segment(c: &mut SnapshotCompactor, v: &Value, idx: usize) -> Result<Segment, String> {
    let what = format!("segments[{idx}]");
    let items = dict_items(v, &what)?;
    let mut blocks = Vec::new();
    if let Some(bl) = dict_get(&items, "blocks") {
        for (j, b) in list_items(&bl, &format!("{what}.blocks"))?.iter().enumerate() {
            match b {
                Value::Opaque { kind: KIND_BLOCK, id } => blocks.push(c.blocks[*id as usize]),
                Value::Dict(d) => {
                    let bi = d.items.borrow();
                    let mut scratch = Vec::new();
                    blocks.push(c.block(&bi, &mut scratch).map_err(|e| format!("{what}.blocks[{j}]: {e}"))?);
                }
                other => return Err(format!("{what}.blocks[{j}] should be a dict, found {}", other.type_name())),
            }
        }
    }
    let pool_id = match dict_get(&items, "segment_pool_id") {
        Some(Value::Tuple(t)) if t.len() == 2 => (t[0].as_i64().unwrap_or(0), t[1].as_i64().unwrap_or(0)),
        Some(Value::List(l)) if l.items.borrow().len() == 2 => {
            let l = l.items.borrow();
            (l[0].as_i64().unwrap_or(0), l[1].as_i64().unwrap_or(0))
        }
        _ => (0, 0),
    };
    Ok(Segment {
        device: opt_i64(&items, "device", &what)?,
        address: req_u64(&items, "address", &what)?,
        total_bytes: req_u64(&items, "total_size", &what)?,
        allocated_bytes: opt_u64(&items, "allocated_size", &what)?.unwrap_or(0),
        active_bytes: opt_u64(&items, "active_size", &what)?.unwrap_or(0),
        requested_bytes: opt_u64(&items, "requested_size", &what)?.unwrap_or(0),
        stream: opt_i64(&items, "stream", &what)?,
        segment_type: opt_str(&items, "segment_type", &what)?.unwrap_or_default(),
        pool_id,
        is_expandable: matches!(dict_get(&items, "is_expandable"), Some(Value::Bool(true))),
        blocks,
    })
}

/// Builds the snapshot from the unpickled root and the compactor's records.
pub fn build(root: &Value, mut c: SnapshotCompactor) -> Result<Snapshot, String> {
    let mut snap = Snapshot::default();
    // Old dumps (torch < 1.13 `memory_snapshot()`) are a bare list of segments.
    let (segments_v, traces_v, settings_v, annotations_v) = match root {
        Value::Dict(_) => {
            let items = dict_items(root, "the snapshot")?;
            if !has(&items, "segments") && !has(&items, "device_traces") {
                return Err("the top-level dict has neither 'segments' nor 'device_traces'. Was it written by torch.cuda.memory._dump_snapshot?".into());
            }
            (
                dict_get(&items, "segments"),
                dict_get(&items, "device_traces"),
                dict_get(&items, "allocator_settings"),
                dict_get(&items, "external_annotations"),
            )
        }
        Value::List(_) => (Some(root.clone()), None, None, None),
        other => {
            return Err(format!(
                "the top-level object is a {}, not a dict with 'segments' and 'device_traces'",
                other.type_name()
            ))
        }
    };
    if let Some(sv) = segments_v {
        for (i, s) in list_items(&sv, "'segments'")?.iter().enumerate() {
            snap.segments.push(segment(&mut c, s, i)?);
        }
    }
    if let Some(tv) = traces_v {
        for (d, dev) in list_items(&tv, "'device_traces'")?.iter().enumerate() {
            let entries = match dev {
                Value::List(l) => l.items.borrow().clone(),
                Value::None => Vec::new(),
                other => return Err(format!("device_traces[{d}] should be a list, found {}", other.type_name())),
            };
            let mut trace = Vec::with_capacity(entries.len());
            for (i, e) in entries.iter().enumerate() {
                match e {
                    Value::Opaque { kind: KIND_TRACE, id } => trace.push(c.traces[*id as usize]),
                    Value::Dict(dd) => {
                        let items = dd.items.borrow();
                        let mut scratch = Vec::new();
                        let t = c.trace(&items, &mut scratch).map_err(|m| format!("device_traces[{d}][{i}]: {m}"))?;
                        trace.push(t);
                    }
                    other => {
                        return Err(format!("device_traces[{d}][{i}] should be a dict, found {}", other.type_name()))
                    }
                }
            }
            snap.device_traces.push(trace);
        }
    }
    if let Some(Value::Dict(_)) = &settings_v {
        if let serde_json::Value::Object(m) = value_to_json(settings_v.as_ref().expect("some"), 0) {
            snap.allocator_settings = m;
        }
    }
    if let Some(av) = annotations_v {
        if let Ok(list) = list_items(&av, "'external_annotations'") {
            for a in list {
                if let Value::Dict(d) = &a {
                    let items = d.items.borrow();
                    snap.annotations.push(Annotation {
                        name: opt_str(&items, "name", "annotation").ok().flatten().unwrap_or_default(),
                        stage: opt_str(&items, "stage", "annotation").ok().flatten().unwrap_or_default(),
                        device: opt_i64(&items, "device", "annotation").unwrap_or(0),
                        time_us: opt_i64(&items, "time_us", "annotation").unwrap_or(0),
                    });
                }
            }
        }
    }
    snap.entry_infos = std::mem::take(&mut c.interner.infos);
    snap.strings = std::mem::take(&mut c.interner.strings);
    snap.frames = std::mem::take(&mut c.interner.frames);
    snap.stacks = std::mem::take(&mut c.interner.stacks);
    Ok(snap)
}

/// Reads a snapshot pickle from a reader.
pub fn read_pickle<R: Read>(reader: R) -> Result<Snapshot, crate::error::PickleOrSchema> {
    let mut c = SnapshotCompactor::default();
    let doc = pickle::unpickle(reader, &mut c).map_err(crate::error::PickleOrSchema::Pickle)?;
    build(&doc.root, c).map_err(crate::error::PickleOrSchema::Schema)
}

#[cfg(test)]
mod tests {
    //! The generic decoder on small pickles written by `pickle.dumps(..., protocol=4)` (Python 3.11).
    use super::*;

    const NO_ACTION: &[u8] = b"\x80\x04\x950\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\rdevice_traces\x94]\x94]\x94}\x94(\x8c\x04addr\x94K\x01\x8c\x04size\x94K\x02uaas.";
    const BAD_STATE: &[u8] = b"\x80\x04\x95\x7f\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x08segments\x94]\x94}\x94(\x8c\x06device\x94K\x00\x8c\x07address\x94K\x00\x8c\ntotal_size\x94M\x00\x02\x8c\x06blocks\x94]\x94}\x94(h\x05K\x00\x8c\x04size\x94M\x00\x02\x8c\x0erequested_size\x94M\xf4\x01\x8c\x05state\x94\x8c\x05weird\x94uauas.";
    const NEITHER: &[u8] = b"\x80\x04\x95\x0e\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x05hello\x94K\x01s.";
    const SHARED: &[u8] = b"\x80\x04\x95l\x01\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\x94]\x94\x8c\rdevice_traces\x94]\x94]\x94(}\x94(\x8c\x06action\x94\x8c\x05alloc\x94\x8c\x04addr\x94\x8a\t\x00\xfe\xff\xff\xff\xff\xff\xff\x00\x8c\x04size\x94M\x00\x02\x8c\x06frames\x94]\x94(}\x94(\x8c\x08filename\x94\x8c\x04a.py\x94\x8c\x04line\x94K\x03\x8c\x04name\x94\x8c\x01f\x94u}\x94(h\x0e\x8c\x04b.py\x94h\x10K\th\x11\x8c\x01g\x94ue\x8c\x06stream\x94K\x00\x8c\x07time_us\x94K\x05u}\x94(h\x07\x8c\x0efree_completed\x94h\t\x8a\t\x00\xfe\xff\xff\xff\xff\xff\xff\x00h\nM\x00\x02h\x0bh\x0ch\x17K\x07uea\x8c\x12allocator_settings\x94}\x94(\x8c\x13expandable_segments\x94\x88\x8c\x1cgarbage_collection_threshold\x94G?\xe0\x00\x00\x00\x00\x00\x00\x8c\x18roundup_power2_divisions\x94}\x94\x8c\x011\x94K\x00suu.";

    fn read(data: &[u8]) -> Result<Snapshot, String> {
        read_pickle(data).map_err(|e| match e {
            crate::error::PickleOrSchema::Pickle(p) => p.to_string(),
            crate::error::PickleOrSchema::Schema(s) => s,
        })
    }

    #[test]
    fn shared_frame_lists_become_one_stack_and_big_addresses_fit() {
        // {"device_traces": [[alloc, free_completed]]}, both with the same frame list object.
        let s = read(SHARED).unwrap();
        let t = &s.device_traces[0];
        assert_eq!(t.len(), 2);
        assert_eq!((t[0].action(), t[1].action()), (Action::Alloc, Action::FreeCompleted));
        assert_eq!(t[0].addr, u64::MAX - 511, "a 9-byte LONG1 address");
        assert_eq!((t[0].size_bytes, t[0].time_us, t[1].time_us), (512, 5, 7));
        assert_eq!(t[0].stack, t[1].stack);
        assert_eq!(s.stacks.len(), 1);
        let frames: Vec<String> = s.stack(t[0].stack).iter().map(|f| s.frame_text(*f)).collect();
        assert_eq!(frames, ["a.py:3:f", "b.py:9:g"]);
        assert_eq!(s.info(&t[0]).stream, 0);
        assert_eq!(s.allocator_settings["expandable_segments"], serde_json::json!(true));
        assert_eq!(s.allocator_settings["garbage_collection_threshold"], serde_json::json!(0.5));
        assert_eq!(s.allocator_settings["roundup_power2_divisions"], serde_json::json!({"1": 0}));
    }

    #[test]
    fn schema_errors_name_where_and_what() {
        assert_eq!(read(NO_ACTION).unwrap_err(), "device_traces[0][0]: trace entry: 'action' is missing");
        let e = read(BAD_STATE).unwrap_err();
        assert!(e.contains("block: unknown state \"weird\""), "{e}");
        assert!(e.starts_with("malformed pickle at byte offset"), "{e}");
        let e = read(NEITHER).unwrap_err();
        assert!(e.contains("neither 'segments' nor 'device_traces'"), "{e}");
    }

    #[test]
    fn value_to_json_is_depth_limited_and_keeps_plain_values() {
        use crate::pickle::{unpickle_bytes, Value};
        let doc = unpickle_bytes(SHARED).unwrap();
        let settings = doc.root.get("allocator_settings").unwrap();
        let j = value_to_json(&settings, 0);
        assert_eq!(j["expandable_segments"], serde_json::json!(true));
        assert_eq!(value_to_json(&settings, 17), serde_json::Value::Null);
        assert_eq!(value_to_json(&Value::None, 0), serde_json::Value::Null);
    }

    #[test]
    fn frame_dicts_are_compacted_while_streaming() {
        let mut c = SnapshotCompactor::default();
        let doc = pickle::unpickle(SHARED, &mut c).unwrap();
        assert_eq!(c.interner.frames.len(), 2, "two unique frames");
        assert_eq!(c.traces.len(), 2);
        let snap = build(&doc.root, c).unwrap();
        assert_eq!(snap.trace_entries(), 2);
    }
}
