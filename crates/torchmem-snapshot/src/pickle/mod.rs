//! A safe, streaming unpickler for data-only pickles (protocols 0–5, as written by `pickle.dump` for
//! dicts, lists, tuples, strings, numbers, bytes, sets, None and booleans).
//!
//! It never executes anything: opcodes that would import or call Python code (GLOBAL, STACK_GLOBAL,
//! REDUCE, BUILD, INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT*, PERSID, BINPERSID) and out-of-band buffers are
//! rejected with an error naming the opcode and its byte offset.
//!
//! Memo references stay shared: a container fetched from the memo twice is one `Rc`, so a frame dict
//! referenced 70,000 times is stored once. A [`Compactor`] may replace finished dicts by small handles
//! (`Value::Opaque`) so that memory scales with unique objects; the snapshot decoder uses this.
//! Containers are dropped iteratively, so deeply nested input cannot overflow the stack.

use std::cell::{Cell, RefCell};
use std::io::Read;
use std::rc::Rc;

use crate::error::PickleError;

pub mod opcodes;
use opcodes::forbidden_name;

/// Highest pickle protocol understood.
pub const HIGHEST_PROTOCOL: u8 = 5;

/// Memo index sentinel for "not memoized".
const NO_MEMO: u32 = u32::MAX;

/// A list (also used for sets while they are built) with the memo slot it was last stored in.
pub struct ListObj {
    pub items: RefCell<Vec<Value>>,
    memo_idx: Cell<u32>,
}

/// A dict as key/value pairs in insertion order (keys may repeat; the last one wins on lookup).
pub struct DictObj {
    pub items: RefCell<Vec<(Value, Value)>>,
    memo_idx: Cell<u32>,
}

/// A pickled value. Containers are reference counted so memo sharing is kept.
#[derive(Clone)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer that does not fit in i64: little-endian two's complement bytes, as in LONG1/LONG4.
    BigInt(Rc<Vec<u8>>),
    Float(f64),
    Str(Rc<String>),
    Bytes(Rc<Vec<u8>>),
    List(Rc<ListObj>),
    Tuple(Rc<Vec<Value>>),
    Dict(Rc<DictObj>),
    /// A handle given out by a [`Compactor`] for a dict it took over (`kind` is its own tag).
    Opaque {
        kind: u8,
        id: u32,
    },
}

impl Value {
    /// A short type name for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
            Value::Opaque { .. } => "record",
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s.as_str()),
            _ => None,
        }
    }

    /// The value as i64 (bools count as 0/1, as in Python).
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            Value::Int(i) => Some(*i),
            Value::Bool(b) => Some(*b as i64),
            _ => None,
        }
    }

    /// The value as u64: non-negative ints, including LONG values up to 2^64-1 (GPU addresses).
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(i) if *i >= 0 => Some(*i as u64),
            Value::Bool(b) => Some(*b as u64),
            Value::BigInt(bytes) => {
                // little-endian two's complement; non-negative and at most 64 significant bits.
                let negative = bytes.last().is_some_and(|b| b & 0x80 != 0);
                if negative {
                    return None;
                }
                let (low, high) = bytes.split_at(bytes.len().min(8));
                if high.iter().any(|&b| b != 0) {
                    return None;
                }
                let mut buf = [0u8; 8];
                buf[..low.len()].copy_from_slice(low);
                Some(u64::from_le_bytes(buf))
            }
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            Value::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    /// Looks up a string key in a dict value (last occurrence wins, like Python).
    pub fn get(&self, key: &str) -> Option<Value> {
        match self {
            Value::Dict(d) => dict_get(&d.items.borrow(), key),
            _ => None,
        }
    }
}

/// Looks up a string key among dict items (last occurrence wins).
pub fn dict_get(items: &[(Value, Value)], key: &str) -> Option<Value> {
    items.iter().rev().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v.clone())
}

impl Drop for ListObj {
    fn drop(&mut self) {
        let items = std::mem::take(self.items.get_mut());
        drop_iteratively(items);
    }
}

impl Drop for DictObj {
    fn drop(&mut self) {
        let pairs = std::mem::take(self.items.get_mut());
        let mut work = Vec::with_capacity(pairs.len() * 2);
        for (k, v) in pairs {
            work.push(k);
            work.push(v);
        }
        drop_iteratively(work);
    }
}

/// Drops values without recursion: containers we own alone are emptied into the work list first.
fn drop_iteratively(mut work: Vec<Value>) {
    while let Some(v) = work.pop() {
        match v {
            Value::List(rc) => {
                if let Some(obj) = Rc::into_inner(rc) {
                    let mut obj = obj;
                    work.append(obj.items.get_mut());
                }
            }
            Value::Dict(rc) => {
                if let Some(obj) = Rc::into_inner(rc) {
                    let mut obj = obj;
                    for (k, v) in obj.items.get_mut().drain(..) {
                        work.push(k);
                        work.push(v);
                    }
                }
            }
            Value::Tuple(rc) => {
                if let Some(items) = Rc::into_inner(rc) {
                    work.extend(items);
                }
            }
            _ => {}
        }
    }
}

fn new_list(items: Vec<Value>) -> Value {
    Value::List(Rc::new(ListObj { items: RefCell::new(items), memo_idx: Cell::new(NO_MEMO) }))
}

fn new_dict(items: Vec<(Value, Value)>) -> Value {
    Value::Dict(Rc::new(DictObj { items: RefCell::new(items), memo_idx: Cell::new(NO_MEMO) }))
}

/// Takes over finished dicts. `on_dict` runs after every SETITEM/SETITEMS/DICT; returning
/// `Some(v)` replaces the dict (on the stack and in the memo) by `v`. Values pushed to `replaced`
/// as (old container, new value) are swapped in the memo too (e.g. a frame list turned into a stack id).
pub trait Compactor {
    fn on_dict(
        &mut self,
        items: &[(Value, Value)],
        replaced: &mut Vec<(Value, Value)>,
    ) -> Result<Option<Value>, String>;
}

/// The compactor that keeps every dict as it is.
pub struct KeepAll;

impl Compactor for KeepAll {
    fn on_dict(&mut self, _: &[(Value, Value)], _: &mut Vec<(Value, Value)>) -> Result<Option<Value>, String> {
        Ok(None)
    }
}

/// Buffered reader that counts the byte offset.
struct Input<R: Read> {
    inner: R,
    buf: Vec<u8>,
    pos: usize,
    filled: usize,
    consumed: u64,
}

impl<R: Read> Input<R> {
    fn new(inner: R) -> Self {
        Input { inner, buf: vec![0; 1 << 20], pos: 0, filled: 0, consumed: 0 }
    }

    fn offset(&self) -> u64 {
        self.consumed + self.pos as u64
    }

    fn fill(&mut self) -> std::io::Result<bool> {
        if self.pos < self.filled {
            return Ok(true);
        }
        self.consumed += self.filled as u64;
        self.pos = 0;
        self.filled = 0;
        loop {
            match self.inner.read(&mut self.buf) {
                Ok(n) => {
                    self.filled = n;
                    return Ok(n > 0);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    fn byte(&mut self) -> Result<Option<u8>, PickleError> {
        if self.pos < self.filled {
            let b = self.buf[self.pos];
            self.pos += 1;
            return Ok(Some(b));
        }
        if !self.fill().map_err(|e| io_err(e, self.offset()))? {
            return Ok(None);
        }
        let b = self.buf[self.pos];
        self.pos += 1;
        Ok(Some(b))
    }

    /// Reads exactly `n` bytes into `out` (appending), growing `out` only as data arrives so a
    /// forged length cannot make us allocate more than the input holds.
    fn take_into(
        &mut self,
        mut n: u64,
        out: &mut Vec<u8>,
        what: &'static str,
        op_offset: u64,
    ) -> Result<(), PickleError> {
        while n > 0 {
            if self.pos >= self.filled && !self.fill().map_err(|e| io_err(e, self.offset()))? {
                return Err(PickleError::Truncated { offset: self.offset(), what, op_offset });
            }
            let avail = (self.filled - self.pos) as u64;
            let k = avail.min(n) as usize;
            out.extend_from_slice(&self.buf[self.pos..self.pos + k]);
            self.pos += k;
            n -= k as u64;
        }
        Ok(())
    }

    fn fixed<const N: usize>(&mut self, what: &'static str, op_offset: u64) -> Result<[u8; N], PickleError> {
        let mut out = [0u8; N];
        if self.filled - self.pos >= N {
            out.copy_from_slice(&self.buf[self.pos..self.pos + N]);
            self.pos += N;
            return Ok(out);
        }
        let mut v = Vec::with_capacity(N);
        self.take_into(N as u64, &mut v, what, op_offset)?;
        out.copy_from_slice(&v);
        Ok(out)
    }

    /// Reads a text line (protocol 0 arguments), without the trailing newline; at most 4 KiB.
    fn line(&mut self, op_offset: u64) -> Result<Vec<u8>, PickleError> {
        let mut out = Vec::new();
        loop {
            match self.byte()? {
                None => return Err(PickleError::Truncated { offset: self.offset(), what: "text argument", op_offset }),
                Some(b'\n') => return Ok(out),
                Some(b) => {
                    if out.len() >= 4096 {
                        return Err(PickleError::Malformed {
                            offset: op_offset,
                            msg: "text argument longer than 4 KiB".into(),
                        });
                    }
                    out.push(b);
                }
            }
        }
    }
}

fn io_err(e: std::io::Error, offset: u64) -> PickleError {
    PickleError::Io { offset, msg: e.to_string() }
}

/// An unpickled value with everything it may reference. Dropping it breaks reference cycles (a
/// pickle can make a list contain itself), so nothing leaks. Values cloned out of it are emptied
/// when the document is dropped: use them while it lives.
pub struct Document {
    pub root: Value,
    memo: Vec<Option<Value>>,
}

impl Drop for Document {
    fn drop(&mut self) {
        let mut roots = vec![std::mem::replace(&mut self.root, Value::None)];
        roots.extend(std::mem::take(&mut self.memo).into_iter().flatten());
        teardown(roots);
    }
}

/// Empties every container reachable from `roots` (iteratively), which frees cyclic structures.
fn teardown(roots: Vec<Value>) {
    let mut seen: std::collections::HashSet<usize> = std::collections::HashSet::new();
    let mut containers: Vec<Value> = Vec::new();
    let mut work = roots;
    while let Some(v) = work.pop() {
        let ptr = match &v {
            Value::List(l) => Rc::as_ptr(l) as usize,
            Value::Dict(d) => Rc::as_ptr(d) as usize,
            Value::Tuple(t) => Rc::as_ptr(t) as usize,
            _ => continue,
        };
        if !seen.insert(ptr) {
            continue;
        }
        match &v {
            Value::List(l) => work.extend(l.items.borrow().iter().filter(|c| is_container(c)).cloned()),
            Value::Dict(d) => {
                for (k, x) in d.items.borrow().iter() {
                    if is_container(k) {
                        work.push(k.clone());
                    }
                    if is_container(x) {
                        work.push(x.clone());
                    }
                }
            }
            Value::Tuple(t) => work.extend(t.iter().filter(|c| is_container(c)).cloned()),
            _ => {}
        }
        containers.push(v);
    }
    // Tuples cannot be emptied in place but cannot form cycles on their own: a cycle through a
    // tuple also passes through a list or dict, which we empty here.
    for c in &containers {
        match c {
            Value::List(l) => {
                let items = std::mem::take(&mut *l.items.borrow_mut());
                drop_iteratively(items);
            }
            Value::Dict(d) => {
                let pairs = std::mem::take(&mut *d.items.borrow_mut());
                drop_iteratively(pairs.into_iter().flat_map(|(k, v)| [k, v]).collect());
            }
            _ => {}
        }
    }
    drop_iteratively(containers);
}

fn is_container(v: &Value) -> bool {
    matches!(v, Value::List(_) | Value::Dict(_) | Value::Tuple(_))
}

/// Reads one pickle from `reader` with the given compactor.
pub fn unpickle<R: Read, C: Compactor>(reader: R, compactor: &mut C) -> Result<Document, PickleError> {
    let mut u = Unpickler {
        input: Input::new(reader),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        replaced: Vec::new(),
    };
    let root = u.run(compactor)?;
    let mut memo = std::mem::take(&mut u.memo);
    // Values left on the stack may share containers with the root: the document owns them too.
    memo.extend(std::mem::take(&mut u.stack).into_iter().map(Some));
    Ok(Document { root, memo })
}

/// Reads one pickle from bytes, keeping every dict (no compaction).
pub fn unpickle_bytes(data: &[u8]) -> Result<Document, PickleError> {
    unpickle(data, &mut KeepAll)
}

struct Unpickler<R: Read> {
    input: Input<R>,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: Vec<Option<Value>>,
    /// Scratch list reused by `compact_dict`.
    replaced: Vec<(Value, Value)>,
}

impl<R: Read> Drop for Unpickler<R> {
    fn drop(&mut self) {
        let mut work = std::mem::take(&mut self.stack);
        work.extend(std::mem::take(&mut self.memo).into_iter().flatten());
        teardown(work);
    }
}

/// Largest memo index accepted (a forged LONG_BINPUT must not allocate gigabytes).
const MAX_MEMO_GAP: usize = 1 << 16;

impl<R: Read> Unpickler<R> {
    fn malformed(&self, offset: u64, msg: impl Into<String>) -> PickleError {
        PickleError::Malformed { offset, msg: msg.into() }
    }

    fn pop(&mut self, op: &'static str, offset: u64) -> Result<Value, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.malformed(offset, format!("{op} on an empty stack")));
        }
        Ok(self.stack.pop().expect("checked"))
    }

    fn top(&self, op: &'static str, offset: u64) -> Result<&Value, PickleError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.malformed(offset, format!("{op} on an empty stack")));
        }
        Ok(self.stack.last().expect("checked"))
    }

    fn pop_mark(&mut self, op: &'static str, offset: u64) -> Result<Vec<Value>, PickleError> {
        let Some(m) = self.marks.pop() else {
            return Err(self.malformed(offset, format!("{op} without a MARK")));
        };
        Ok(self.stack.split_off(m))
    }

    /// For APPENDS/SETITEMS: the mark position and (a clone of) the container right below it.
    fn marked_target(&self, op: &'static str, offset: u64) -> Result<(usize, Value), PickleError> {
        let Some(&m) = self.marks.last() else {
            return Err(self.malformed(offset, format!("{op} without a MARK")));
        };
        let floor = if self.marks.len() >= 2 { self.marks[self.marks.len() - 2] } else { 0 };
        if m == 0 || m - 1 < floor {
            return Err(self.malformed(offset, format!("{op} without a container below the MARK")));
        }
        Ok((m, self.stack[m - 1].clone()))
    }

    fn memo_put(&mut self, idx: usize, offset: u64) -> Result<(), PickleError> {
        let v = self.top("PUT/MEMOIZE", offset)?.clone();
        if idx > self.memo.len() + MAX_MEMO_GAP {
            return Err(self
                .malformed(offset, format!("memo index {idx} is far beyond the {} stored objects", self.memo.len())));
        }
        if idx >= self.memo.len() {
            self.memo.resize(idx + 1, None);
        }
        match &v {
            Value::List(l) => l.memo_idx.set(idx as u32),
            Value::Dict(d) => d.memo_idx.set(idx as u32),
            _ => {}
        }
        self.memo[idx] = Some(v);
        Ok(())
    }

    fn memo_get(&mut self, idx: usize, offset: u64) -> Result<(), PickleError> {
        match self.memo.get(idx) {
            Some(Some(v)) => {
                let v = v.clone();
                self.stack.push(v);
                Ok(())
            }
            _ => Err(self.malformed(offset, format!("memo index {idx} was never stored"))),
        }
    }

    /// Replaces the memo slot of container `old` (if it is still there) by `new`.
    fn memo_replace(&mut self, old: &Value, new: &Value) {
        let idx = match old {
            Value::List(l) => l.memo_idx.get(),
            Value::Dict(d) => d.memo_idx.get(),
            _ => NO_MEMO,
        };
        if idx == NO_MEMO {
            return;
        }
        if let Some(slot) = self.memo.get_mut(idx as usize) {
            let same = match (slot.as_ref(), old) {
                (Some(Value::List(a)), Value::List(b)) => Rc::ptr_eq(a, b),
                (Some(Value::Dict(a)), Value::Dict(b)) => Rc::ptr_eq(a, b),
                _ => false,
            };
            if same {
                *slot = Some(new.clone());
            }
        }
    }

    /// Runs the compactor on the dict at stack position `pos`.
    fn compact_dict<C: Compactor>(&mut self, pos: usize, compactor: &mut C, offset: u64) -> Result<(), PickleError> {
        let dict = self.stack[pos].clone();
        let Value::Dict(d) = &dict else { return Ok(()) };
        let mut replaced = std::mem::take(&mut self.replaced);
        replaced.clear();
        let new = {
            let items = d.items.borrow();
            compactor.on_dict(&items, &mut replaced).map_err(|msg| PickleError::Malformed { offset, msg })?
        };
        for (old, newv) in &replaced {
            self.memo_replace(old, newv);
        }
        if let Some(new) = new {
            self.memo_replace(&dict, &new);
            self.stack[pos] = new;
            replaced.push((dict, Value::None));
        }
        // The compactor took over these containers. Empty them: in a real snapshot nothing else holds
        // them any more, and in a crafted pickle they could form a cycle no one can reach to free.
        let mut nested = Vec::new();
        for (old, _) in replaced.drain(..) {
            match &old {
                Value::List(l) => {
                    let items = std::mem::take(&mut *l.items.borrow_mut());
                    nested.extend(items.into_iter().filter(is_container));
                }
                Value::Dict(d) => {
                    let pairs = std::mem::take(&mut *d.items.borrow_mut());
                    for (k, v) in pairs {
                        if is_container(&k) {
                            nested.push(k);
                        }
                        if is_container(&v) {
                            nested.push(v);
                        }
                    }
                }
                _ => {}
            }
        }
        drop_iteratively(nested);
        self.replaced = replaced;
        Ok(())
    }

    fn int_from_le(bytes: &[u8]) -> Value {
        if bytes.is_empty() {
            return Value::Int(0);
        }
        if bytes.len() <= 8 {
            let negative = bytes[bytes.len() - 1] & 0x80 != 0;
            let mut buf = if negative { [0xffu8; 8] } else { [0u8; 8] };
            buf[..bytes.len()].copy_from_slice(bytes);
            return Value::Int(i64::from_le_bytes(buf));
        }
        // Longer encodings may still fit in i64 (e.g. 9-byte form of a u63 value).
        let negative = bytes[bytes.len() - 1] & 0x80 != 0;
        let fill = if negative { 0xff } else { 0 };
        if bytes[8..].iter().all(|&b| b == fill) && ((bytes[7] & 0x80 != 0) == negative) {
            let mut buf = [0u8; 8];
            buf.copy_from_slice(&bytes[..8]);
            return Value::Int(i64::from_le_bytes(buf));
        }
        Value::BigInt(Rc::new(bytes.to_vec()))
    }

    fn text_int(&self, line: &[u8], offset: u64) -> Result<Value, PickleError> {
        let s = std::str::from_utf8(line).map_err(|_| self.malformed(offset, "integer text is not UTF-8"))?;
        let s = s.trim().trim_end_matches('L');
        match s {
            "00" => return Ok(Value::Bool(false)),
            "01" => return Ok(Value::Bool(true)),
            _ => {}
        }
        s.parse::<i64>()
            .map(Value::Int)
            .map_err(|_| self.malformed(offset, format!("integer text {s:?} is not an i64")))
    }

    fn push_str(&mut self, bytes: Vec<u8>, offset: u64) -> Result<(), PickleError> {
        let s = String::from_utf8(bytes).map_err(|_| self.malformed(offset, "string is not valid UTF-8"))?;
        self.stack.push(Value::Str(Rc::new(s)));
        Ok(())
    }

    fn run<C: Compactor>(&mut self, compactor: &mut C) -> Result<Value, PickleError> {
        loop {
            let offset = self.input.offset();
            let Some(op) = self.input.byte()? else {
                return Err(PickleError::Truncated { offset, what: "opcode (no STOP)", op_offset: offset });
            };
            if let Some(name) = forbidden_name(op) {
                return Err(PickleError::Forbidden { opcode: name, byte: op, offset });
            }
            match op {
                0x80 => {
                    let [v] = self.input.fixed::<1>("PROTO version", offset)?;
                    if v > HIGHEST_PROTOCOL {
                        return Err(PickleError::Protocol { version: v, offset });
                    }
                }
                0x95 => {
                    self.input.fixed::<8>("FRAME length", offset)?;
                }
                b'.' => {
                    let v = self.pop("STOP", offset)?;
                    return Ok(v);
                }
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop("POP", offset)?;
                }
                b'1' => {
                    let items = self.pop_mark("POP_MARK", offset)?;
                    drop_iteratively(items);
                }
                b'2' => {
                    let v = self.top("DUP", offset)?.clone();
                    self.stack.push(v);
                }
                b'N' => self.stack.push(Value::None),
                0x88 => self.stack.push(Value::Bool(true)),
                0x89 => self.stack.push(Value::Bool(false)),
                b'J' => {
                    let b = self.input.fixed::<4>("BININT argument", offset)?;
                    self.stack.push(Value::Int(i32::from_le_bytes(b) as i64));
                }
                b'K' => {
                    let [b] = self.input.fixed::<1>("BININT1 argument", offset)?;
                    self.stack.push(Value::Int(b as i64));
                }
                b'M' => {
                    let b = self.input.fixed::<2>("BININT2 argument", offset)?;
                    self.stack.push(Value::Int(u16::from_le_bytes(b) as i64));
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a {
                        self.input.fixed::<1>("LONG1 length", offset)?[0] as u64
                    } else {
                        let n = i32::from_le_bytes(self.input.fixed::<4>("LONG4 length", offset)?);
                        if n < 0 {
                            return Err(self.malformed(offset, "LONG4 with a negative length"));
                        }
                        n as u64
                    };
                    let mut bytes = Vec::new();
                    self.input.take_into(n, &mut bytes, "LONG bytes", offset)?;
                    self.stack.push(Self::int_from_le(&bytes));
                }
                b'I' | b'L' => {
                    let line = self.input.line(offset)?;
                    let v = self.text_int(&line, offset)?;
                    self.stack.push(v);
                }
                b'G' => {
                    let b = self.input.fixed::<8>("BINFLOAT argument", offset)?;
                    self.stack.push(Value::Float(f64::from_be_bytes(b)));
                }
                b'F' => {
                    let line = self.input.line(offset)?;
                    let f = std::str::from_utf8(&line)
                        .ok()
                        .and_then(|s| s.trim().parse::<f64>().ok())
                        .ok_or_else(|| self.malformed(offset, "FLOAT text is not a number"))?;
                    self.stack.push(Value::Float(f));
                }
                0x8c | b'X' | 0x8d => {
                    let n = match op {
                        0x8c => self.input.fixed::<1>("SHORT_BINUNICODE length", offset)?[0] as u64,
                        b'X' => u32::from_le_bytes(self.input.fixed::<4>("BINUNICODE length", offset)?) as u64,
                        _ => u64::from_le_bytes(self.input.fixed::<8>("BINUNICODE8 length", offset)?),
                    };
                    let mut bytes = Vec::with_capacity(n.min(1 << 16) as usize);
                    self.input.take_into(n, &mut bytes, "string bytes", offset)?;
                    self.push_str(bytes, offset)?;
                }
                b'C' | b'B' | 0x8e | 0x96 | b'U' | b'T' => {
                    let n = match op {
                        b'C' | b'U' => self.input.fixed::<1>("bytes length", offset)?[0] as u64,
                        b'B' | b'T' => u32::from_le_bytes(self.input.fixed::<4>("bytes length", offset)?) as u64,
                        _ => u64::from_le_bytes(self.input.fixed::<8>("bytes length", offset)?),
                    };
                    let mut bytes = Vec::with_capacity(n.min(1 << 16) as usize);
                    self.input.take_into(n, &mut bytes, "bytes", offset)?;
                    self.stack.push(Value::Bytes(Rc::new(bytes)));
                }
                b'V' | b'S' => {
                    // protocol 0 text strings; accept plain text only (no escape processing).
                    let line = self.input.line(offset)?;
                    let mut s = line;
                    if op == b'S' && s.len() >= 2 && (s[0] == b'\'' || s[0] == b'"') && s[s.len() - 1] == s[0] {
                        s = s[1..s.len() - 1].to_vec();
                    }
                    self.push_str(s, offset)?;
                }
                b'}' => self.stack.push(new_dict(Vec::new())),
                b']' => self.stack.push(new_list(Vec::new())),
                b')' => self.stack.push(Value::Tuple(Rc::new(Vec::new()))),
                0x8f => self.stack.push(new_list(Vec::new())),
                b'l' => {
                    let items = self.pop_mark("LIST", offset)?;
                    self.stack.push(new_list(items));
                }
                b't' | 0x91 => {
                    let items = self.pop_mark(if op == b't' { "TUPLE" } else { "FROZENSET" }, offset)?;
                    self.stack.push(Value::Tuple(Rc::new(items)));
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let floor = self.marks.last().copied().unwrap_or(0);
                    if self.stack.len() < floor + n {
                        return Err(self.malformed(offset, format!("TUPLE{n} needs {n} items on the stack")));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(Value::Tuple(Rc::new(items)));
                }
                b'd' => {
                    let items = self.pop_mark("DICT", offset)?;
                    if items.len() % 2 != 0 {
                        return Err(self.malformed(offset, "DICT with an odd number of items"));
                    }
                    let mut pairs = Vec::with_capacity(items.len() / 2);
                    let mut it = items.into_iter();
                    while let (Some(k), Some(v)) = (it.next(), it.next()) {
                        pairs.push((k, v));
                    }
                    self.stack.push(new_dict(pairs));
                    let pos = self.stack.len() - 1;
                    self.compact_dict(pos, compactor, offset)?;
                }
                b'e' | 0x90 => {
                    let (m, target) = self.marked_target(if op == b'e' { "APPENDS" } else { "ADDITEMS" }, offset)?;
                    let Value::List(l) = target else {
                        return Err(self.malformed(offset, format!("APPENDS to a {}, not a list", target.type_name())));
                    };
                    let mut v = l.items.borrow_mut();
                    v.extend(self.stack.drain(m..));
                    drop(v);
                    self.marks.pop();
                }
                b'a' => {
                    let item = self.pop("APPEND", offset)?;
                    let target =
                        self.top("APPEND", offset).map_err(|_| self.malformed(offset, "APPEND without a list"))?;
                    match target {
                        Value::List(l) => l.items.borrow_mut().push(item),
                        other => {
                            let t = other.type_name();
                            drop_iteratively(vec![item]);
                            return Err(self.malformed(offset, format!("APPEND to a {t}, not a list")));
                        }
                    }
                }
                b'u' => {
                    let (m, target) = self.marked_target("SETITEMS", offset)?;
                    let Value::Dict(d) = target else {
                        return Err(self.malformed(offset, format!("SETITEMS on a {}, not a dict", target.type_name())));
                    };
                    if (self.stack.len() - m) % 2 != 0 {
                        return Err(self.malformed(offset, "SETITEMS with an odd number of items"));
                    }
                    {
                        let mut v = d.items.borrow_mut();
                        v.reserve((self.stack.len() - m) / 2);
                        let mut it = self.stack.drain(m..);
                        while let (Some(k), Some(val)) = (it.next(), it.next()) {
                            v.push((k, val));
                        }
                    }
                    self.marks.pop();
                    self.compact_dict(m - 1, compactor, offset)?;
                }
                b's' => {
                    let items = {
                        let v = self.pop("SETITEM", offset)?;
                        let k = self.pop("SETITEM", offset)?;
                        vec![k, v]
                    };
                    if items.len() % 2 != 0 {
                        drop_iteratively(items);
                        return Err(self.malformed(offset, "SETITEMS with an odd number of items"));
                    }
                    let target = self
                        .top("SETITEM(S)", offset)
                        .map_err(|_| self.malformed(offset, "SETITEM(S) without a dict"))?;
                    match target {
                        Value::Dict(d) => {
                            if let Ok(mut v) = d.items.try_borrow_mut() {
                                let mut it = items.into_iter();
                                while let (Some(k), Some(val)) = (it.next(), it.next()) {
                                    v.push((k, val));
                                }
                            }
                        }
                        other => {
                            let t = other.type_name();
                            drop_iteratively(items);
                            return Err(self.malformed(offset, format!("SETITEM(S) on a {t}, not a dict")));
                        }
                    }
                    let pos = self.stack.len() - 1;
                    self.compact_dict(pos, compactor, offset)?;
                }
                0x94 => {
                    let idx = self.memo.len();
                    self.memo_put(idx, offset)?;
                }
                b'q' => {
                    let [i] = self.input.fixed::<1>("BINPUT index", offset)?;
                    self.memo_put(i as usize, offset)?;
                }
                b'r' => {
                    let i = u32::from_le_bytes(self.input.fixed::<4>("LONG_BINPUT index", offset)?);
                    self.memo_put(i as usize, offset)?;
                }
                b'p' => {
                    let line = self.input.line(offset)?;
                    let i = std::str::from_utf8(&line).ok().and_then(|s| s.trim().parse::<usize>().ok());
                    let i = i.ok_or_else(|| self.malformed(offset, "PUT index is not a number"))?;
                    self.memo_put(i, offset)?;
                }
                b'h' => {
                    let [i] = self.input.fixed::<1>("BINGET index", offset)?;
                    self.memo_get(i as usize, offset)?;
                }
                b'j' => {
                    let i = u32::from_le_bytes(self.input.fixed::<4>("LONG_BINGET index", offset)?);
                    self.memo_get(i as usize, offset)?;
                }
                b'g' => {
                    let line = self.input.line(offset)?;
                    let i = std::str::from_utf8(&line).ok().and_then(|s| s.trim().parse::<usize>().ok());
                    let i = i.ok_or_else(|| self.malformed(offset, "GET index is not a number"))?;
                    self.memo_get(i, offset)?;
                }
                other => return Err(PickleError::UnknownOpcode { byte: other, offset }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(data: &[u8]) -> PickleError {
        match unpickle_bytes(data) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e,
        }
    }

    #[test]
    fn shared_memo_values_stay_shared() {
        // pickle.dumps(l := [1]; {"a": l, "b": l}, protocol=4)
        let data = b"\x80\x04\x95\x13\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94K\x01a\x8c\x01b\x94h\x02u.";
        let doc = unpickle_bytes(data).unwrap();
        let (Some(Value::List(a)), Some(Value::List(b))) = (doc.root.get("a"), doc.root.get("b")) else {
            panic!("expected two lists")
        };
        assert!(Rc::ptr_eq(&a, &b));
        assert_eq!(a.items.borrow()[0].as_i64(), Some(1));
    }

    #[test]
    fn forbidden_opcodes_name_offset() {
        let e = err(b"\x80\x02cos\nsystem\n.");
        assert_eq!(e, PickleError::Forbidden { opcode: "GLOBAL", byte: b'c', offset: 2 });
        assert!(e.to_string().contains("refusing opcode GLOBAL (0x63) at byte offset 2"));
        assert!(matches!(err(b"\x80\x05N)R."), PickleError::Forbidden { opcode: "REDUCE", offset: 4, .. }));
        assert!(matches!(err(b"\x80\x05\x97."), PickleError::Forbidden { opcode: "NEXT_BUFFER", offset: 2, .. }));
    }

    #[test]
    fn forged_lengths_and_indices_do_not_allocate() {
        // BINUNICODE8 claiming 2^62 bytes: truncated, not an allocation failure.
        let mut d = b"\x80\x04\x8d".to_vec();
        d.extend_from_slice(&(1u64 << 62).to_le_bytes());
        assert!(matches!(err(&d), PickleError::Truncated { .. }));
        // LONG_BINPUT far beyond the memo.
        assert!(err(b"\x80\x04Nr\xff\xff\xff\x7f.").to_string().contains("far beyond"));
        // LONG_BINGET of something never stored.
        assert!(err(b"\x80\x04j\x05\x00\x00\x00.").to_string().contains("never stored"));
        assert!(matches!(err(b"\x80\x06N."), PickleError::Protocol { version: 6, .. }));
        assert!(matches!(err(b""), PickleError::Truncated { .. }));
        assert!(err(b"\x80\x04u.").to_string().contains("without a MARK"));
    }

    #[test]
    fn deep_nesting_and_cycles_do_not_overflow_or_leak() {
        // 1,000,000 nested lists: "]" then "a" appends each to the previous, via MARK-free APPEND.
        let n = 1_000_000;
        let mut d = b"\x80\x04]".to_vec();
        for _ in 0..n {
            d.extend_from_slice(b"]");
        }
        for _ in 0..n {
            d.extend_from_slice(b"a");
        }
        d.push(b'.');
        let doc = unpickle_bytes(&d).unwrap();
        drop(doc);
        // A list that contains itself.
        let doc = unpickle_bytes(b"\x80\x04]\x94h\x00a.").unwrap();
        let weak = {
            let Value::List(l) = &doc.root else { panic!() };
            let same = matches!(&l.items.borrow()[0], Value::List(inner) if Rc::ptr_eq(l, inner));
            assert!(same, "the list contains itself");
            Rc::downgrade(l)
        };
        drop(doc);
        assert!(weak.upgrade().is_none(), "the self-referencing list was freed");
    }

    #[test]
    fn ints_of_every_width() {
        let doc = unpickle_bytes(b"\x80\x04(K\xffM\xff\xffJ\xff\xff\xff\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01\x8a\x08\xff\xff\xff\xff\xff\xff\xff\xffl.").unwrap();
        let Value::List(l) = &doc.root else { panic!() };
        let v = l.items.borrow();
        assert_eq!(v[0].as_i64(), Some(255));
        assert_eq!(v[1].as_i64(), Some(65535));
        assert_eq!(v[2].as_i64(), Some(-1));
        assert_eq!(v[3].as_u64(), None); // 2^64 does not fit
        assert_eq!(v[4].as_i64(), Some(-1));
    }
}
