//! Expandable segments (`expandable_segments:True`): one reserved address range per (pool, stream) of 9/8 of
//! the device's memory, backed by pages mapped on demand (2 MiB in the small pool, `large_segment_size` in
//! the large one). Finding room (lowest unmapped range with enough free + unmapped space), mapping only the
//! missing pages, and unmapping whole free pages when the cache is released.

use crate::allocator::{Allocator, SegKind};
use crate::pool::{addr_key, Block, NONE};
use crate::rounding::SMALL_BUFFER_BYTES;

#[derive(Debug, Clone)]
pub struct ExpandableSegment {
    pub base: u64,
    pub size_bytes: u64,
    pub page_bytes: u64,
    pub stream: u16,
    pub pool: u8,
    pub released: bool,
}

impl ExpandableSegment {
    /// Pages covering `[ptr, ptr + size)` (map rounds outwards).
    pub fn pages_covering(&self, ptr: u64, size: u64) -> (u64, u64) {
        let begin = (ptr - self.base) / self.page_bytes;
        let end = (ptr + size - self.base).div_ceil(self.page_bytes);
        (begin, end)
    }

    /// Whole pages inside `[ptr, ptr + size)` (unmap rounds inwards).
    pub fn pages_inside(&self, ptr: u64, size: u64) -> (u64, u64) {
        let begin = (ptr - self.base).div_ceil(self.page_bytes);
        let end = (ptr + size - self.base) / self.page_bytes;
        (begin, end)
    }
}

impl Allocator {
    fn allocatable(&self, id: u32) -> bool {
        if id == NONE {
            return false;
        }
        let b = self.arena.get(id);
        !b.allocated && !b.pending
    }

    /// `find_expandable_block`: the lowest unmapped range of this stream (with the free block before it)
    /// that has `size` bytes of free + unmapped space; else a new expandable segment.
    fn find_expandable_block(&mut self, pool: usize, stream: u16, size: u64) -> u32 {
        let candidates: Vec<u32> =
            self.pools[pool].unmapped.range(addr_key(stream, 0)..addr_key(stream + 1, 0)).map(|(_, &id)| id).collect();
        for u in candidates {
            let mut c = u;
            let prev = self.arena.get(c).prev;
            if self.allocatable(prev) {
                c = prev;
            }
            let mut bytes = 0u64;
            let mut b = c;
            while bytes < size && self.allocatable(b) {
                bytes += self.arena.get(b).size_bytes;
                b = self.arena.get(b).next;
            }
            if bytes >= size {
                return c;
            }
        }
        let (page, size_bytes) = self.reservation_size(pool, 0);
        let hint = self.hinted_addr(SegKind::SegmentMap, None);
        let base = self.device.address(size_bytes, hint);
        self.reserve(base, size_bytes, page, stream, pool)
    }

    /// A reservation's page size in `pool` and its size: 9/8 of the device's memory, at least `at_least`
    /// bytes, in whole pages.
    fn reservation_size(&self, pool: usize, at_least: u64) -> (u64, u64) {
        let page = if pool == 0 { SMALL_BUFFER_BYTES } else { self.conf.large_segment_size_bytes };
        let want = (self.device.total_global_bytes / 8 * 9).max(at_least);
        (page, want.div_ceil(page) * page)
    }

    /// A new expandable segment at `base` (its address range already taken from the device), all unmapped:
    /// returns its one unmapped block.
    fn reserve(&mut self, base: u64, size_bytes: u64, page: u64, stream: u16, pool: usize) -> u32 {
        let es_id = self.expandable.len() as u32;
        self.expandable.push(ExpandableSegment {
            base,
            size_bytes,
            page_bytes: page,
            stream,
            pool: pool as u8,
            released: false,
        });
        let b = Block { mapped: false, expandable: es_id, ..Block::free(base, size_bytes, stream, pool as u8) };
        let id = self.arena.alloc(b.clone());
        self.pools[pool].insert_unmapped(&b, id);
        id
    }

    /// `try_allocate_expandable_block`: map what is missing so one free block of at least `size` exists.
    pub(crate) fn try_allocate_expandable_block(&mut self, pool: usize, stream: u16, size: u64) -> Option<u32> {
        let mut c = self.find_expandable_block(pool, stream, size);
        if !self.arena.get(c).mapped {
            let n = self.arena.get(c).size_bytes.min(size);
            if !self.map_block(c, n) {
                return None;
            }
        }
        while self.arena.get(c).size_bytes < size {
            let remaining = size - self.arena.get(c).size_bytes;
            let next = self.arena.get(c).next;
            if next == NONE {
                // The request is larger than the segment's whole address space (1 1/8 of the device):
                // on a real device mapping that much fails first (out of memory); a simulated device
                // made larger (a what-if's memory search) must fail here the same way.
                return None;
            }
            let n = remaining.min(self.arena.get(next).size_bytes);
            if !self.map_block(next, n) {
                return None;
            }
            c = next;
        }
        let b = self.arena.get(c).clone();
        self.pools[pool].remove_free(&b);
        Some(c)
    }

    /// A reservation that had pages mapped before the trace (`start::StartReservation`): all unmapped here;
    /// `seed_mapped_range` then maps its ranges. 9/8 of the device's memory from `base`, at least up to the
    /// highest address the recording shows in it.
    pub fn seed_reservation(&mut self, base: u64, end_seen: u64, stream: u16, small: bool) {
        let pool = if small { 0 } else { 1 };
        let (page, size_bytes) = self.reservation_size(pool, end_seen.saturating_sub(base));
        self.device.address(size_bytes, Some(base));
        self.reserve(base, size_bytes, page, stream, pool);
    }

    /// Maps `[addr, addr + size)` of a seeded reservation (pages mapped at the trace's start): cut out of
    /// the unmapped block holding it, counted as reserved. Returns the mapped block (linked to the unmapped
    /// rests around it, in no pool set yet: the caller lays out its live and free blocks).
    pub fn seed_mapped_range(&mut self, addr: u64, size: u64, stream: u16, small: bool) -> u32 {
        let pool = if small { 0 } else { 1 };
        let holder = self.pools[pool]
            .unmapped
            .range(addr_key(stream, 0)..=addr_key(stream, addr))
            .next_back()
            .map(|(_, &id)| id)
            .filter(|&id| {
                let b = self.arena.get(id);
                b.addr <= addr && addr + size <= b.addr + b.size_bytes
            });
        let Some(id) = holder else {
            // Not inside a seeded reservation (cannot happen for a reconstructed start): a lone mapped block.
            return self.seed_segment(addr, size, stream, small);
        };
        self.device.used_bytes += size;
        self.add_reserved(size);
        let b = self.arena.get(id).clone();
        self.pools[pool].remove_unmapped(&b);
        let (end, b_end) = (addr + size, b.addr + b.size_bytes);
        let mut pieces = Vec::with_capacity(3);
        if addr > b.addr {
            pieces.push((b.addr, addr - b.addr, false));
        }
        let mapped_at = pieces.len();
        pieces.push((addr, size, true));
        if end < b_end {
            pieces.push((end, b_end - end, false));
        }
        let mut ids = vec![id];
        for _ in 1..pieces.len() {
            ids.push(self.arena.alloc(b.clone()));
        }
        for (i, (&(pa, ps, mapped), &pid)) in pieces.iter().zip(&ids).enumerate() {
            let piece = Block {
                addr: pa,
                size_bytes: ps,
                mapped,
                prev: if i == 0 { b.prev } else { ids[i - 1] },
                next: ids.get(i + 1).copied().unwrap_or(b.next),
                ..b.clone()
            };
            *self.arena.get_mut(pid) = piece.clone();
            if !mapped {
                self.pools[pool].insert_unmapped(&piece, pid);
            }
        }
        if b.next != NONE {
            self.arena.get_mut(b.next).prev = *ids.last().expect("one piece at least");
        }
        ids[mapped_at]
    }

    /// `map_block`: map the pages under the first `size` bytes of an unmapped range, then merge with free
    /// neighbours. False when the device has no room for the pages.
    fn map_block(&mut self, id: u32, size: u64) -> bool {
        let b = self.arena.get(id).clone();
        let es = &self.expandable[b.expandable as usize];
        let (begin, end) = es.pages_covering(b.addr, size);
        let mapped = (end - begin) * es.page_bytes;
        if mapped == 0 {
            return true;
        }
        if !self.device.take(mapped) {
            return false;
        }
        let pool = b.pool as usize;
        self.pools[pool].remove_unmapped(&b);
        self.arena.get_mut(id).mapped = true;
        if mapped < b.size_bytes {
            let rest = Block {
                mapped: false,
                expandable: b.expandable,
                prev: id,
                next: b.next,
                ..Block::free(b.addr + mapped, b.size_bytes - mapped, b.stream, b.pool)
            };
            let rid = self.arena.alloc(rest.clone());
            if b.next != NONE {
                self.arena.get_mut(b.next).prev = rid;
            }
            let m = self.arena.get_mut(id);
            m.next = rid;
            m.size_bytes = mapped;
            self.pools[pool].insert_unmapped(&rest, rid);
        }
        let (prev, next) = (self.arena.get(id).prev, self.arena.get(id).next);
        self.try_merge(id, prev);
        self.try_merge(id, next);
        self.pools[pool].insert_free(&mut self.arena, id);
        self.add_reserved(mapped);
        self.stats.num_device_alloc += 1;
        self.emit(SegKind::SegmentMap, b.addr, mapped);
        true
    }

    /// `unmap_block`: give back the whole pages inside a free block; the partial pages at its ends stay mapped
    /// as free blocks.
    pub(crate) fn unmap_block(&mut self, id: u32) {
        let b = self.arena.get(id).clone();
        let es = &self.expandable[b.expandable as usize];
        let (begin, end) = es.pages_inside(b.addr, b.size_bytes);
        if begin >= end {
            return;
        }
        let ustart = es.base + begin * es.page_bytes;
        let usize_ = (end - begin) * es.page_bytes;
        let pool = b.pool as usize;
        self.pools[pool].remove_free(&b);
        let before = ustart - b.addr;
        if before > 0 {
            let f = Block {
                expandable: b.expandable,
                prev: b.prev,
                next: id,
                ..Block::free(b.addr, before, b.stream, b.pool)
            };
            let fid = self.arena.alloc(f);
            if b.prev != NONE {
                self.arena.get_mut(b.prev).next = fid;
            }
            self.arena.get_mut(id).prev = fid;
            self.pools[pool].insert_free(&mut self.arena, fid);
        }
        let after = b.size_bytes - before - usize_;
        if after > 0 {
            let next = self.arena.get(id).next;
            let f = Block {
                expandable: b.expandable,
                prev: id,
                next,
                ..Block::free(ustart + usize_, after, b.stream, b.pool)
            };
            let fid = self.arena.alloc(f);
            if next != NONE {
                self.arena.get_mut(next).prev = fid;
            }
            self.arena.get_mut(id).next = fid;
            self.pools[pool].insert_free(&mut self.arena, fid);
        }
        {
            let m = self.arena.get_mut(id);
            m.addr = ustart;
            m.size_bytes = usize_;
            m.mapped = false;
        }
        let (prev, next) = (self.arena.get(id).prev, self.arena.get(id).next);
        self.try_merge(id, prev);
        self.try_merge(id, next);
        let m = self.arena.get(id).clone();
        self.pools[pool].insert_unmapped(&m, id);
        self.device.give_back(usize_);
        self.stats.reserved_bytes -= usize_;
        self.stats.num_device_free += 1;
        self.emit(SegKind::SegmentUnmap, ustart, usize_);
    }

    /// `release_expandable_segment`: a fully unmapped segment gives its address range back.
    pub(crate) fn release_expandable_segment(&mut self, id: u32) {
        let b = self.arena.get(id).clone();
        self.pools[b.pool as usize].remove_unmapped(&b);
        self.expandable[b.expandable as usize].released = true;
        let base = self.expandable[b.expandable as usize].base;
        self.device.release_address(base);
        self.arena.release(id);
    }
}
