//! The pickle virtual machine: the stack, marks and memo, and the opcode dispatch (`Unpickler::run`).
//! Every opcode that would import or call code is refused before dispatch (`opcodes::forbidden_name`).

use std::io::Read;
use std::rc::Rc;

use super::compact::Compactor;
use super::input::Input;
use super::opcodes::{self as op, forbidden_name};
use super::value::{drop_keeping_shared, new_dict, new_list, teardown, Value};
use super::HIGHEST_PROTOCOL;
use crate::error::PickleError;

pub(super) struct Unpickler<R: Read> {
    pub(super) input: Input<R>,
    pub(super) stack: Vec<Value>,
    pub(super) marks: Vec<usize>,
    pub(super) memo: Vec<Option<Value>>,
    /// Scratch list reused by `compact_dict`.
    pub(super) replaced: Vec<(Value, Value)>,
    /// Values taken off the stack and thrown away (POP, POP_MARK, error paths, containers a compactor
    /// took over). Kept until the end and torn down with the rest: one may be part of a cycle (a dict
    /// that contains itself) that a plain drop would leak.
    pub(super) discarded: Vec<Value>,
}

impl<R: Read> Drop for Unpickler<R> {
    fn drop(&mut self) {
        let mut work = std::mem::take(&mut self.stack);
        work.extend(std::mem::take(&mut self.memo).into_iter().flatten());
        work.append(&mut self.discarded);
        teardown(work);
    }
}

/// Largest memo index accepted (a forged LONG_BINPUT must not allocate gigabytes).
const MAX_MEMO_GAP: usize = 1 << 16;

impl<R: Read> Unpickler<R> {
    pub(super) fn new(input: Input<R>) -> Self {
        Unpickler {
            input,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Vec::new(),
            replaced: Vec::new(),
            discarded: Vec::new(),
        }
    }

    /// Throws values away without leaking cycles (see `discarded`).
    pub(super) fn discard(&mut self, values: Vec<Value>) {
        drop_keeping_shared(values, &mut self.discarded);
    }

    fn malformed(&self, offset: u64, msg: impl Into<String>) -> PickleError {
        PickleError::Malformed { offset, msg: msg.into() }
    }

    fn pop(&mut self, op: &'static str, offset: u64) -> Result<Value, PickleError> {
        if self.above_floor() == 0 {
            return Err(self.malformed(offset, format!("{op} on an empty stack")));
        }
        Ok(self.stack.pop().expect("checked"))
    }

    /// How many values are on the stack above the innermost MARK.
    fn above_floor(&self) -> usize {
        self.stack.len() - self.marks.last().copied().unwrap_or(0)
    }

    fn top(&self, op: &'static str, offset: u64) -> Result<&Value, PickleError> {
        if self.above_floor() == 0 {
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

    pub(super) fn run<C: Compactor>(&mut self, compactor: &mut C) -> Result<Value, PickleError> {
        loop {
            let offset = self.input.offset();
            let Some(code) = self.input.byte()? else {
                return Err(PickleError::Truncated { offset, what: "opcode (no STOP)", op_offset: offset });
            };
            if let Some(name) = forbidden_name(code) {
                return Err(PickleError::Forbidden { opcode: name, byte: code, offset });
            }
            match code {
                op::PROTO => {
                    let [v] = self.input.fixed::<1>("PROTO version", offset)?;
                    if v > HIGHEST_PROTOCOL {
                        return Err(PickleError::Protocol { version: v, offset });
                    }
                }
                op::FRAME => {
                    self.input.fixed::<8>("FRAME length", offset)?;
                }
                op::STOP => {
                    let v = self.pop(op::name(code), offset)?;
                    return Ok(v);
                }
                op::MARK => self.marks.push(self.stack.len()),
                op::POP => {
                    let v = self.pop(op::name(code), offset)?;
                    self.discard(vec![v]);
                }
                op::POP_MARK => {
                    let items = self.pop_mark(op::name(code), offset)?;
                    self.discard(items);
                }
                op::DUP => {
                    let v = self.top(op::name(code), offset)?.clone();
                    self.stack.push(v);
                }
                op::NONE => self.stack.push(Value::None),
                op::NEWTRUE => self.stack.push(Value::Bool(true)),
                op::NEWFALSE => self.stack.push(Value::Bool(false)),
                op::BININT => {
                    let b = self.input.fixed::<4>("BININT argument", offset)?;
                    self.stack.push(Value::Int(i32::from_le_bytes(b) as i64));
                }
                op::BININT1 => {
                    let [b] = self.input.fixed::<1>("BININT1 argument", offset)?;
                    self.stack.push(Value::Int(b as i64));
                }
                op::BININT2 => {
                    let b = self.input.fixed::<2>("BININT2 argument", offset)?;
                    self.stack.push(Value::Int(u16::from_le_bytes(b) as i64));
                }
                op::LONG1 | op::LONG4 => {
                    let n = if code == op::LONG1 {
                        self.input.fixed::<1>("LONG1 length", offset)?[0] as u64
                    } else {
                        let n = i32::from_le_bytes(self.input.fixed::<4>("LONG4 length", offset)?);
                        if n < 0 {
                            return Err(self.malformed(offset, format!("{} with a negative length", op::name(code))));
                        }
                        n as u64
                    };
                    let mut bytes = Vec::new();
                    self.input.take_into(n, &mut bytes, "LONG bytes", offset)?;
                    self.stack.push(Self::int_from_le(&bytes));
                }
                op::INT | op::LONG => {
                    let line = self.input.line(offset)?;
                    let v = self.text_int(&line, offset)?;
                    self.stack.push(v);
                }
                op::BINFLOAT => {
                    let b = self.input.fixed::<8>("BINFLOAT argument", offset)?;
                    self.stack.push(Value::Float(f64::from_be_bytes(b)));
                }
                op::FLOAT => {
                    let line = self.input.line(offset)?;
                    let f = std::str::from_utf8(&line)
                        .ok()
                        .and_then(|s| s.trim().parse::<f64>().ok())
                        .ok_or_else(|| self.malformed(offset, format!("{} text is not a number", op::name(code))))?;
                    self.stack.push(Value::Float(f));
                }
                op::SHORT_BINUNICODE | op::BINUNICODE | op::BINUNICODE8 => {
                    let n = match code {
                        op::SHORT_BINUNICODE => self.input.fixed::<1>("SHORT_BINUNICODE length", offset)?[0] as u64,
                        op::BINUNICODE => {
                            u32::from_le_bytes(self.input.fixed::<4>("BINUNICODE length", offset)?) as u64
                        }
                        _ => u64::from_le_bytes(self.input.fixed::<8>("BINUNICODE8 length", offset)?),
                    };
                    let mut bytes = Vec::with_capacity(n.min(1 << 16) as usize);
                    self.input.take_into(n, &mut bytes, "string bytes", offset)?;
                    self.push_str(bytes, offset)?;
                }
                op::SHORT_BINBYTES
                | op::BINBYTES
                | op::BINBYTES8
                | op::BYTEARRAY8
                | op::SHORT_BINSTRING
                | op::BINSTRING => {
                    let n = match code {
                        op::SHORT_BINBYTES | op::SHORT_BINSTRING => {
                            self.input.fixed::<1>("bytes length", offset)?[0] as u64
                        }
                        op::BINBYTES | op::BINSTRING => {
                            u32::from_le_bytes(self.input.fixed::<4>("bytes length", offset)?) as u64
                        }
                        _ => u64::from_le_bytes(self.input.fixed::<8>("bytes length", offset)?),
                    };
                    let mut bytes = Vec::with_capacity(n.min(1 << 16) as usize);
                    self.input.take_into(n, &mut bytes, "bytes", offset)?;
                    self.stack.push(Value::Bytes(Rc::new(bytes)));
                }
                op::UNICODE | op::STRING => {
                    // protocol 0 text strings; accept plain text only (no escape processing).
                    let line = self.input.line(offset)?;
                    let mut s = line;
                    if code == op::STRING && s.len() >= 2 && (s[0] == b'\'' || s[0] == b'"') && s[s.len() - 1] == s[0] {
                        s = s[1..s.len() - 1].to_vec();
                    }
                    self.push_str(s, offset)?;
                }
                op::EMPTY_DICT => self.stack.push(new_dict(Vec::new())),
                op::EMPTY_LIST => self.stack.push(new_list(Vec::new())),
                op::EMPTY_TUPLE => self.stack.push(Value::Tuple(Rc::new(Vec::new()))),
                op::EMPTY_SET => self.stack.push(new_list(Vec::new())),
                op::LIST => {
                    let items = self.pop_mark(op::name(code), offset)?;
                    self.stack.push(new_list(items));
                }
                op::TUPLE | op::FROZENSET => {
                    let items = self.pop_mark(op::name(code), offset)?;
                    self.stack.push(Value::Tuple(Rc::new(items)));
                }
                op::TUPLE1..=op::TUPLE3 => {
                    let n = (code - op::TUPLE1 + 1) as usize;
                    let floor = self.marks.last().copied().unwrap_or(0);
                    if self.stack.len() < floor + n {
                        return Err(self.malformed(offset, format!("{} needs {n} items on the stack", op::name(code))));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(Value::Tuple(Rc::new(items)));
                }
                op::DICT => {
                    let items = self.pop_mark(op::name(code), offset)?;
                    if items.len() % 2 != 0 {
                        self.discard(items);
                        return Err(self.malformed(offset, format!("{} with an odd number of items", op::name(code))));
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
                op::APPENDS | op::ADDITEMS => {
                    let (m, target) = self.marked_target(op::name(code), offset)?;
                    let Value::List(l) = target else {
                        return Err(self
                            .malformed(offset, format!("{} to a {}, not a list", op::name(code), target.type_name())));
                    };
                    let mut v = l.items.borrow_mut();
                    v.extend(self.stack.drain(m..));
                    drop(v);
                    self.marks.pop();
                }
                op::APPEND => {
                    // Checked before anything is popped: a value held here when an error returns would be
                    // dropped outside the teardown, leaking a cycle it is part of (a list holding itself).
                    match self.above_floor() {
                        0 => return Err(self.malformed(offset, format!("{} on an empty stack", op::name(code)))),
                        1 => return Err(self.malformed(offset, format!("{} without a list", op::name(code)))),
                        _ => {}
                    }
                    let item = self.stack.pop().expect("checked");
                    let target = self.stack.last().expect("checked");
                    match target {
                        Value::List(l) => l.items.borrow_mut().push(item),
                        other => {
                            let t = other.type_name();
                            self.discard(vec![item]);
                            return Err(self.malformed(offset, format!("{} to a {t}, not a list", op::name(code))));
                        }
                    }
                }
                op::SETITEMS => {
                    let (m, target) = self.marked_target(op::name(code), offset)?;
                    let Value::Dict(d) = target else {
                        return Err(self
                            .malformed(offset, format!("{} on a {}, not a dict", op::name(code), target.type_name())));
                    };
                    if (self.stack.len() - m) % 2 != 0 {
                        return Err(self.malformed(offset, format!("{} with an odd number of items", op::name(code))));
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
                op::SETITEM => {
                    // As APPEND: nothing is popped before the stack is known to hold a key, a value and
                    // something below them.
                    match self.above_floor() {
                        0 | 1 => return Err(self.malformed(offset, format!("{} on an empty stack", op::name(code)))),
                        2 => return Err(self.malformed(offset, format!("{} without a dict", op::name(code)))),
                        _ => {}
                    }
                    let items = self.stack.split_off(self.stack.len() - 2);
                    let target = self.stack.last().expect("checked");
                    match target {
                        Value::Dict(d) => {
                            let mut it = items.into_iter();
                            let mut v = d.items.borrow_mut();
                            while let (Some(k), Some(val)) = (it.next(), it.next()) {
                                v.push((k, val));
                            }
                        }
                        other => {
                            let t = other.type_name();
                            self.discard(items);
                            return Err(self.malformed(offset, format!("{} on a {t}, not a dict", op::name(code))));
                        }
                    }
                    let pos = self.stack.len() - 1;
                    self.compact_dict(pos, compactor, offset)?;
                }
                op::MEMOIZE => {
                    let idx = self.memo.len();
                    self.memo_put(idx, offset)?;
                }
                op::BINPUT => {
                    let [i] = self.input.fixed::<1>("BINPUT index", offset)?;
                    self.memo_put(i as usize, offset)?;
                }
                op::LONG_BINPUT => {
                    let i = u32::from_le_bytes(self.input.fixed::<4>("LONG_BINPUT index", offset)?);
                    self.memo_put(i as usize, offset)?;
                }
                op::PUT => {
                    let line = self.input.line(offset)?;
                    let i = std::str::from_utf8(&line).ok().and_then(|s| s.trim().parse::<usize>().ok());
                    let i =
                        i.ok_or_else(|| self.malformed(offset, format!("{} index is not a number", op::name(code))))?;
                    self.memo_put(i, offset)?;
                }
                op::BINGET => {
                    let [i] = self.input.fixed::<1>("BINGET index", offset)?;
                    self.memo_get(i as usize, offset)?;
                }
                op::LONG_BINGET => {
                    let i = u32::from_le_bytes(self.input.fixed::<4>("LONG_BINGET index", offset)?);
                    self.memo_get(i as usize, offset)?;
                }
                op::GET => {
                    let line = self.input.line(offset)?;
                    let i = std::str::from_utf8(&line).ok().and_then(|s| s.trim().parse::<usize>().ok());
                    let i =
                        i.ok_or_else(|| self.malformed(offset, format!("{} index is not a number", op::name(code))))?;
                    self.memo_get(i, offset)?;
                }
                other => return Err(PickleError::UnknownOpcode { byte: other, offset }),
            }
        }
    }
}
