//! The generic pickled value (`Value`, with reference-counted containers so memo sharing is kept) and
//! its lifetime management: containers are dropped iteratively (deep nesting cannot overflow the stack)
//! and `teardown` empties everything reachable, which frees reference cycles a pickle can build.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

/// Memo index sentinel for "not memoized".
pub(super) const NO_MEMO: u32 = u32::MAX;

/// A list (also used for sets while they are built) with the memo slot it was last stored in.
pub struct ListObj {
    pub items: RefCell<Vec<Value>>,
    pub(super) memo_idx: Cell<u32>,
}

/// A dict as key/value pairs in insertion order (keys may repeat; the last one wins on lookup).
pub struct DictObj {
    pub items: RefCell<Vec<(Value, Value)>>,
    pub(super) memo_idx: Cell<u32>,
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
pub(super) fn drop_iteratively(mut work: Vec<Value>) {
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

/// Drops values a pickle threw away. Containers owned only here are emptied and dropped; a container
/// still shared with something else is moved to `keep` instead (it may sit in a cycle, e.g. a dict that
/// contains itself, that only the final `teardown` can break).
pub(super) fn drop_keeping_shared(mut work: Vec<Value>, keep: &mut Vec<Value>) {
    while let Some(v) = work.pop() {
        match v {
            Value::List(rc) => match Rc::try_unwrap(rc) {
                Ok(mut obj) => work.append(obj.items.get_mut()),
                Err(rc) => keep.push(Value::List(rc)),
            },
            Value::Dict(rc) => match Rc::try_unwrap(rc) {
                Ok(mut obj) => {
                    for (k, v) in obj.items.get_mut().drain(..) {
                        work.push(k);
                        work.push(v);
                    }
                }
                Err(rc) => keep.push(Value::Dict(rc)),
            },
            Value::Tuple(rc) => match Rc::try_unwrap(rc) {
                Ok(items) => work.extend(items),
                Err(rc) => keep.push(Value::Tuple(rc)),
            },
            _ => {}
        }
    }
}

pub(super) fn new_list(items: Vec<Value>) -> Value {
    Value::List(Rc::new(ListObj { items: RefCell::new(items), memo_idx: Cell::new(NO_MEMO) }))
}

pub(super) fn new_dict(items: Vec<(Value, Value)>) -> Value {
    Value::Dict(Rc::new(DictObj { items: RefCell::new(items), memo_idx: Cell::new(NO_MEMO) }))
}

/// Empties every container reachable from `roots` (iteratively), which frees cyclic structures.
pub(super) fn teardown(roots: Vec<Value>) {
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

pub(super) fn is_container(v: &Value) -> bool {
    matches!(v, Value::List(_) | Value::Dict(_) | Value::Tuple(_))
}
