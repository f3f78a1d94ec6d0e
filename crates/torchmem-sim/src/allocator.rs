//! The allocator state machine: torch 2.11's `DeviceCachingAllocator` decisions for one device — best fit
//! with the oversize rules, the split rule, frees and merging, garbage collection under a memory fraction,
//! the out-of-memory retry chain (free oversize blocks, free every cached segment, retry), and the
//! statistics `torch.cuda.memory_stats()` reports. Expandable segments' page mapping is in `expandable.rs`.

use serde::Serialize;

use crate::config::AllocConf;
use crate::device::Device;
use crate::expandable::ExpandableSegment;
use crate::pool::{size_key, Arena, Block, Pool, NONE};
use crate::rounding::{allocation_size, is_small, round_size, MIN_BLOCK_BYTES, SMALL_SIZE_BYTES};

/// A segment-level event (what torch's trace records as segment_alloc/free/map/unmap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SegKind {
    SegmentAlloc,
    SegmentFree,
    SegmentMap,
    SegmentUnmap,
}

impl SegKind {
    pub fn name(self) -> &'static str {
        match self {
            SegKind::SegmentAlloc => "segment_alloc",
            SegKind::SegmentFree => "segment_free",
            SegKind::SegmentMap => "segment_map",
            SegKind::SegmentUnmap => "segment_unmap",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SegEvent {
    pub kind: SegKind,
    pub addr: u64,
    pub size_bytes: u64,
    /// The trace entry whose allocation (or `empty_cache`) caused it.
    pub entry: u32,
}

/// The counters of `torch.cuda.memory_stats()` that the simulator reproduces (all pools together).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Stats {
    pub allocated_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub active_bytes: u64,
    pub peak_active_bytes: u64,
    pub requested_bytes: u64,
    pub peak_requested_bytes: u64,
    /// Non-expandable segments (torch's `segment` stat).
    pub segments: u64,
    pub peak_segments: u64,
    /// cudaMalloc calls plus page mappings (`num_device_alloc`).
    pub num_device_alloc: u64,
    /// cudaFree calls plus unmappings (`num_device_free`).
    pub num_device_free: u64,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
}

/// Why an allocation failed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OomFailure {
    pub requested_bytes: u64,
    pub rounded_bytes: u64,
    /// The segment size alloc_block asked for.
    pub segment_bytes: u64,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    /// Set when a per-process memory fraction refused it (else the device was full).
    pub over_memory_limit: bool,
}

pub struct Allocator {
    pub conf: AllocConf,
    pub arena: Arena,
    /// [small, large].
    pub pools: [Pool; 2],
    pub stats: Stats,
    /// `allowed_memory_maximum` when a memory fraction is set (`set_fraction`).
    pub allowed_bytes: Option<u64>,
    pub device: Device,
    pub expandable: Vec<ExpandableSegment>,
    /// Emitted segment events (kept when `keep_events`).
    pub events: Vec<SegEvent>,
    pub keep_events: bool,
    pub events_emitted: usize,
    /// The recording's segment events: while the replay follows them, new segments take their addresses.
    pub hints: Vec<SegEvent>,
    pub follow_hints: bool,
    /// The trace entry being replayed (tags events).
    pub entry: u32,
    /// Blocks freed by the program whose free has not completed.
    pub pending: Vec<u32>,
    /// reserved - allocated right after the allocation that set the reserved peak.
    pub unallocated_at_peak_bytes: u64,
}

impl Allocator {
    pub fn new(conf: AllocConf, allowed_bytes: Option<u64>, device: Device) -> Allocator {
        Allocator {
            conf,
            arena: Arena::default(),
            pools: [Pool::new(true), Pool::new(false)],
            stats: Stats::default(),
            allowed_bytes,
            device,
            expandable: Vec::new(),
            events: Vec::new(),
            keep_events: true,
            events_emitted: 0,
            hints: Vec::new(),
            follow_hints: false,
            entry: 0,
            pending: Vec::new(),
            unallocated_at_peak_bytes: 0,
        }
    }

    fn gc_active(&self) -> bool {
        self.allowed_bytes.is_some() && self.conf.garbage_collection_threshold > 0.0
    }

    pub(crate) fn emit(&mut self, kind: SegKind, addr: u64, size_bytes: u64) {
        if self.follow_hints {
            // The driver sees only the sequence of calls: once it differs from the recording's, the recorded
            // addresses say nothing more.
            let same = self
                .hints
                .get(self.events_emitted)
                .is_some_and(|h| h.kind == kind && h.size_bytes == size_bytes && h.addr == addr);
            if !same {
                self.follow_hints = false;
            }
        }
        if self.keep_events {
            self.events.push(SegEvent { kind, addr, size_bytes, entry: self.entry });
        }
        self.events_emitted += 1;
    }

    /// The recorded address of the event about to be emitted, when the recording has the same one here.
    pub(crate) fn hinted_addr(&self, kind: SegKind, size_bytes: Option<u64>) -> Option<u64> {
        if !self.follow_hints {
            return None;
        }
        let h = self.hints.get(self.events_emitted)?;
        (h.kind == kind && size_bytes.is_none_or(|s| s == h.size_bytes)).then_some(h.addr)
    }

    pub(crate) fn add_reserved(&mut self, bytes: u64) {
        let s = &mut self.stats;
        s.reserved_bytes += bytes;
        s.peak_reserved_bytes = s.peak_reserved_bytes.max(s.reserved_bytes);
    }

    /// Adds an existing segment (state at the trace's start); returns its single block.
    pub fn seed_segment(&mut self, addr: u64, size_bytes: u64, stream: u16, small: bool) -> u32 {
        let pool = if small { 0 } else { 1 };
        self.device.used_bytes += size_bytes;
        self.device.address(size_bytes, Some(addr));
        self.stats.segments += 1;
        self.stats.peak_segments = self.stats.peak_segments.max(self.stats.segments);
        self.add_reserved(size_bytes);
        self.arena.alloc(Block::free(addr, size_bytes, stream, pool))
    }

    /// `malloc`: returns the block serving `orig_bytes` on `stream`, or why it failed.
    pub fn malloc(&mut self, orig_bytes: u64, stream: u16) -> Result<u32, OomFailure> {
        let size = round_size(&self.conf, orig_bytes);
        let pool = if is_small(size) { 0 } else { 1 };
        let alloc_size = allocation_size(&self.conf, size);
        let peak_before = self.stats.peak_reserved_bytes;
        let mut found = self.get_free_block(pool, stream, size);
        if found.is_none() {
            if self.gc_active() {
                self.garbage_collect();
            }
            found = self.alloc_block(pool, stream, size, alloc_size, false);
            if found.is_none() && self.release_available_cached_blocks(pool, stream, size) {
                found = self.alloc_block(pool, stream, size, alloc_size, false);
            }
            if found.is_none() {
                self.release_cached_blocks();
                found = self.alloc_block(pool, stream, size, alloc_size, true);
            }
        }
        let Some(block) = found else {
            self.stats.num_ooms += 1;
            let over = self.allowed_bytes.is_some_and(|a| self.stats.reserved_bytes + alloc_size > a);
            return Err(OomFailure {
                requested_bytes: orig_bytes,
                rounded_bytes: size,
                segment_bytes: alloc_size,
                allocated_bytes: self.stats.allocated_bytes,
                reserved_bytes: self.stats.reserved_bytes,
                over_memory_limit: over,
            });
        };
        let split = self.should_split(block, size);
        let id = self.alloc_found_block(block, size, orig_bytes, split);
        if self.stats.peak_reserved_bytes > peak_before {
            self.unallocated_at_peak_bytes = self.stats.reserved_bytes - self.stats.allocated_bytes;
        }
        Ok(id)
    }

    /// `get_free_block`: best fit on this stream, with the expandable walk and the oversize rules.
    fn get_free_block(&mut self, pool: usize, stream: u16, size: u64) -> Option<u32> {
        let gc = self.gc_active();
        let p = &mut self.pools[pool];
        if gc {
            p.gc_calls += 1;
        }
        let mut it = p.free.range(size_key(stream, size, 0)..).map(|(_, &id)| id);
        let mut cur = it.next()?;
        if self.arena.get(cur).stream != stream {
            return None;
        }
        if self.arena.get(cur).expandable != NONE {
            if self.conf.expandable_segments {
                let esize = |a: &Arena, id: u32| {
                    let b = a.get(id);
                    let tail = if b.next != NONE && !a.get(b.next).mapped { a.get(b.next).size_bytes } else { 0 };
                    b.size_bytes + tail
                };
                for next in it {
                    let cb = self.arena.get(cur);
                    if cb.expandable == NONE
                        || self.arena.get(next).stream != stream
                        || esize(&self.arena, next) >= esize(&self.arena, cur)
                    {
                        break;
                    }
                    cur = next;
                }
            } else {
                // Expandable segments switched off: only non-expandable blocks qualify.
                let mut found = None;
                for next in it {
                    let nb = self.arena.get(next);
                    if nb.stream != stream {
                        return None;
                    }
                    if nb.expandable == NONE {
                        found = Some(next);
                        break;
                    }
                }
                cur = found?;
            }
        }
        let bsize = self.arena.get(cur).size_bytes;
        let max_split = self.conf.max_split_size_bytes;
        if size < max_split && bsize >= max_split {
            return None;
        }
        if size >= max_split && bsize >= size.saturating_add(self.conf.max_non_split_rounding_bytes) {
            return None;
        }
        let b = self.arena.get(cur).clone();
        self.pools[pool].remove_free(&b);
        Some(cur)
    }

    fn should_split(&self, block: u32, size: u64) -> bool {
        let b = self.arena.get(block);
        let remaining = b.size_bytes - size;
        if b.pool == 0 || self.conf.expandable_segments {
            remaining >= MIN_BLOCK_BYTES
        } else {
            size < self.conf.max_split_size_bytes && remaining > SMALL_SIZE_BYTES
        }
    }

    /// `alloc_found_block`: splits off the front part when asked and hands it out.
    fn alloc_found_block(&mut self, block: u32, size: u64, orig_bytes: u64, split: bool) -> u32 {
        let id = if split {
            let rem = self.arena.get(block).clone();
            let front = Block {
                expandable: rem.expandable,
                prev: rem.prev,
                next: block,
                ..Block::free(rem.addr, size, rem.stream, rem.pool)
            };
            let fid = self.arena.alloc(front);
            if rem.prev != NONE {
                self.arena.get_mut(rem.prev).next = fid;
            }
            let r = self.arena.get_mut(block);
            r.prev = fid;
            r.addr += size;
            r.size_bytes -= size;
            let pool = r.pool as usize;
            self.pools[pool].insert_free(&mut self.arena, block);
            fid
        } else {
            block
        };
        let entry = self.entry;
        let b = self.arena.get_mut(id);
        b.allocated = true;
        b.requested_bytes = orig_bytes;
        b.alloc_entry = entry;
        let bsize = b.size_bytes;
        let s = &mut self.stats;
        s.allocated_bytes += bsize;
        s.peak_allocated_bytes = s.peak_allocated_bytes.max(s.allocated_bytes);
        s.active_bytes += bsize;
        s.peak_active_bytes = s.peak_active_bytes.max(s.active_bytes);
        s.requested_bytes += orig_bytes;
        s.peak_requested_bytes = s.peak_requested_bytes.max(s.requested_bytes);
        id
    }

    /// `free` (the program drops the tensor: `free_requested`). The block stays unusable until
    /// `free_completed`.
    pub fn free_requested(&mut self, id: u32) {
        let b = self.arena.get_mut(id);
        if !b.allocated {
            return;
        }
        b.allocated = false;
        b.pending = true;
        let size = b.size_bytes;
        self.stats.allocated_bytes -= size;
        self.pending.push(id);
    }

    /// `free_block` (`free_completed`): merge with free neighbours and return to the pool.
    pub fn free_completed(&mut self, id: u32) {
        let b = self.arena.get(id);
        if b.allocated || !b.pending {
            return;
        }
        if let Some(pos) = self.pending.iter().rposition(|&p| p == id) {
            self.pending.swap_remove(pos);
        }
        self.free_block(id);
    }

    fn free_block(&mut self, id: u32) {
        let b = self.arena.get_mut(id);
        b.pending = false;
        let (orig_size, requested, prev, next, pool) = (b.size_bytes, b.requested_bytes, b.prev, b.next, b.pool);
        self.try_merge(id, prev);
        self.try_merge(id, next);
        self.pools[pool as usize].insert_free(&mut self.arena, id);
        self.stats.active_bytes -= orig_size;
        self.stats.requested_bytes -= requested;
    }

    /// `try_merge_blocks`: `dst` absorbs its neighbour `src` when that is free, settled and equally mapped.
    pub(crate) fn try_merge(&mut self, dst: u32, src: u32) -> u64 {
        if src == NONE {
            return 0;
        }
        let s = self.arena.get(src).clone();
        let d = self.arena.get(dst);
        if s.allocated || s.pending || s.mapped != d.mapped {
            return 0;
        }
        let pool = s.pool as usize;
        if s.mapped {
            self.pools[pool].remove_free(&s);
        } else {
            self.pools[pool].remove_unmapped(&s);
        }
        let d = self.arena.get_mut(dst);
        if d.prev == src {
            d.addr = s.addr;
            d.prev = s.prev;
            if s.prev != NONE {
                self.arena.get_mut(s.prev).next = dst;
            }
        } else {
            d.next = s.next;
            if s.next != NONE {
                self.arena.get_mut(s.next).prev = dst;
            }
        }
        self.arena.get_mut(dst).size_bytes += s.size_bytes;
        self.arena.release(src);
        s.size_bytes
    }

    /// `alloc_block`: a new segment (or pages of an expandable one), unless the fraction or the device refuses.
    fn alloc_block(&mut self, pool: usize, stream: u16, size: u64, alloc_size: u64, is_retry: bool) -> Option<u32> {
        if is_retry {
            self.stats.num_alloc_retries += 1;
        }
        if let Some(allowed) = self.allowed_bytes {
            if self.stats.reserved_bytes + alloc_size > allowed {
                return None;
            }
        }
        if self.conf.expandable_segments {
            return self.try_allocate_expandable_block(pool, stream, size);
        }
        if !self.device.take(alloc_size) {
            return None;
        }
        let hint = self.hinted_addr(SegKind::SegmentAlloc, Some(alloc_size));
        let addr = self.device.address(alloc_size, hint);
        let id = self.arena.alloc(Block::free(addr, alloc_size, stream, pool as u8));
        self.add_reserved(alloc_size);
        self.stats.segments += 1;
        self.stats.peak_segments = self.stats.peak_segments.max(self.stats.segments);
        self.stats.num_device_alloc += 1;
        self.emit(SegKind::SegmentAlloc, addr, alloc_size);
        Some(id)
    }

    /// `release_block`: cudaFree of a whole free segment.
    fn release_block(&mut self, id: u32) {
        let b = self.arena.get(id).clone();
        debug_assert!(b.expandable == NONE && !b.is_split());
        self.pools[b.pool as usize].remove_free(&b);
        self.emit(SegKind::SegmentFree, b.addr, b.size_bytes);
        self.device.give_back(b.size_bytes);
        self.device.release_address(b.addr);
        self.stats.reserved_bytes -= b.size_bytes;
        self.stats.segments -= 1;
        self.stats.num_device_free += 1;
        self.arena.release(id);
    }

    /// `release_available_cached_blocks`: with `max_split_size` set, free one oversize block large enough,
    /// or the largest oversize blocks until enough is freed.
    fn release_available_cached_blocks(&mut self, pool: usize, stream: u16, size: u64) -> bool {
        let max_split = self.conf.max_split_size_bytes;
        if max_split == u64::MAX {
            return false;
        }
        let key_size = size.max(max_split);
        let key = size_key(stream, key_size, 0);
        let first = self.pools[pool].free.range(key..).next().map(|(_, &id)| id);
        if let Some(id) = first {
            let b = self.arena.get(id);
            if b.stream == stream && b.expandable == NONE {
                self.release_block(id);
                return true;
            }
        }
        // No single block: free oversize blocks from the largest down.
        let candidates: Vec<u32> = self.pools[pool].free.range(..key).rev().map(|(_, &id)| id).collect();
        if candidates.is_empty() {
            return false;
        }
        let mut released = 0u64;
        for id in candidates {
            if released >= key_size {
                break;
            }
            let b = self.arena.get(id);
            if b.size_bytes < max_split || b.stream != stream {
                break;
            }
            if b.expandable == NONE {
                released += b.size_bytes;
                self.release_block(id);
            }
        }
        released >= key_size
    }

    /// `release_cached_blocks` (also `empty_cache`): complete outstanding frees, then free every unsplit
    /// segment and unmap the free pages of expandable ones, large pool first.
    pub fn release_cached_blocks(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        for id in pending {
            if self.arena.get(id).pending {
                self.free_block(id);
            }
        }
        self.release_blocks(1);
        self.release_blocks(0);
    }

    fn release_blocks(&mut self, pool: usize) {
        let ids: Vec<u32> = self.pools[pool].free.values().copied().collect();
        let mut to_unmap = Vec::new();
        for id in ids {
            let b = self.arena.get(id);
            if b.expandable != NONE {
                to_unmap.push(id);
            } else if !b.is_split() {
                self.release_block(id);
            }
        }
        for id in to_unmap {
            self.unmap_block(id);
            let b = self.arena.get(id);
            if !b.is_split() && !b.mapped {
                self.release_expandable_segment(id);
            }
        }
    }

    /// `garbage_collect_cached_blocks`: above threshold × allowed, free unsplit non-expandable large blocks
    /// at least as old as the mean age, pass after pass, until the excess is reclaimed.
    fn garbage_collect(&mut self) {
        let Some(allowed) = self.allowed_bytes else { return };
        let threshold = (self.conf.garbage_collection_threshold * allowed as f64) as u64;
        let reserved = self.stats.reserved_bytes;
        if reserved <= threshold {
            return;
        }
        let target = reserved - threshold;
        let gc_calls = self.pools[1].gc_calls;
        let age = |b: &Block| (gc_calls - b.gc_base) as i32 as i64 as u64;
        let mut total_age = 0u64;
        let mut count = 0i64;
        for &id in self.pools[1].free.values() {
            let b = self.arena.get(id);
            if !b.is_split() {
                total_age += age(b);
                count += 1;
            }
        }
        if count == 0 {
            return;
        }
        let mut reclaimed = 0u64;
        let mut freed_any = true;
        while reclaimed < target && freed_any && count > 0 {
            let threshold_age = total_age as f64 / count as f64;
            freed_any = false;
            let ids: Vec<u32> = self.pools[1].free.values().copied().collect();
            for id in ids {
                let b = self.arena.get(id);
                if !b.is_split() && b.expandable == NONE && age(b) as f64 >= threshold_age {
                    freed_any = true;
                    reclaimed += b.size_bytes;
                    total_age -= age(b);
                    count -= 1;
                    self.release_block(id);
                }
            }
        }
    }

    /// Live allocated blocks, for OOM reports: (address, size, requested, allocating entry).
    pub fn live_blocks(&self) -> Vec<(u64, u64, u64, u32)> {
        let mut v: Vec<_> = self
            .arena
            .blocks
            .iter()
            .filter(|b| b.allocated)
            .map(|b| (b.addr, b.size_bytes, b.requested_bytes, b.alloc_entry))
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}
