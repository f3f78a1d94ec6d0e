//! Blocks and pools: the block arena (blocks link to their neighbours in a segment, as torch's `Block`
//! does), and a pool's two ordered sets — free mapped blocks by (stream, size, address) for best fit, and
//! unmapped expandable ranges by (stream, address).

use std::collections::BTreeMap;

/// "No block" in the `prev`/`next` links and "not expandable" in `expandable`.
pub const NONE: u32 = u32::MAX;

/// One block of a segment (allocated, waiting for its free to complete, free, or an unmapped range).
#[derive(Debug, Clone)]
pub struct Block {
    pub addr: u64,
    pub size_bytes: u64,
    pub requested_bytes: u64,
    /// Rank of the stream (streams ordered by their `cudaStream_t` value, as torch's comparator does).
    pub stream: u16,
    /// 0: small pool, 1: large pool.
    pub pool: u8,
    pub allocated: bool,
    /// Freed by the program but its `free_completed` has not happened yet (outstanding stream events).
    pub pending: bool,
    pub mapped: bool,
    /// Index of its expandable segment, or `NONE`.
    pub expandable: u32,
    pub prev: u32,
    pub next: u32,
    /// The pool's `get_free_blocks_call_count` when the block was last put into the free set (GC age).
    pub gc_base: i64,
    /// The trace entry that allocated it (for OOM reports), or `u32::MAX`.
    pub alloc_entry: u32,
}

impl Block {
    /// A free, mapped block of a segment, on its own (no neighbours, not expandable), requested by nobody:
    /// what a new segment starts as and what a split leaves; callers set the links and the rest they differ in.
    pub fn free(addr: u64, size_bytes: u64, stream: u16, pool: u8) -> Block {
        Block {
            addr,
            size_bytes,
            requested_bytes: 0,
            stream,
            pool,
            allocated: false,
            pending: false,
            mapped: true,
            expandable: NONE,
            prev: NONE,
            next: NONE,
            gc_base: 0,
            alloc_entry: u32::MAX,
        }
    }

    pub fn is_split(&self) -> bool {
        self.prev != NONE || self.next != NONE
    }
}

/// Key of the best-fit set: stream rank, then size, then address.
#[inline]
pub fn size_key(stream: u16, size_bytes: u64, addr: u64) -> u128 {
    ((stream as u128) << 112) | ((size_bytes as u128) << 64) | addr as u128
}

/// Key of the unmapped set: stream rank, then address.
#[inline]
pub fn addr_key(stream: u16, addr: u64) -> u128 {
    ((stream as u128) << 64) | addr as u128
}

/// The block arena: ids are indices; freed ids are reused.
#[derive(Debug, Default, Clone)]
pub struct Arena {
    pub blocks: Vec<Block>,
    free_ids: Vec<u32>,
}

impl Arena {
    pub fn alloc(&mut self, b: Block) -> u32 {
        if let Some(id) = self.free_ids.pop() {
            self.blocks[id as usize] = b;
            id
        } else {
            self.blocks.push(b);
            (self.blocks.len() - 1) as u32
        }
    }

    pub fn release(&mut self, id: u32) {
        self.free_ids.push(id);
    }

    #[inline]
    pub fn get(&self, id: u32) -> &Block {
        &self.blocks[id as usize]
    }

    #[inline]
    pub fn get_mut(&mut self, id: u32) -> &mut Block {
        &mut self.blocks[id as usize]
    }
}

/// One of the allocator's block pools (the default small or large pool).
#[derive(Debug, Clone)]
pub struct Pool {
    pub is_small: bool,
    /// Free mapped blocks, best-fit order.
    pub free: BTreeMap<u128, u32>,
    /// Unmapped ranges of expandable segments, address order.
    pub unmapped: BTreeMap<u128, u32>,
    /// `get_free_blocks_call_count`: counts searches while GC is active; a block's age is measured in it.
    pub gc_calls: i64,
}

impl Pool {
    pub fn new(is_small: bool) -> Pool {
        Pool { is_small, free: BTreeMap::new(), unmapped: BTreeMap::new(), gc_calls: 0 }
    }

    /// Inserts a free mapped block (resets its GC age, as `insert_into_blocks` does).
    pub fn insert_free(&mut self, arena: &mut Arena, id: u32) {
        let b = arena.get_mut(id);
        b.gc_base = self.gc_calls;
        let prev = self.free.insert(size_key(b.stream, b.size_bytes, b.addr), id);
        debug_assert!(prev.is_none(), "block inserted twice");
    }

    pub fn remove_free(&mut self, b: &Block) {
        let removed = self.free.remove(&size_key(b.stream, b.size_bytes, b.addr));
        debug_assert!(removed.is_some(), "free block missing from its pool");
    }

    pub fn insert_unmapped(&mut self, b: &Block, id: u32) {
        self.unmapped.insert(addr_key(b.stream, b.addr), id);
    }

    pub fn remove_unmapped(&mut self, b: &Block) {
        let removed = self.unmapped.remove(&addr_key(b.stream, b.addr));
        debug_assert!(removed.is_some(), "unmapped block missing from its pool");
    }
}
