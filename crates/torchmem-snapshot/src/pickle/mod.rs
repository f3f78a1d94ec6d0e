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
//!
//! Files: `value` (the value model and its iterative drop / cycle teardown), `input` (buffered byte input
//! with offsets), `opcodes` (named opcodes and the refused ones), `vm` (the interpreter and its memo),
//! `compact` (the hook that replaces finished dicts by records).

use std::io::Read;

use crate::error::PickleError;

mod compact;
mod input;
pub mod opcodes;
mod value;
mod vm;

pub use compact::{Compactor, KeepAll};
use value::teardown;
pub use value::{dict_get, DictObj, ListObj, Value};
use vm::Unpickler;

/// Highest pickle protocol understood.
pub const HIGHEST_PROTOCOL: u8 = 5;

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

/// Reads one pickle from `reader` with the given compactor.
pub fn unpickle<R: Read, C: Compactor>(reader: R, compactor: &mut C) -> Result<Document, PickleError> {
    let mut u = Unpickler::new(input::Input::new(reader));
    let root = u.run(compactor)?;
    let mut memo = std::mem::take(&mut u.memo);
    // Values left on the stack, or thrown away while they were still shared, may share containers with
    // the root: the document owns them too.
    memo.extend(std::mem::take(&mut u.stack).into_iter().map(Some));
    memo.extend(std::mem::take(&mut u.discarded).into_iter().map(Some));
    Ok(Document { root, memo })
}

/// Reads one pickle from bytes, keeping every dict (no compaction).
pub fn unpickle_bytes(data: &[u8]) -> Result<Document, PickleError> {
    unpickle(data, &mut KeepAll)
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

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
    fn a_popped_dict_that_contains_itself_is_freed() {
        // The fuzzer's leak: EMPTY_DICT, DUP, DUP, SETITEM (d[d] = d), POP, then an error; and the same
        // with a STOP, so both the error path and the document free it.
        for data in [&b"\x80\x04}22s0N9"[..], &b"\x80\x04}22s0N."[..]] {
            let weak = {
                let mut u = Unpickler::new(input::Input::new(&data[..7]));
                let _ = u.run(&mut KeepAll);
                let Some(Value::Dict(d)) = u.discarded.first().cloned() else { panic!("the popped dict is kept") };
                std::rc::Rc::downgrade(&d)
            };
            assert!(weak.upgrade().is_none(), "the self-containing dict was freed");
            let _ = unpickle_bytes(data);
        }
    }

    #[test]
    fn a_self_containing_container_is_freed_when_its_opcode_fails() {
        // The fuzzer's leak of 2026-12-03 (fuzz/seeds/leak_append_without_list): a list appended to itself
        // (EMPTY_LIST, DUP, DUP, APPEND, APPEND), then an APPEND with the list alone on the stack; before, it
        // popped the list, failed and dropped it outside the teardown, so the cycle leaked. The same for
        // SETITEM with only the dict left (d[d] = d first) and DICT over an odd count (the list in it).
        for (data, what) in [
            (&b"\x80\x04]22aaa."[..], "without a list"),
            (&b"\x80\x04}22ss."[..], "on an empty stack"),
            (&b"\x80\x04}222ss."[..], "without a dict"),
            (&b"\x80\x04(]2ad."[..], "odd number"),
        ] {
            let (e, lists, dicts) = {
                let mut u = Unpickler::new(input::Input::new(data));
                let e = u.run(&mut KeepAll).map(|_| ()).expect_err("the opcode fails");
                let (mut lists, mut dicts) = (Vec::new(), Vec::new());
                for v in u.stack.iter().chain(u.memo.iter().flatten()).chain(u.discarded.iter()) {
                    match v {
                        Value::List(l) => lists.push(Rc::downgrade(l)),
                        Value::Dict(d) => dicts.push(Rc::downgrade(d)),
                        _ => {}
                    }
                }
                assert!(
                    !lists.is_empty() || !dicts.is_empty(),
                    "{data:?}: the container is still reached after the error"
                );
                (e, lists, dicts)
            };
            assert!(e.to_string().contains(what), "{data:?}: {e}");
            let freed = lists.iter().all(|w| w.upgrade().is_none()) && dicts.iter().all(|w| w.upgrade().is_none());
            assert!(freed, "{data:?}: the self-containing container was freed");
            assert!(unpickle_bytes(data).is_err());
        }
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
