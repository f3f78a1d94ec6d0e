//! One test per allocator decision point, on synthetic allocation sequences (not recordings): the split
//! rule, the oversize rules, garbage collection's order, the retry chain, expandable segments' pages and
//! stream-aware frees. Rounding is tested in `rounding.rs`, config parsing in `config.rs`.

use torchmem_sim::allocator::{Allocator, SegKind};
use torchmem_sim::device::Device;
use torchmem_sim::AllocConf;

const MB: u64 = 1 << 20;

fn alloc(conf: &str, allowed: Option<u64>, device_cap: Option<u64>) -> Allocator {
    Allocator::new(AllocConf::parse(conf).unwrap(), allowed, Device::new(device_cap, 80 << 30))
}

fn kinds(a: &Allocator) -> Vec<(SegKind, u64)> {
    a.events.iter().map(|e| (e.kind, e.size_bytes / MB)).collect()
}

#[test]
fn split_rule_large_pool_keeps_a_rest_up_to_1_mib() {
    let mut a = alloc("", None, None);
    a.malloc(3 * MB, 0).unwrap(); // a 20 MiB segment, split: 17 MiB rest
    assert_eq!(a.stats.allocated_bytes, 3 * MB);
    a.malloc(16 * MB + MB / 2, 0).unwrap(); // the 17 MiB rest: 0.5 MiB left is not split off
    assert_eq!(a.stats.allocated_bytes, 20 * MB, "the unsplit slack counts as allocated");
    assert_eq!(a.stats.requested_bytes, 3 * MB + 16 * MB + MB / 2);
    assert_eq!(kinds(&a), vec![(SegKind::SegmentAlloc, 20)]);
}

#[test]
fn split_rule_small_pool_splits_any_512_byte_rest() {
    let mut a = alloc("", None, None);
    a.malloc(1000, 0).unwrap();
    a.malloc(1000, 0).unwrap();
    assert_eq!(a.stats.allocated_bytes, 2048);
    assert_eq!(kinds(&a), vec![(SegKind::SegmentAlloc, 2)], "both from one 2 MiB small segment");
}

#[test]
fn oversize_blocks_serve_only_close_large_requests() {
    let mut a = alloc("max_split_size_mb:64", None, None);
    let big = a.malloc(100 * MB, 0).unwrap();
    a.free_requested(big);
    a.free_completed(big);
    a.malloc(30 * MB, 0).unwrap(); // below max_split: may not take the 100 MiB oversize block
    assert_eq!(a.stats.segments, 2);
    a.malloc(85 * MB, 0).unwrap(); // within 20 MiB: takes it whole, unsplit
    assert_eq!(a.stats.segments, 2);
    assert_eq!(a.stats.allocated_bytes, 30 * MB + 100 * MB);
    let mut b = alloc("max_split_size_mb:64", None, None);
    let big = b.malloc(100 * MB, 0).unwrap();
    b.free_requested(big);
    b.free_completed(big);
    b.malloc(70 * MB, 0).unwrap(); // 100 >= 70 + 20: refused, a new segment
    assert_eq!(b.stats.segments, 2);
}

#[test]
fn garbage_collection_frees_blocks_at_least_as_old_as_the_mean_then_retries() {
    let mut a = alloc("garbage_collection_threshold:0.5", Some(80 * MB), None);
    let blk_a = a.malloc(20 * MB, 0).unwrap(); // search 1
    let blk_b = a.malloc(24 * MB, 0).unwrap(); // search 2
    let x = a.malloc(12 * MB, 0).unwrap(); // search 3
    for id in [blk_a, x] {
        a.free_requested(id);
        a.free_completed(id); // both enter the pool at count 3
    }
    let x = a.malloc(12 * MB, 0).unwrap(); // search 4 reuses X
    a.free_requested(x);
    a.free_completed(x); // X re-enters at count 4
    let x2 = a.malloc(12 * MB, 0).unwrap(); // search 5 reuses X again
    assert_eq!(x, x2);
    a.free_requested(blk_b);
    a.free_completed(blk_b); // B enters at count 5
                             // Search 6 fails: reserved 56 MiB > 0.5 x 80 MiB; ages A = 3, B = 1, mean 2: only A goes, which covers
                             // the 16 MiB excess. The new segment still does not fit (36 + 50 > 80): release everything, retry.
    a.malloc(50 * MB, 0).unwrap();
    assert_eq!(
        kinds(&a),
        vec![
            (SegKind::SegmentAlloc, 20),
            (SegKind::SegmentAlloc, 24),
            (SegKind::SegmentAlloc, 12),
            (SegKind::SegmentFree, 20),
            (SegKind::SegmentFree, 24),
            (SegKind::SegmentAlloc, 50)
        ]
    );
    assert_eq!(a.stats.num_alloc_retries, 1);
}

#[test]
fn retry_chain_releases_the_cache_then_fails_with_an_oom() {
    let mut a = alloc("", None, Some(100 * MB));
    let x = a.malloc(60 * MB, 0).unwrap();
    a.free_requested(x);
    a.free_completed(x);
    // 60 MiB cached + 70 MiB new > 100 MiB: cudaMalloc fails, the cache is released, the retry succeeds.
    let y = a.malloc(70 * MB, 0).unwrap();
    assert_eq!(a.stats.num_alloc_retries, 1);
    assert_eq!(a.stats.reserved_bytes, 70 * MB);
    let err = a.malloc(60 * MB, 0).unwrap_err();
    assert_eq!(a.stats.num_alloc_retries, 2, "the failing allocation retried once more");
    assert_eq!(a.stats.num_ooms, 1);
    assert_eq!(err.requested_bytes, 60 * MB);
    assert!(!err.over_memory_limit, "the device was full, no fraction was set");
    a.free_requested(y);
}

#[test]
fn memory_limit_refuses_without_calling_cuda() {
    let mut a = alloc("", Some(64 * MB), None);
    a.malloc(40 * MB, 0).unwrap();
    let err = a.malloc(30 * MB, 0).unwrap_err();
    assert!(err.over_memory_limit);
    assert_eq!(a.stats.num_device_alloc, 1);
}

#[test]
fn expandable_segments_map_whole_pages_and_unmap_free_pages() {
    let mut a = alloc("expandable_segments:True", None, None);
    let x = a.malloc(30 * MB, 0).unwrap(); // two 20 MiB pages
    assert_eq!(a.stats.reserved_bytes, 40 * MB);
    assert_eq!(a.stats.allocated_bytes, 30 * MB, "the 10 MiB rest is split off (>= 512 B)");
    let y = a.malloc(5 * MB, 0).unwrap(); // from the mapped rest
    let z = a.malloc(8 * MB, 0).unwrap(); // 5 MiB free + one more page, merged
    assert_eq!(a.stats.reserved_bytes, 60 * MB);
    assert_eq!(a.stats.segments, 0, "expandable mappings are not counted as segments");
    let base = a.events[0].addr;
    assert_eq!(a.events[1].addr, base + 40 * MB, "the second mapping extends the first");
    for id in [x, y, z] {
        a.free_requested(id);
        a.free_completed(id);
    }
    a.release_cached_blocks();
    assert_eq!(a.stats.reserved_bytes, 0);
    assert_eq!(kinds(&a), vec![(SegKind::SegmentMap, 40), (SegKind::SegmentMap, 20), (SegKind::SegmentUnmap, 60)]);
    // Small pool: 2 MiB pages.
    let mut s = alloc("expandable_segments:True", None, None);
    s.malloc(4096, 0).unwrap();
    assert_eq!(kinds(&s), vec![(SegKind::SegmentMap, 2)]);
}

#[test]
fn expandable_request_beyond_the_address_space_is_an_oom_not_a_panic() {
    // A segment reserves 1 1/8 of the device's memory as address space; a bigger request (the 1 PiB
    // `torch.empty` of a real OOM on the H200) cannot fit in it even on an unlimited simulated device (the
    // what-if's memory search): it fails as an OOM, and the allocator goes on serving.
    let mut a = alloc("expandable_segments:True", None, None);
    a.malloc(30 * MB, 0).unwrap();
    assert!(a.malloc(1 << 50, 0).is_err());
    a.malloc(30 * MB, 0).unwrap();
    assert_eq!(a.stats.allocated_bytes, 60 * MB);
}

#[test]
fn unmapping_keeps_partial_pages_mapped() {
    let mut a = alloc("expandable_segments:True", None, None);
    let x = a.malloc(15 * MB, 0).unwrap(); // page 0
    let y = a.malloc(30 * MB, 0).unwrap(); // 5 MiB of page 0 + pages 1, 2 (25 MiB more)
    a.malloc(10 * MB, 0).unwrap(); // holds page 2's end
    a.free_requested(y);
    a.free_completed(y);
    a.release_cached_blocks();
    // The free block [15, 45) MiB holds one whole page, [20, 40).
    assert_eq!(a.events.last().map(|e| (e.kind, e.size_bytes / MB)), Some((SegKind::SegmentUnmap, 20)));
    assert_eq!(a.stats.reserved_bytes, 40 * MB);
    a.free_requested(x);
}

#[test]
fn frees_are_per_stream_and_wait_for_completion() {
    let mut a = alloc("", None, None);
    let x = a.malloc(12 * MB, 0).unwrap();
    a.free_requested(x);
    a.free_completed(x);
    a.malloc(12 * MB, 1).unwrap(); // another stream never reuses stream 0's block
    assert_eq!(a.stats.segments, 2);
    let y = a.malloc(14 * MB, 0).unwrap(); // the 12 MiB block is too small: new segment
    a.free_requested(y); // pending: allocated drops now, the block is not reusable yet
    assert_eq!(a.stats.allocated_bytes, 12 * MB);
    assert_eq!(a.stats.active_bytes, 26 * MB);
    a.malloc(14 * MB, 0).unwrap();
    assert_eq!(a.stats.segments, 4, "a block whose free has not completed is not reused");
    a.free_completed(y);
    a.malloc(14 * MB, 0).unwrap();
    assert_eq!(a.stats.segments, 4, "after free_completed it is");
}
