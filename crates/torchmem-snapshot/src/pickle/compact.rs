//! The compaction hook: a [`Compactor`] sees every finished dict and may replace it (on the stack and in
//! the memo) by a small handle, so memory follows unique objects; the containers it takes over are
//! emptied so that a crafted cycle through them cannot leak.

use std::io::Read;
use std::rc::Rc;

use super::value::{is_container, Value, NO_MEMO};
use super::vm::Unpickler;
use crate::error::PickleError;

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

impl<R: Read> Unpickler<R> {
    /// Replaces the memo slot of container `old` (if it is still there) by `new`.
    pub(super) fn memo_replace(&mut self, old: &Value, new: &Value) {
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
    pub(super) fn compact_dict<C: Compactor>(
        &mut self,
        pos: usize,
        compactor: &mut C,
        offset: u64,
    ) -> Result<(), PickleError> {
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
        self.discard(nested);
        self.replaced = replaced;
        Ok(())
    }
}
