//! The fast snapshot decoder: reads the pickle opcodes of an allocator snapshot and builds the model
//! directly, with no generic value tree for the big lists.
//!
//! Values on its stack are 16-byte `Copy` handles (ints, string ids, record ids, container handles), the
//! memo is 4 bytes a slot, strings are read once and interned by memo id, frame dicts become frame ids,
//! frame lists stack ids, block dicts blocks, and trace-entry dicts go straight into the list of the
//! device they belong to; a trace-entry dict of the usual shape is read whole in one pass
//! (`trace_entry`), from the bytes into its fields. It recognises the dicts exactly as the generic
//! decoder (`decode`) does, at the same opcodes, and interns in the same order, so both build the same
//! [`Snapshot`].
//!
//! It only takes the shapes and opcodes real snapshots use. Anything else — a refused or unknown opcode,
//! a damaged or truncated file, a value of an unexpected type, a container shared in a way the shortcut
//! cannot follow — makes it give up ([`Bail`]); the caller then runs the generic decoder on the same
//! input, which produces the result or the precise error. So this path never decides an error message
//! and never executes anything: it has no opcode that imports or calls code.

use std::collections::HashSet;
use std::io::Read;

use crate::decode::*;
use crate::model::*;
use crate::pickle::opcodes as op;

/// The fast path cannot decode this input; run the generic decoder instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bail;

type R<T> = Result<T, Bail>;

/// A value on the stack or inside a container.
#[derive(Clone, Copy, Debug)]
enum V {
    None,
    Bool(bool),
    Int(i64),
    /// A non-negative int above i64::MAX (LONG1 of 9 bytes: GPU addresses).
    U64(u64),
    Float(f64),
    /// A string read from the file (`Reader::strings` id).
    Str(u32),
    /// A container: node id and its generation (a handle to a freed node is detected).
    Node(u32, u32),
    Frame(u32),
    Stack(StackId),
    Block(u32),
    /// A trace entry waiting to be appended to its device's list (`Reader::pending`, by sequence number).
    Trace(u64),
    /// The frame list of the trace entry `trace_entry` is reading (its frame ids: `Reader::entry_frames`).
    EntryFrames,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    List,
    Dict,
    Tuple,
}

/// A container that is still generic (lists, dicts and tuples the decoder did not turn into records).
struct Node {
    kind: Kind,
    gen: u32,
    memo_idx: u32,
    /// List and tuple items, or dict keys and values interleaved.
    items: Vec<V>,
    /// Frame ids of a list read as a frame list (`frame_list`): its items, when `items` is empty.
    frames: Vec<u32>,
    /// Trace entries appended to this list (a device trace); empty when they went to an [`EntrySink`].
    entries: Vec<TraceEntry>,
    /// How many trace entries were appended to this list (kept or streamed) and not yet taken.
    n_entries: u64,
    /// The entries were moved into the snapshot.
    taken: bool,
}

const NO_MEMO: u32 = u32::MAX;

// Memo slots: a 3-bit tag and a 29-bit payload.
const TAG_SHIFT: u32 = 29;
const PAYLOAD: u32 = (1 << TAG_SHIFT) - 1;
const M_EMPTY: u32 = 0;
const M_STR: u32 = 1;
const M_NODE: u32 = 2;
const M_FRAME: u32 = 3;
const M_STACK: u32 = 4;
const M_BLOCK: u32 = 5;
const M_SCALAR: u32 = 6;
/// A trace-entry dict already moved into its device trace: a reference to it makes the fast path give up.
const M_GONE: u32 = 7;
/// Payload standing for `NO_STACK` in an `M_STACK` slot.
const NO_STACK_PAYLOAD: u32 = PAYLOAD;

fn pack(tag: u32, payload: u32) -> R<u32> {
    if payload > PAYLOAD {
        return Err(Bail);
    }
    Ok(tag << TAG_SHIFT | payload)
}

/// Largest memo gap accepted (as the generic unpickler).
const MAX_MEMO_GAP: usize = 1 << 16;

/// Metadata of a string read from the file.
#[derive(Clone, Copy)]
struct StrMeta {
    start: u32,
    len: u32,
    /// Key code (`decode::K_*`, 0 for other strings).
    key: u8,
    /// Id in the snapshot's string table once interned.
    model: u32,
    /// `Action::parse` of the text.
    action: Action,
}

/// The keys of a dict, in order, and what they make it: the decoder remembers the few shapes that
/// repeat (a trace entry, a frame) and then finds each field by position instead of matching keys.
struct Shape {
    /// String ids of the keys.
    keys: Vec<u32>,
    /// What dicts of these keys are.
    kind: DictKind,
    /// Pair index of each key code (`decode::K_*`), `NO_POS` when absent.
    pos: [u8; 17],
    /// A key code appears twice (then the generic order of checks matters: no shortcut).
    repeated: bool,
}

const NO_POS: u8 = u8::MAX;

/// A dict's values by key code (`decode::K_*`; index 0, the other keys, unused).
type Fields = [Option<V>; 17];
const MAX_SHAPES: usize = 8;

/// What a dict's pairs make it (`decode::DictKind`, the rule both decoders share).
fn classify<Rd: Read>(r: &Reader<Rd>, pairs: &[V]) -> DictKind {
    let keys = pairs.chunks_exact(2).map(|kv| match kv[0] {
        V::Str(k) => r.strings[k as usize].key,
        _ => 0,
    });
    DictKind::of_keys(keys, pairs.len() / 2)
}

/// A LONG1/LONG4 integer (little-endian two's complement), as the generic unpickler reads it.
#[inline]
fn int_le(bytes: &[u8]) -> R<V> {
    Ok(if bytes.is_empty() {
        V::Int(0)
    } else if bytes.len() <= 8 {
        // Byte by byte, then sign-extended: a variable-length copy into an 8-byte buffer read back at
        // once stalls the load (no store forwarding), and LONG1 carries every address and time.
        let mut raw = 0u64;
        for (k, &b) in bytes.iter().enumerate() {
            raw |= (b as u64) << (8 * k);
        }
        let unused_bits = 64 - 8 * bytes.len() as u32;
        V::Int(((raw << unused_bits) as i64) >> unused_bits)
    } else {
        let negative = bytes[bytes.len() - 1] & 0x80 != 0;
        let fill = if negative { 0xff } else { 0 };
        let mut buf = [0u8; 8];
        buf.copy_from_slice(&bytes[..8]);
        if bytes[8..].iter().all(|&b| b == fill) && ((bytes[7] & 0x80 != 0) == negative) {
            V::Int(i64::from_le_bytes(buf))
        } else if !negative && bytes[8..].iter().all(|&b| b == 0) {
            V::U64(u64::from_le_bytes(buf))
        } else {
            return Err(Bail);
        }
    })
}

/// Most pairs a trace-entry dict read by `trace_entry` may have (real ones have 6–8).
const MAX_ENTRY_PAIRS: usize = 16;
/// Most bytes a trace-entry dict read by `trace_entry` may take (real ones take 100–600).
const ENTRY_WINDOW_BYTES: usize = 16 << 10;

/// What `scan_entry` read.
struct Scanned {
    bytes_used: usize,
    has_list: bool,
}

/// Reads the body of a dict that may be a trace entry, after its EMPTY_DICT, from `b`: `MEMOIZE MARK`,
/// then pairs of a memoized key string and a value — an int, None, a bool, a memoized string, scalar
/// or stack, or (under the `frames` key, once) a new frame list of memoized frames — up to `SETITEMS`.
/// The values go to `fields` by key code (as the generic loop would have them on its stack; those of
/// other keys are read and dropped, as `trace` ignores them), the list's frame ids to `frames` (the
/// list is `V::EntryFrames`). `None` for anything else, a key code seen twice included.
#[inline]
fn scan_entry(
    b: &[u8],
    memo: &[u32],
    strings: &[StrMeta],
    scalars: &[V],
    fields: &mut Fields,
    frames: &mut Vec<u32>,
) -> Option<Scanned> {
    /// The memo index of a BINGET (1 byte) or LONG_BINGET (4 bytes) whose argument starts at `i`, read
    /// without a branch on which (frame lists mix both unpredictably); needs 4 bytes either way.
    #[inline(always)]
    fn memo_index(b: &[u8], i: &mut usize, code: u8) -> Option<usize> {
        let raw = u32::from_le_bytes(b.get(*i..*i + 4)?.try_into().ok()?);
        let short = code == op::BINGET;
        *i += if short { 1 } else { 4 };
        Some(if short { raw & 0xff } else { raw } as usize)
    }
    if b.get(..2)? != [op::MEMOIZE, op::MARK] {
        return None;
    }
    let mut i = 2;
    let (mut n, mut has_list, mut codes_seen) = (0usize, false, 0u32);
    loop {
        let code = *b.get(i)?;
        i += 1;
        if code == op::SETITEMS {
            break;
        }
        if (code != op::BINGET && code != op::LONG_BINGET) || n == MAX_ENTRY_PAIRS {
            return None;
        }
        let slot = *memo.get(memo_index(b, &mut i, code)?)?;
        if slot >> TAG_SHIFT != M_STR {
            return None;
        }
        let key_code = strings[(slot & PAYLOAD) as usize].key;
        if key_code != 0 {
            if codes_seen & 1 << key_code != 0 {
                return None;
            }
            codes_seen |= 1 << key_code;
        }
        let code = *b.get(i)?;
        i += 1;
        let value = match code {
            op::BINGET | op::LONG_BINGET => {
                let slot = *memo.get(memo_index(b, &mut i, code)?)?;
                let payload = slot & PAYLOAD;
                match slot >> TAG_SHIFT {
                    M_STR => V::Str(payload),
                    M_SCALAR => scalars[payload as usize],
                    M_STACK => V::Stack(if payload == NO_STACK_PAYLOAD { NO_STACK } else { payload }),
                    _ => return None,
                }
            }
            op::BININT1 => {
                let v = *b.get(i)?;
                i += 1;
                V::Int(v as i64)
            }
            op::BININT2 => {
                let v = u16::from_le_bytes(b.get(i..i + 2)?.try_into().ok()?);
                i += 2;
                V::Int(v as i64)
            }
            op::BININT => {
                let v = u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?);
                i += 4;
                V::Int(v as i32 as i64)
            }
            op::LONG1 => {
                let len = *b.get(i)? as usize;
                let v = int_le(b.get(i + 1..i + 1 + len)?).ok()?;
                i += 1 + len;
                v
            }
            op::NONE => V::None,
            op::NEWTRUE => V::Bool(true),
            op::NEWFALSE => V::Bool(false),
            op::EMPTY_LIST if key_code == K_FRAMES && !has_list => {
                if *b.get(i)? != op::MEMOIZE {
                    return None;
                }
                i += 1;
                has_list = true;
                frames.clear();
                if b.get(i) == Some(&op::MARK) {
                    i += 1;
                    loop {
                        let code = *b.get(i)?;
                        i += 1;
                        if code == op::APPENDS {
                            break;
                        }
                        if code != op::BINGET && code != op::LONG_BINGET {
                            return None;
                        }
                        let slot = *memo.get(memo_index(b, &mut i, code)?)?;
                        if slot >> TAG_SHIFT != M_FRAME {
                            return None;
                        }
                        frames.push(slot & PAYLOAD);
                    }
                }
                V::EntryFrames
            }
            _ => return None,
        };
        fields[key_code as usize] = Some(value);
        n += 1;
    }
    Some(Scanned { bytes_used: i, has_list })
}

/// Buffered input that keeps the opcode's arguments contiguous.
struct Input<Rd: Read> {
    inner: Rd,
    buf: Vec<u8>,
    pos: usize,
    end: usize,
    eof: bool,
}

const BUF_BYTES: usize = 1 << 20;

impl<Rd: Read> Input<Rd> {
    fn new(inner: Rd) -> Self {
        Input { inner, buf: vec![0; BUF_BYTES], pos: 0, end: 0, eof: false }
    }

    /// Makes `n` bytes available at `pos` (gives up at the end of the input or for `n` > the buffer).
    #[cold]
    fn fill(&mut self, n: usize) -> R<()> {
        if n > self.buf.len() {
            return Err(Bail);
        }
        self.buf.copy_within(self.pos..self.end, 0);
        self.end -= self.pos;
        self.pos = 0;
        while self.end < n {
            if self.eof {
                return Err(Bail);
            }
            match self.inner.read(&mut self.buf[self.end..]) {
                Ok(0) => self.eof = true,
                Ok(k) => self.end += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Err(Bail),
            }
        }
        Ok(())
    }

    /// The buffered bytes from `pos`, at least `n` of them unless the input ends first (reads more when
    /// fewer are buffered; gives up only on a read error).
    #[inline]
    fn window(&mut self, n: usize) -> R<&[u8]> {
        if self.end - self.pos < n && !self.eof {
            self.refill(n)?;
        }
        Ok(&self.buf[self.pos..self.end])
    }

    #[cold]
    fn refill(&mut self, n: usize) -> R<()> {
        let n = n.min(self.buf.len());
        self.buf.copy_within(self.pos..self.end, 0);
        self.end -= self.pos;
        self.pos = 0;
        while self.end < n && !self.eof {
            match self.inner.read(&mut self.buf[self.end..]) {
                Ok(0) => self.eof = true,
                Ok(k) => self.end += k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Err(Bail),
            }
        }
        Ok(())
    }

    #[inline(always)]
    fn take(&mut self, n: usize) -> R<&[u8]> {
        if self.end - self.pos < n {
            self.fill(n)?;
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline(always)]
    fn u8(&mut self) -> R<u8> {
        if self.pos < self.end {
            let b = self.buf[self.pos];
            self.pos += 1;
            return Ok(b);
        }
        Ok(self.take(1)?[0])
    }

    /// The next byte, if it is in the buffer (no read).
    #[inline(always)]
    fn peek(&self) -> Option<u8> {
        self.buf[..self.end].get(self.pos).copied()
    }

    #[inline(always)]
    fn u16(&mut self) -> R<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes")))
    }

    #[inline(always)]
    fn u32(&mut self) -> R<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }
}

struct Reader<Rd: Read> {
    input: Input<Rd>,
    stack: Vec<V>,
    marks: Vec<usize>,
    memo: Vec<u32>,
    scalars: Vec<V>,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    text: String,
    strings: Vec<StrMeta>,
    /// Trace entries converted but not yet appended to a list; `pending_base` is the sequence number of
    /// `pending[0]`.
    pending: Vec<TraceEntry>,
    pending_base: u64,
    interner: Interner,
    blocks: Vec<Block>,
    scratch_ids: Vec<u32>,
    shapes: Vec<Shape>,
    /// Frame ids of the frame list `trace_entry` read (`V::EntryFrames`).
    entry_frames: Vec<u32>,
    /// Where trace entries go instead of their list's `entries` ([`read_streaming`]).
    sink: Option<Box<dyn EntrySink>>,
    /// The list behind each device trace (`build`), for the sink's user.
    device_lists: Vec<Option<u32>>,
}

/// Receives the trace entries as the decoder appends them to a list, in order, in batches (a pickle's
/// APPENDS: about 1000 entries). `list` identifies the list; [`read_streaming`] says which device trace
/// each list is. Entries streamed here are not kept in the [`Snapshot`].
pub trait EntrySink {
    fn append(&mut self, list: u32, entries: &[TraceEntry]);
}

/// Decodes a snapshot pickle, or gives up ([`Bail`]) for the generic decoder to take over.
pub fn read<Rd: Read>(reader: Rd) -> Result<Snapshot, Bail> {
    reader_of(reader, None).map(|(s, _)| s)
}

/// Decodes a snapshot pickle, handing every trace entry to `sink` as it is read instead of keeping it
/// (the snapshot's `device_traces` are left empty, one per device): a consumer builds its own compact
/// model while the file streams in. Returns the snapshot and, per device trace, the sink's list id (None
/// for a `None` trace). On [`Bail`] the sink has seen part of the entries: discard what it built.
pub fn read_streaming<Rd: Read>(reader: Rd, sink: Box<dyn EntrySink>) -> Result<(Snapshot, Vec<Option<u32>>), Bail> {
    reader_of(reader, Some(sink))
}

fn reader_of<Rd: Read>(reader: Rd, sink: Option<Box<dyn EntrySink>>) -> Result<(Snapshot, Vec<Option<u32>>), Bail> {
    let mut r = Reader {
        input: Input::new(reader),
        stack: Vec::with_capacity(256),
        marks: Vec::with_capacity(64),
        memo: Vec::new(),
        scalars: Vec::new(),
        nodes: Vec::new(),
        free_nodes: Vec::new(),
        text: String::new(),
        strings: Vec::new(),
        pending: Vec::new(),
        pending_base: 0,
        interner: Interner::new(),
        blocks: Vec::new(),
        scratch_ids: Vec::new(),
        shapes: Vec::new(),
        entry_frames: Vec::new(),
        sink,
        device_lists: Vec::new(),
    };
    let root = r.run()?;
    r.sink = None;
    let snap = r.build(root)?;
    Ok((snap, r.device_lists))
}

impl<Rd: Read> Reader<Rd> {
    fn new_node(&mut self, kind: Kind) -> V {
        if let Some(id) = self.free_nodes.pop() {
            let n = &mut self.nodes[id as usize];
            n.kind = kind;
            n.memo_idx = NO_MEMO;
            return V::Node(id, n.gen);
        }
        let id = self.nodes.len() as u32;
        self.nodes.push(Node {
            kind,
            gen: 0,
            memo_idx: NO_MEMO,
            items: Vec::new(),
            frames: Vec::new(),
            entries: Vec::new(),
            n_entries: 0,
            taken: false,
        });
        V::Node(id, 0)
    }

    /// The node behind a handle, if it is still the same container.
    #[inline]
    fn node(&self, v: V) -> R<&Node> {
        match v {
            V::Node(id, gen) => match self.nodes.get(id as usize) {
                Some(n) if n.gen == gen => Ok(n),
                _ => Err(Bail),
            },
            _ => Err(Bail),
        }
    }

    /// Frees a node the decoder turned into a record; its memo slot now holds `memo_value`.
    fn retire(&mut self, id: u32, memo_value: u32) {
        let n = &mut self.nodes[id as usize];
        if n.memo_idx != NO_MEMO {
            self.memo[n.memo_idx as usize] = memo_value;
        }
        n.gen = n.gen.wrapping_add(1);
        n.items.clear();
        n.frames.clear();
        n.memo_idx = NO_MEMO;
        // A node holding trace entries is never retired (lists are not records).
        self.free_nodes.push(id);
    }

    fn memo_put(&mut self, idx: usize) -> R<()> {
        if self.stack.len() <= self.floor() {
            return Err(Bail);
        }
        let v = *self.stack.last().ok_or(Bail)?;
        if idx > self.memo.len() + MAX_MEMO_GAP {
            return Err(Bail);
        }
        if idx == self.memo.len() {
            self.memo.push(M_EMPTY);
        } else if idx > self.memo.len() {
            self.memo.resize(idx + 1, M_EMPTY);
        } else if self.memo[idx] != M_EMPTY {
            return Err(Bail);
        }
        let slot = match v {
            V::Str(s) => pack(M_STR, s)?,
            V::Node(id, _) => {
                self.node(v)?;
                let n = &mut self.nodes[id as usize];
                if n.memo_idx != NO_MEMO {
                    return Err(Bail);
                }
                n.memo_idx = idx as u32;
                pack(M_NODE, id)?
            }
            V::Frame(f) => pack(M_FRAME, f)?,
            V::Stack(s) => pack(M_STACK, if s == NO_STACK { NO_STACK_PAYLOAD } else { s })?,
            V::Block(b) => pack(M_BLOCK, b)?,
            V::Trace(_) | V::EntryFrames => return Err(Bail),
            scalar => {
                self.scalars.push(scalar);
                pack(M_SCALAR, (self.scalars.len() - 1) as u32)?
            }
        };
        self.memo[idx] = slot;
        Ok(())
    }

    #[inline(always)]
    fn memo_get(&mut self, idx: usize) -> R<()> {
        let slot = *self.memo.get(idx).ok_or(Bail)?;
        let payload = slot & PAYLOAD;
        let v = match slot >> TAG_SHIFT {
            M_STR => V::Str(payload),
            M_NODE => V::Node(payload, self.nodes[payload as usize].gen),
            M_FRAME => V::Frame(payload),
            M_STACK => V::Stack(if payload == NO_STACK_PAYLOAD { NO_STACK } else { payload }),
            M_BLOCK => V::Block(payload),
            M_SCALAR => self.scalars[payload as usize],
            _ => return Err(Bail),
        };
        self.stack.push(v);
        Ok(())
    }

    fn push_str(&mut self, n: usize) -> R<()> {
        let bytes = self.input.take(n)?;
        let s = std::str::from_utf8(bytes).map_err(|_| Bail)?;
        let start = self.text.len();
        if start + n > u32::MAX as usize || self.strings.len() > PAYLOAD as usize {
            return Err(Bail);
        }
        self.text.push_str(s);
        let key = key_of_str(s);
        let id = self.strings.len() as u32;
        let action = Action::parse(s);
        self.strings.push(StrMeta { start: start as u32, len: n as u32, key, model: u32::MAX, action });
        self.stack.push(V::Str(id));
        Ok(())
    }

    fn str_text(&self, id: u32) -> &str {
        let m = self.strings[id as usize];
        &self.text[m.start as usize..(m.start + m.len) as usize]
    }

    /// The string's id in the snapshot's table (interned on first use, as the generic decoder does).
    fn model_str(&mut self, id: u32) -> u32 {
        let m = self.strings[id as usize];
        if m.model != u32::MAX {
            return m.model;
        }
        let text = &self.text[m.start as usize..(m.start + m.len) as usize];
        let model = self.interner.string(text);
        self.strings[id as usize].model = model;
        model
    }

    fn pop_mark(&mut self) -> R<usize> {
        self.marks.pop().ok_or(Bail)
    }

    /// The floor of the stack for the current mark.
    #[inline]
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn run(&mut self) -> R<V> {
        loop {
            let code = self.input.u8()?;
            match code {
                op::PROTO => {
                    if self.input.u8()? > crate::pickle::HIGHEST_PROTOCOL {
                        return Err(Bail);
                    }
                }
                op::FRAME => {
                    self.input.take(8)?;
                }
                op::STOP => {
                    if self.stack.len() <= self.floor() {
                        return Err(Bail);
                    }
                    return Ok(self.stack.pop().expect("checked"));
                }
                op::MARK => self.marks.push(self.stack.len()),
                op::POP => {
                    // `gen_synthetic.py` memoizes strings and pops them; `pickle.dump` does not.
                    if self.stack.len() <= self.floor() || matches!(self.stack.pop(), Some(V::Trace(_))) {
                        return Err(Bail);
                    }
                }
                op::EMPTY_DICT => {
                    if self.trace_entry()? {
                        continue;
                    }
                    let v = self.new_node(Kind::Dict);
                    self.stack.push(v);
                    self.dict_body()?;
                }
                op::EMPTY_LIST => {
                    let v = self.new_node(Kind::List);
                    self.stack.push(v);
                    self.frame_list(v)?;
                }
                op::EMPTY_TUPLE => {
                    let v = self.new_node(Kind::Tuple);
                    self.stack.push(v);
                }
                op::MEMOIZE => self.memo_put(self.memo.len())?,
                op::BINPUT => {
                    let i = self.input.u8()? as usize;
                    self.memo_put(i)?;
                }
                op::LONG_BINPUT => {
                    let i = self.input.u32()? as usize;
                    self.memo_put(i)?;
                }
                op::BINGET | op::LONG_BINGET => {
                    // Frame lists are long runs of memo fetches: stay in this loop while they last.
                    let mut c = code;
                    loop {
                        let i = if c == op::BINGET { self.input.u8()? as usize } else { self.input.u32()? as usize };
                        self.memo_get(i)?;
                        match self.input.peek() {
                            Some(n @ (op::BINGET | op::LONG_BINGET)) => {
                                self.input.pos += 1;
                                c = n;
                            }
                            _ => break,
                        }
                    }
                }
                op::SHORT_BINUNICODE => {
                    let n = self.input.u8()? as usize;
                    self.push_str(n)?;
                }
                op::BINUNICODE => {
                    let n = self.input.u32()? as usize;
                    self.push_str(n)?;
                }
                op::BININT1 => {
                    let b = self.input.u8()?;
                    self.stack.push(V::Int(b as i64));
                }
                op::BININT2 => {
                    let b = self.input.u16()?;
                    self.stack.push(V::Int(b as i64));
                }
                op::BININT => {
                    let b = self.input.u32()?;
                    self.stack.push(V::Int(b as i32 as i64));
                }
                op::LONG1 => {
                    let n = self.input.u8()? as usize;
                    let v = int_le(self.input.take(n)?)?;
                    self.stack.push(v);
                }
                op::NONE => self.stack.push(V::None),
                op::NEWTRUE => self.stack.push(V::Bool(true)),
                op::NEWFALSE => self.stack.push(V::Bool(false)),
                op::BINFLOAT => {
                    let b: [u8; 8] = self.input.take(8)?.try_into().expect("8 bytes");
                    self.stack.push(V::Float(f64::from_be_bytes(b)));
                }
                op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                    let n = (code - op::TUPLE1 + 1) as usize;
                    if self.stack.len() < self.floor() + n {
                        return Err(Bail);
                    }
                    let at = self.stack.len() - n;
                    self.make_tuple(at)?;
                }
                op::TUPLE => {
                    let m = self.pop_mark()?;
                    self.make_tuple(m)?;
                }
                op::APPENDS => {
                    let m = self.pop_mark()?;
                    if m == 0 || m - 1 < self.floor() {
                        return Err(Bail);
                    }
                    self.append(m - 1, m)?;
                }
                op::APPEND => {
                    let len = self.stack.len();
                    if len < self.floor() + 2 {
                        return Err(Bail);
                    }
                    self.append(len - 2, len - 1)?;
                }
                op::SETITEMS => {
                    let m = self.pop_mark()?;
                    if m == 0 || m - 1 < self.floor() || (self.stack.len() - m) % 2 != 0 {
                        return Err(Bail);
                    }
                    self.set_items(m - 1, m)?;
                }
                op::SETITEM => {
                    let len = self.stack.len();
                    if len < self.floor() + 3 {
                        return Err(Bail);
                    }
                    self.set_items(len - 3, len - 2)?;
                }
                _ => return Err(Bail),
            }
        }
    }

    /// The common shape of a frame list, `] MEMOIZE ( BINGET… APPENDS`, read in one loop into the list's
    /// frame ids (the list just pushed as `v`). Any other opcode stops the loop: what was read so far
    /// is put on the stack as the generic loop would have it, and decoding continues there.
    fn frame_list(&mut self, v: V) -> R<()> {
        let V::Node(id, _) = v else { return Ok(()) };
        if self.input.end - self.input.pos < 2 {
            return Ok(());
        }
        if self.input.buf[self.input.pos] != op::MEMOIZE || self.input.buf[self.input.pos + 1] != op::MARK {
            return Ok(());
        }
        self.input.pos += 2;
        self.memo_put(self.memo.len())?;
        let mut frames = std::mem::take(&mut self.nodes[id as usize].frames);
        frames.clear();
        let stop = loop {
            let Some(code) = self.input.peek() else {
                self.input.fill(1)?;
                continue;
            };
            let idx = match code {
                op::BINGET => {
                    self.input.pos += 1;
                    self.input.u8()? as usize
                }
                op::LONG_BINGET => {
                    self.input.pos += 1;
                    self.input.u32()? as usize
                }
                op::APPENDS => {
                    self.input.pos += 1;
                    break None;
                }
                _ => break Some(None),
            };
            let slot = *self.memo.get(idx).ok_or(Bail)?;
            if slot >> TAG_SHIFT == M_FRAME {
                frames.push(slot & PAYLOAD);
            } else {
                break Some(Some(idx));
            }
        };
        match stop {
            None => {
                // The whole list: its frames, no mark left.
                self.nodes[id as usize].frames = frames;
            }
            Some(fetched) => {
                // Back to the generic state: the mark, the frames read so far, then what stopped us.
                self.marks.push(self.stack.len());
                self.stack.extend(frames.iter().map(|&f| V::Frame(f)));
                frames.clear();
                self.nodes[id as usize].frames = frames;
                if let Some(idx) = fetched {
                    self.memo_get(idx)?;
                }
            }
        }
        Ok(())
    }

    /// The common shape of a record dict, `} MEMOIZE ( key value … SETITEMS`, read in a loop of its own
    /// (the dict was just pushed). The state stays the generic one at every step, so any other opcode
    /// simply hands over to the main loop.
    fn dict_body(&mut self) -> R<()> {
        let inp = &self.input;
        if inp.end - inp.pos < 2 || inp.buf[inp.pos] != op::MEMOIZE || inp.buf[inp.pos + 1] != op::MARK {
            return Ok(());
        }
        self.input.pos += 2;
        self.memo_put(self.memo.len())?;
        self.marks.push(self.stack.len());
        let depth = self.marks.len();
        loop {
            if self.input.end - self.input.pos < 10 {
                return Ok(());
            }
            let code = self.input.buf[self.input.pos];
            self.input.pos += 1;
            match code {
                op::BINGET => {
                    let i = self.input.u8()? as usize;
                    self.memo_get(i)?;
                }
                op::LONG_BINGET => {
                    let i = self.input.u32()? as usize;
                    self.memo_get(i)?;
                }
                op::LONG1 => {
                    let n = self.input.u8()? as usize;
                    let v = int_le(self.input.take(n)?)?;
                    self.stack.push(v);
                }
                op::BININT1 => {
                    let b = self.input.u8()?;
                    self.stack.push(V::Int(b as i64));
                }
                op::BININT2 => {
                    let b = self.input.u16()?;
                    self.stack.push(V::Int(b as i64));
                }
                op::BININT => {
                    let b = self.input.u32()?;
                    self.stack.push(V::Int(b as i32 as i64));
                }
                op::NONE => self.stack.push(V::None),
                op::EMPTY_LIST => {
                    let v = self.new_node(Kind::List);
                    self.stack.push(v);
                    self.frame_list(v)?;
                    if self.marks.len() != depth {
                        return Ok(());
                    }
                }
                op::SETITEMS => {
                    let m = self.pop_mark()?;
                    if m == 0 || m - 1 < self.floor() || (self.stack.len() - m) % 2 != 0 {
                        return Err(Bail);
                    }
                    return self.set_items(m - 1, m);
                }
                _ => {
                    self.input.pos -= 1;
                    return Ok(());
                }
            }
        }
    }

    /// A whole trace-entry dict, `} MEMOIZE ( key value … SETITEMS` with at most one frame list `] MEMOIZE
    /// ( BINGET… APPENDS` in it, read in one pass (the EMPTY_DICT is consumed): no node, no stack traffic,
    /// and its two memo slots written once, as the generic loop leaves them (the dict gone, the list its
    /// stack). A dict with an `action` key is a trace entry (`classify`); with no key code twice and its
    /// strings interned, `set_items` would take `trace_by_position`, and this builds the entry the same
    /// way (`trace_of_fields`). When the bytes are anything else (a frame or block dict, a new string
    /// inside, a repeated key, a shared container, a long entry, the end of the input) it returns false
    /// having changed nothing, and the generic loop reads the dict from the same byte.
    fn trace_entry(&mut self) -> R<bool> {
        let mut fields: Fields = [None; 17];
        let bytes = self.input.window(ENTRY_WINDOW_BYTES)?;
        let scan = scan_entry(bytes, &self.memo, &self.strings, &self.scalars, &mut fields, &mut self.entry_frames);
        let Some(Scanned { bytes_used, has_list }) = scan else { return Ok(false) };
        if fields[K_ACTION as usize].is_none() {
            return Ok(false);
        }
        let Some(t) = self.trace_of_fields(&fields)? else { return Ok(false) };
        self.input.pos += bytes_used;
        self.memo.push(pack(M_GONE, 0)?);
        if has_list {
            // `scan_entry` takes one frame list, under the `frames` key: it is the entry's stack.
            self.memo.push(pack(M_STACK, if t.stack == NO_STACK { NO_STACK_PAYLOAD } else { t.stack })?);
        }
        self.pending.push(t);
        self.stack.push(V::Trace(self.pending_base + self.pending.len() as u64 - 1));
        Ok(true)
    }

    /// Replaces `stack[at..]` by a tuple of them.
    fn make_tuple(&mut self, at: usize) -> R<()> {
        let v = self.new_node(Kind::Tuple);
        let V::Node(id, _) = v else { unreachable!() };
        let mut items = std::mem::take(&mut self.nodes[id as usize].items);
        items.clear();
        items.extend(self.stack.drain(at..));
        self.nodes[id as usize].items = items;
        self.stack.push(v);
        Ok(())
    }

    /// Appends `stack[from..]` to the list at `stack[target]`.
    fn append(&mut self, target: usize, from: usize) -> R<()> {
        let t = self.stack[target];
        let V::Node(id, _) = t else { return Err(Bail) };
        if self.node(t)?.kind != Kind::List {
            return Err(Bail);
        }
        let n_items = self.stack.len() - from;
        if n_items == 0 {
            return Ok(());
        }
        if let V::Trace(first) = self.stack[from] {
            // A run of trace entries, in the order they were read, moves into this list.
            if first != self.pending_base || (n_items as u64) > self.pending.len() as u64 {
                return Err(Bail);
            }
            for (k, v) in self.stack[from..].iter().enumerate() {
                if !matches!(v, V::Trace(s) if *s == first + k as u64) {
                    return Err(Bail);
                }
            }
            let node = &mut self.nodes[id as usize];
            if !node.items.is_empty() || !node.frames.is_empty() {
                return Err(Bail);
            }
            match &mut self.sink {
                Some(sink) => {
                    sink.append(id, &self.pending[..n_items]);
                    self.pending.drain(..n_items);
                }
                None => node.entries.extend(self.pending.drain(..n_items)),
            }
            node.n_entries += n_items as u64;
            self.pending_base += n_items as u64;
            self.stack.truncate(from);
            return Ok(());
        }
        let node = &mut self.nodes[id as usize];
        if node.n_entries != 0 {
            return Err(Bail);
        }
        if !node.frames.is_empty() {
            let frames = std::mem::take(&mut node.frames);
            node.items.extend(frames.iter().map(|&f| V::Frame(f)));
        }
        for v in &self.stack[from..] {
            if matches!(v, V::Trace(_)) {
                return Err(Bail);
            }
        }
        node.items.extend_from_slice(&self.stack[from..]);
        self.stack.truncate(from);
        Ok(())
    }

    /// Sets the pairs `stack[from..]` in the dict at `stack[target]`, then turns it into a record if it
    /// is a frame, block or trace entry (as `decode::SnapshotCompactor::on_dict` decides).
    fn set_items(&mut self, target: usize, from: usize) -> R<()> {
        let t = self.stack[target];
        let V::Node(id, _) = t else { return Err(Bail) };
        let node = self.node(t)?;
        if node.kind != Kind::Dict {
            return Err(Bail);
        }
        for v in &self.stack[from..] {
            if matches!(v, V::Trace(_)) {
                return Err(Bail);
            }
        }
        // Pairs of a dict filled in one batch are used from the stack, without copying.
        let fresh = node.items.is_empty();
        if !fresh {
            self.nodes[id as usize].items.extend_from_slice(&self.stack[from..]);
            self.stack.truncate(from);
        }
        let stack = std::mem::take(&mut self.stack);
        let mut items = if fresh { Vec::new() } else { std::mem::take(&mut self.nodes[id as usize].items) };
        let pairs: &[V] = if fresh { &stack[from..] } else { &items };
        let shape = self.shape_of(pairs);
        let kind = match shape {
            Some(i) => self.shapes[i].kind,
            None => classify(self, pairs),
        };
        let result = match kind {
            DictKind::Other => None,
            DictKind::Trace => {
                let fast = match shape {
                    Some(i) if !self.shapes[i].repeated => {
                        let pos = self.shapes[i].pos;
                        self.trace_by_position(pairs, &pos)?
                    }
                    _ => None,
                };
                let t = match fast {
                    Some(t) => t,
                    None => self.trace(pairs)?,
                };
                self.pending.push(t);
                Some((V::Trace(self.pending_base + self.pending.len() as u64 - 1), pack(M_GONE, 0)?))
            }
            DictKind::Block => {
                let b = self.block(pairs)?;
                self.blocks.push(b);
                let bid = (self.blocks.len() - 1) as u32;
                Some((V::Block(bid), pack(M_BLOCK, bid)?))
            }
            DictKind::Frame => {
                let f = self.frame(pairs)?;
                Some((V::Frame(f), pack(M_FRAME, f)?))
            }
        };
        self.stack = stack;
        let Some(result) = result else {
            // Not a record: the pairs stay in the dict.
            if fresh {
                self.nodes[id as usize].items.extend_from_slice(&self.stack[from..]);
                self.stack.truncate(from);
            } else {
                self.nodes[id as usize].items = items;
            }
            return Ok(());
        };
        items.clear();
        if !fresh {
            self.nodes[id as usize].items = items;
        }
        let (value, slot) = result;
        self.stack.truncate(from);
        self.retire(id, slot);
        self.stack[target] = value;
        Ok(())
    }

    /// The cached shape of these pairs (building it the first time), or `None` when a key is not a string.
    fn shape_of(&mut self, pairs: &[V]) -> Option<usize> {
        let n = pairs.len() / 2;
        'shapes: for (i, sh) in self.shapes.iter().enumerate() {
            if sh.keys.len() != n {
                continue;
            }
            for (k, kv) in sh.keys.iter().zip(pairs.chunks_exact(2)) {
                if !matches!(kv[0], V::Str(s) if s == *k) {
                    continue 'shapes;
                }
            }
            return Some(i);
        }
        let mut keys = Vec::with_capacity(n);
        let mut pos = [NO_POS; 17];
        let mut repeated = false;
        for (i, kv) in pairs.chunks_exact(2).enumerate() {
            let V::Str(s) = kv[0] else { return None };
            keys.push(s);
            let code = self.strings[s as usize].key as usize;
            if code != 0 {
                repeated |= pos[code] != NO_POS;
                pos[code] = i.min(NO_POS as usize - 1) as u8;
            }
        }
        if n >= NO_POS as usize {
            return None;
        }
        let kind = classify(self, pairs);
        if self.shapes.len() == MAX_SHAPES {
            self.shapes.pop();
        }
        self.shapes.insert(0, Shape { keys, kind, pos, repeated });
        Some(0)
    }

    /// A trace entry read by field position (its shape is known and has no repeated key); `None` when a
    /// string it needs is not interned yet (then `trace` interns in the generic order).
    #[inline]
    fn trace_by_position(&mut self, pairs: &[V], pos: &[u8; 17]) -> R<Option<TraceEntry>> {
        let mut fields: Fields = [None; 17];
        for (code, &p) in pos.iter().enumerate() {
            if p != NO_POS {
                fields[code] = Some(pairs[2 * p as usize + 1]);
            }
        }
        self.trace_of_fields(&fields)
    }

    /// A trace entry from its values by key code (a dict with no key code twice); `None` when a string
    /// it needs is not interned yet (then `trace` interns in the generic order).
    #[inline]
    fn trace_of_fields(&mut self, fields: &Fields) -> R<Option<TraceEntry>> {
        let get = |code: u8| fields[code as usize];
        let interned = |r: &Self, v: Option<V>| -> R<Option<u32>> {
            match v {
                None | Some(V::None) => Ok(Some(0)),
                Some(V::Str(s)) => {
                    let m = r.strings[s as usize].model;
                    Ok((m != u32::MAX).then_some(m))
                }
                Some(_) => Err(Bail),
            }
        };
        let Some(V::Str(a)) = get(K_ACTION) else { return Err(Bail) };
        if self.strings[a as usize].model == u32::MAX {
            return Ok(None);
        }
        let (Some(user_metadata), Some(compile_context)) =
            (interned(self, get(K_USER_METADATA))?, interned(self, get(K_COMPILE_CONTEXT))?)
        else {
            return Ok(None);
        };
        let opt_u64 = |r: &Self, code: u8| -> R<Option<u64>> {
            match get(code) {
                None => Ok(None),
                Some(v) => r.u64_of(v),
            }
        };
        let opt_i64 = |r: &Self, code: u8| -> R<i64> {
            match get(code) {
                None => Ok(0),
                Some(v) => r.i64_of(v),
            }
        };
        let action = self.strings[a as usize].action;
        let addr = opt_u64(self, K_ADDR)?.unwrap_or(0);
        let size_bytes = opt_u64(self, K_SIZE)?.unwrap_or(0);
        let info = EntryInfo {
            stream: opt_i64(self, K_STREAM)?,
            device_free_bytes: opt_u64(self, K_DEVICE_FREE)?,
            user_metadata,
            compile_context,
        };
        let time_us = opt_i64(self, K_TIME_US)?;
        let stack = self.stack_of(get(K_FRAMES))?;
        let info = self.interner.info(info).ok_or(Bail)?;
        Ok(Some(TraceEntry::new(action, addr, size_bytes, time_us, stack, info)))
    }

    fn u64_of(&self, v: V) -> R<Option<u64>> {
        Ok(match v {
            V::None => None,
            V::Int(i) if i >= 0 => Some(i as u64),
            V::U64(u) => Some(u),
            V::Bool(b) => Some(b as u64),
            _ => return Err(Bail),
        })
    }

    fn i64_of(&self, v: V) -> R<i64> {
        Ok(match v {
            V::None => 0,
            V::Int(i) => i,
            V::U64(u) => u as i64,
            V::Bool(b) => b as i64,
            _ => return Err(Bail),
        })
    }

    /// A string value's snapshot id ("" for None).
    fn str_id(&mut self, v: V) -> R<u32> {
        match v {
            V::None => Ok(self.interner.string("")),
            V::Str(s) => Ok(self.model_str(s)),
            _ => Err(Bail),
        }
    }

    fn key(&self, k: V) -> u8 {
        match k {
            V::Str(s) => self.strings[s as usize].key,
            _ => 0,
        }
    }

    fn frame(&mut self, pairs: &[V]) -> R<u32> {
        let (mut filename, mut name, mut line) = (0u32, 0u32, 0i64);
        for kv in pairs.chunks_exact(2) {
            match self.key(kv[0]) {
                K_FILENAME => filename = self.str_id(kv[1])?,
                K_NAME => name = self.str_id(kv[1])?,
                K_LINE => line = self.i64_of(kv[1])?,
                _ => {}
            }
        }
        Ok(self.interner.frame(Frame { filename, name, line }))
    }

    /// The stack id of a `frames` value; a frame list becomes a stack (its memo slot too).
    fn stack_of(&mut self, v: Option<V>) -> R<StackId> {
        match v {
            None | Some(V::None) => Ok(NO_STACK),
            Some(V::Stack(s)) => Ok(s),
            Some(V::EntryFrames) => Ok(self.interner.stack_slice(&self.entry_frames)),
            Some(l @ V::Node(id, _)) => {
                let n = self.node(l)?;
                if n.kind != Kind::List || n.n_entries != 0 {
                    return Err(Bail);
                }
                if !n.frames.is_empty() {
                    let sid = self.interner.stack_slice(&self.nodes[id as usize].frames);
                    let slot = pack(M_STACK, if sid == NO_STACK { NO_STACK_PAYLOAD } else { sid })?;
                    self.retire(id, slot);
                    return Ok(sid);
                }
                let mut ids = std::mem::take(&mut self.scratch_ids);
                ids.clear();
                for f in &self.nodes[id as usize].items {
                    match f {
                        V::Frame(fid) => ids.push(*fid),
                        _ => {
                            self.scratch_ids = ids;
                            return Err(Bail);
                        }
                    }
                }
                let sid = self.interner.stack_slice(&ids);
                self.scratch_ids = ids;
                let slot = pack(M_STACK, if sid == NO_STACK { NO_STACK_PAYLOAD } else { sid })?;
                self.retire(id, slot);
                Ok(sid)
            }
            Some(_) => Err(Bail),
        }
    }

    fn trace(&mut self, pairs: &[V]) -> R<TraceEntry> {
        let (mut action, mut addr, mut size_bytes, mut time_us) = (None, 0u64, 0u64, 0i64);
        let mut info = EntryInfo::default();
        let mut frames = None;
        for kv in pairs.chunks_exact(2) {
            let v = kv[1];
            match self.key(kv[0]) {
                K_ACTION => {
                    let V::Str(s) = v else { return Err(Bail) };
                    self.model_str(s);
                    action = Some(self.strings[s as usize].action);
                }
                K_ADDR => addr = self.u64_of(v)?.unwrap_or(0),
                K_SIZE => size_bytes = self.u64_of(v)?.unwrap_or(0),
                K_STREAM => info.stream = self.i64_of(v)?,
                K_TIME_US => time_us = self.i64_of(v)?,
                K_DEVICE_FREE => info.device_free_bytes = self.u64_of(v)?,
                K_USER_METADATA => info.user_metadata = self.str_id(v)?,
                K_COMPILE_CONTEXT => info.compile_context = self.str_id(v)?,
                K_FRAMES => frames = Some(v),
                _ => {}
            }
        }
        let action = action.ok_or(Bail)?;
        let stack = self.stack_of(frames)?;
        let info = self.interner.info(info).ok_or(Bail)?;
        Ok(TraceEntry::new(action, addr, size_bytes, time_us, stack, info))
    }

    fn block(&mut self, pairs: &[V]) -> R<Block> {
        let mut state = None;
        let (mut address, mut size, mut requested) = (None, None, 0u64);
        let mut frames = None;
        for kv in pairs.chunks_exact(2) {
            let v = kv[1];
            match self.key(kv[0]) {
                K_STATE => {
                    let V::Str(s) = v else { return Err(Bail) };
                    state = Some(match self.str_text(s) {
                        "active_allocated" => BlockState::ActiveAllocated,
                        "active_pending_free" => BlockState::ActivePendingFree,
                        "inactive" => BlockState::Inactive,
                        _ => return Err(Bail),
                    })
                }
                K_ADDRESS => address = self.u64_of(v)?,
                K_SIZE => size = self.u64_of(v)?,
                K_REQUESTED_SIZE => requested = self.u64_of(v)?.unwrap_or(0),
                K_FRAMES => frames = Some(v),
                _ => {}
            }
        }
        let (address, size_bytes, state) = (address.ok_or(Bail)?, size.ok_or(Bail)?, state.ok_or(Bail)?);
        let stack = self.stack_of(frames)?;
        Ok(Block { address, size_bytes, requested_bytes: requested, state, stack })
    }

    /// Value of `key` in a dict node (the last occurrence wins, as in Python).
    fn dict_get(&self, d: V, key: &str) -> R<Option<V>> {
        let n = self.node(d)?;
        Ok(n.items
            .chunks_exact(2)
            .rev()
            .find(|kv| matches!(kv[0], V::Str(s) if self.str_text(s) == key))
            .map(|kv| kv[1]))
    }

    fn is_dict(&self, v: V) -> bool {
        self.node(v).is_ok_and(|n| n.kind == Kind::Dict)
    }

    fn seq_items(&self, v: V) -> R<Vec<V>> {
        let n = self.node(v)?;
        if n.kind == Kind::Dict || n.n_entries != 0 || !n.frames.is_empty() {
            return Err(Bail);
        }
        Ok(n.items.clone())
    }

    fn opt_u64(&self, d: V, key: &str) -> R<u64> {
        Ok(match self.dict_get(d, key)? {
            None => 0,
            Some(v) => self.u64_of(v)?.unwrap_or(0),
        })
    }

    fn opt_i64(&self, d: V, key: &str) -> R<i64> {
        match self.dict_get(d, key)? {
            None => Ok(0),
            Some(v) => self.i64_of(v),
        }
    }

    /// `as_i64` of the generic value (ints and bools), else 0.
    fn loose_i64(&self, v: V) -> i64 {
        match v {
            V::Int(i) => i,
            V::Bool(b) => b as i64,
            _ => 0,
        }
    }

    fn segment(&self, v: V) -> R<Segment> {
        if !self.is_dict(v) {
            return Err(Bail);
        }
        let mut blocks = Vec::new();
        if let Some(bl) = self.dict_get(v, "blocks")? {
            for b in self.seq_items(bl)? {
                match b {
                    V::Block(id) => blocks.push(self.blocks[id as usize]),
                    _ => return Err(Bail),
                }
            }
        }
        let pool_id = match self.dict_get(v, "segment_pool_id")? {
            Some(p @ V::Node(..)) => {
                let n = self.node(p)?;
                if n.kind != Kind::Dict && n.n_entries == 0 && n.frames.is_empty() && n.items.len() == 2 {
                    (self.loose_i64(n.items[0]), self.loose_i64(n.items[1]))
                } else {
                    (0, 0)
                }
            }
            _ => (0, 0),
        };
        let required = |key: &str| -> R<u64> { self.u64_of(self.dict_get(v, key)?.ok_or(Bail)?)?.ok_or(Bail) };
        let segment_type = match self.dict_get(v, "segment_type")? {
            None | Some(V::None) => String::new(),
            Some(V::Str(s)) => self.str_text(s).to_string(),
            Some(_) => return Err(Bail),
        };
        Ok(Segment {
            device: self.opt_i64(v, "device")?,
            address: required("address")?,
            total_bytes: required("total_size")?,
            allocated_bytes: self.opt_u64(v, "allocated_size")?,
            active_bytes: self.opt_u64(v, "active_size")?,
            requested_bytes: self.opt_u64(v, "requested_size")?,
            stream: self.opt_i64(v, "stream")?,
            segment_type,
            pool_id,
            is_expandable: matches!(self.dict_get(v, "is_expandable")?, Some(V::Bool(true))),
            blocks,
        })
    }

    /// Plain JSON of a small value, as `decode::value_to_json`.
    fn to_json(&self, v: V, depth: usize) -> R<serde_json::Value> {
        use serde_json::Value as J;
        if depth > 16 {
            return Ok(J::Null);
        }
        Ok(match v {
            V::None => J::Null,
            V::Bool(b) => J::Bool(b),
            V::Int(i) => J::from(i),
            V::U64(u) => J::from(u),
            V::Float(f) => serde_json::Number::from_f64(f).map(J::Number).unwrap_or(J::Null),
            V::Str(s) => J::String(self.str_text(s).to_string()),
            V::Frame(_) | V::Stack(_) | V::Block(_) => J::Null,
            V::Trace(_) | V::EntryFrames => return Err(Bail),
            V::Node(..) => {
                let n = self.node(v)?;
                if n.n_entries != 0 || !n.frames.is_empty() {
                    return Err(Bail);
                }
                match n.kind {
                    Kind::Dict => {
                        let mut m = serde_json::Map::new();
                        for kv in n.items.chunks_exact(2).take(10_000) {
                            let key = match kv[0] {
                                V::Str(s) => self.str_text(s).to_string(),
                                other => format!("{}", self.to_json(other, depth + 1)?),
                            };
                            m.insert(key, self.to_json(kv[1], depth + 1)?);
                        }
                        J::Object(m)
                    }
                    _ => J::Array(
                        n.items.iter().take(10_000).map(|x| self.to_json(*x, depth + 1)).collect::<R<Vec<_>>>()?,
                    ),
                }
            }
        })
    }

    fn annotation_str(&self, d: V, key: &str) -> R<String> {
        Ok(match self.dict_get(d, key)? {
            Some(V::Str(s)) => self.str_text(s).to_string(),
            _ => String::new(),
        })
    }

    fn annotation_i64(&self, d: V, key: &str) -> R<i64> {
        Ok(match self.dict_get(d, key)? {
            None => 0,
            Some(v) => self.i64_of(v).unwrap_or(0),
        })
    }

    fn build(&mut self, root: V) -> R<Snapshot> {
        if !self.pending.is_empty() || !self.is_dict(root) {
            return Err(Bail);
        }
        let has = |r: &Self, key: &str| -> R<bool> { Ok(r.dict_get(root, key)?.is_some()) };
        if !has(self, "segments")? && !has(self, "device_traces")? {
            return Err(Bail);
        }
        let mut snap = Snapshot::default();
        if let Some(sv) = self.dict_get(root, "segments")? {
            for s in self.seq_items(sv)? {
                snap.segments.push(self.segment(s)?);
            }
        }
        if let Some(tv) = self.dict_get(root, "device_traces")? {
            let mut seen = HashSet::new();
            for dev in self.seq_items(tv)? {
                match dev {
                    V::None => {
                        snap.device_traces.push(Vec::new());
                        self.device_lists.push(None);
                    }
                    V::Node(id, _) => {
                        let n = self.node(dev)?;
                        if n.kind != Kind::List
                            || !n.items.is_empty()
                            || !n.frames.is_empty()
                            || n.taken
                            || !seen.insert(id)
                        {
                            return Err(Bail);
                        }
                        let n = &mut self.nodes[id as usize];
                        n.taken = true;
                        n.n_entries = 0;
                        snap.device_traces.push(std::mem::take(&mut n.entries));
                        self.device_lists.push(Some(id));
                    }
                    _ => return Err(Bail),
                }
            }
        }
        if let Some(sv) = self.dict_get(root, "allocator_settings")? {
            if self.is_dict(sv) {
                if let serde_json::Value::Object(m) = self.to_json(sv, 0)? {
                    snap.allocator_settings = m;
                }
            }
        }
        if let Some(av) = self.dict_get(root, "external_annotations")? {
            if let Ok(list) = self.seq_items(av) {
                for a in list {
                    if matches!(a, V::Node(..)) && self.node(a)?.kind == Kind::Dict {
                        snap.annotations.push(Annotation {
                            name: self.annotation_str(a, "name")?,
                            stage: self.annotation_str(a, "stage")?,
                            device: self.annotation_i64(a, "device")?,
                            time_us: self.annotation_i64(a, "time_us")?,
                        });
                    }
                }
            }
        }
        // Trace entries must all sit in device traces (the generic decoder counts the others too).
        let stray = self.nodes.iter().any(|n| n.n_entries != 0);
        if stray {
            return Err(Bail);
        }
        let it = std::mem::take(&mut self.interner);
        snap.strings = it.strings;
        snap.frames = it.frames;
        snap.stacks = it.stacks;
        snap.entry_infos = it.infos;
        Ok(snap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/snapshots").join(name);
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    #[test]
    fn every_fixture_decodes_fast_and_equals_the_generic_decoder() {
        for name in [
            "snapshot_gpt2_bs8_amp_cppstacks.pickle",
            "snapshot_mlp_adam_cppstacks.pickle",
            "snapshot_mlp_adam_pystacks.pickle",
            "snapshot_resnet50_bs64_amp_cppstacks.pickle",
            "snapshot_resnet50_bs64_fp32_cppstacks.pickle",
        ] {
            let data = fixture(name);
            let fast = read(&data[..]).unwrap_or_else(|_| panic!("{name}: the fast decoder gave up"));
            let generic = crate::read_pickle_generic(&data[..], name).unwrap();
            assert!(fast.trace_entries() > 0, "{name}");
            assert!(fast == generic, "{name}: the fast and generic decoders disagree");
        }
    }

    #[test]
    fn the_synthetic_bench_shape_decodes_fast() {
        // `gen_synthetic.py --entries 300 --segments 3`: memoized-then-popped strings, APPENDS batches.
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/synthetic_300.pickle");
        let data = std::fs::read(p).unwrap();
        let fast = read(&data[..]).expect("the fast decoder takes the synthetic shape");
        assert_eq!(fast.trace_entries(), 300);
        assert_eq!(fast.segments.len(), 3);
        assert!(fast == crate::read_pickle_generic(&data[..], "synthetic").unwrap());
    }

    #[test]
    fn trace_entries_of_every_shape_decode_as_the_generic_decoder_does() {
        // tests/data/entry_shapes.pickle: `pickle.dumps(snap, protocol=4)` of a snapshot whose trace has
        // a traceback list shared by three entries (memo fetches of a stack), a new string and None
        // values inside an entry, an empty frame list, `device_free`, an unknown key holding a list, keys
        // in another order, an entry without `frames`, a negative time, and an entry whose list is a
        // block's (read first, in `segments`). `trace_entry` takes some, the generic loop the others.
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/entry_shapes.pickle");
        let data = std::fs::read(p).unwrap();
        let fast = read(&data[..]).expect("the fast decoder takes every shape here");
        assert!(fast == crate::read_pickle_generic(&data[..], "shapes").unwrap());
        let t = &fast.device_traces[0];
        assert_eq!(t.len(), 8);
        assert_eq!((t[0].addr, t[0].size_bytes, t[0].time_us), ((1 << 63) + 512, 512, 10));
        assert!(t[0].stack != NO_STACK && t[1].stack == t[0].stack && t[2].stack == t[0].stack);
        assert_eq!(fast.stack(t[0].stack).len(), 2);
        assert_eq!(t[3].stack, NO_STACK);
        assert_eq!(fast.str(fast.info(&t[3]).compile_context), "ctx-1");
        assert_eq!(fast.info(&t[3]).stream, 7);
        assert_eq!((t[4].action(), fast.info(&t[4]).device_free_bytes), (Action::Oom, Some(123)));
        assert_eq!((t[5].time_us, fast.stack(t[5].stack).len()), (15, 3));
        assert_eq!((t[6].action(), t[6].stack, t[6].time_us), (Action::SegmentAlloc, NO_STACK, -5));
        assert_eq!(t[7].stack, fast.segments[0].blocks[0].stack);
    }

    #[test]
    fn unusual_shapes_fall_back_to_the_generic_decoder() {
        // A dict shared by two keys (memo fetch of a trace-entry dict), protocol 0 opcodes, a refused
        // opcode: the fast path gives up and the generic decoder decides.
        let refused = b"\x80\x04cos\nsystem\n.";
        assert_eq!(read(&refused[..]).err(), Some(Bail));
        let err = crate::read_bytes(refused, "evil").unwrap_err().to_string();
        assert!(err.contains("refusing opcode GLOBAL (0x63) at byte offset 2"), "{err}");
        // pickle.dumps({"device_traces": [[e, e]]}, protocol=4), e = {"action": "alloc", "addr": 16, "size": 8}:
        // the second e is a memo fetch of the first (h\x04).
        let d = b"\x80\x04\x95D\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\rdevice_traces\x94]\x94]\x94(}\x94(\x8c\x06action\x94\x8c\x05alloc\x94\x8c\x04addr\x94K\x10\x8c\x04size\x94K\x08uh\x04eas.";
        assert_eq!(read(&d[..]).err(), Some(Bail));
        let snap = crate::read_bytes(d, "shared").unwrap();
        assert_eq!(snap.device_traces[0].len(), 2);
        assert_eq!(snap.device_traces[0][0], snap.device_traces[0][1]);
    }
}
