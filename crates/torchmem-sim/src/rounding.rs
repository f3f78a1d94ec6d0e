//! Sizes: the allocator's constants, request rounding (`round_size`, with `roundup_power2_divisions`), the
//! pool a rounded size goes to, and the size of a new segment (`get_allocation_size`).

use crate::config::{AllocConf, ROUNDUP_INTERVALS};

pub const KB_BYTES: u64 = 1024;
pub const MB_BYTES: u64 = 1024 * 1024;
/// Every request is rounded to a multiple of this.
pub const MIN_BLOCK_BYTES: u64 = 512;
/// Rounded requests up to this go to the small pool.
pub const SMALL_SIZE_BYTES: u64 = MB_BYTES;
/// Small-pool segment size (and the small pool's page under expandable segments).
pub const SMALL_BUFFER_BYTES: u64 = 2 * MB_BYTES;
/// Requests below this (and above 1 MiB) get a `large_segment_size` segment.
pub const MIN_LARGE_ALLOC_BYTES: u64 = 10 * MB_BYTES;
/// Larger requests get a segment rounded up to this.
pub const ROUND_LARGE_BYTES: u64 = 2 * MB_BYTES;

/// Divisions configured for a size's power-of-two interval (index `floor(log2 size) - 20`, clamped to [0, 15]).
pub fn divisions_for(conf: &AllocConf, size_bytes: u64) -> u64 {
    let log = 63 - size_bytes.max(1).leading_zeros() as i64;
    let idx = (log - 20).clamp(0, ROUNDUP_INTERVALS as i64 - 1) as usize;
    conf.roundup_power2_divisions[idx]
}

/// Rounds up to the next of `divisions` equal steps between two powers of two; a power of two stays.
pub fn roundup_power2_next_division(size_bytes: u64, divisions: u64) -> u64 {
    if size_bytes.is_power_of_two() {
        return size_bytes;
    }
    let floor = 1u64 << (63 - size_bytes.leading_zeros());
    let step = floor >> (63 - divisions.leading_zeros());
    if step == 0 {
        return floor << 1;
    }
    let down = size_bytes & !(step - 1);
    if down == size_bytes {
        size_bytes
    } else {
        down + step
    }
}

/// `round_size`: the block size a request asks the pools for.
pub fn round_size(conf: &AllocConf, size_bytes: u64) -> u64 {
    if size_bytes < MIN_BLOCK_BYTES {
        return MIN_BLOCK_BYTES;
    }
    let d = divisions_for(conf, size_bytes);
    if d > 1 && size_bytes > MIN_BLOCK_BYTES * d {
        roundup_power2_next_division(size_bytes, d)
    } else {
        size_bytes.div_ceil(MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES
    }
}

/// True when a rounded size is served by the small pool.
pub fn is_small(rounded_bytes: u64) -> bool {
    rounded_bytes <= SMALL_SIZE_BYTES
}

/// `get_allocation_size`: how large a new segment for a rounded request is.
pub fn allocation_size(conf: &AllocConf, rounded_bytes: u64) -> u64 {
    if rounded_bytes <= SMALL_SIZE_BYTES {
        SMALL_BUFFER_BYTES
    } else if rounded_bytes < MIN_LARGE_ALLOC_BYTES {
        conf.large_segment_size_bytes
    } else {
        rounded_bytes.div_ceil(ROUND_LARGE_BYTES) * ROUND_LARGE_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_rounding() {
        let c = AllocConf::default();
        assert_eq!(round_size(&c, 0), 512);
        assert_eq!(round_size(&c, 1), 512);
        assert_eq!(round_size(&c, 512), 512);
        assert_eq!(round_size(&c, 513), 1024);
        assert_eq!(round_size(&c, 18816), 18944);
    }

    #[test]
    fn power2_divisions() {
        // torch's own example: 1200 with 4 divisions -> 1280 (but only above 512 * divisions).
        assert_eq!(roundup_power2_next_division(1200, 4), 1280);
        assert_eq!(roundup_power2_next_division(1024, 4), 1024);
        let c = AllocConf::parse("roundup_power2_divisions:4").unwrap();
        assert_eq!(round_size(&c, 1200), 1536, "1200 <= 512*4: plain rounding");
        assert_eq!(round_size(&c, 5 * MB_BYTES + 1), 6 * MB_BYTES);
        assert_eq!(round_size(&c, 9 * MB_BYTES), 10 * MB_BYTES);
        assert_eq!(round_size(&c, 8 * MB_BYTES), 8 * MB_BYTES);
        // Intervals: 300 MiB is in [256, 512) (index 8) -> 1 division -> plain.
        let c = AllocConf::parse("roundup_power2_divisions:[256:1,512:2,>:8]").unwrap();
        assert_eq!(round_size(&c, 300 * MB_BYTES + 1), 300 * MB_BYTES + 512);
        assert_eq!(round_size(&c, 600 * MB_BYTES), 768 * MB_BYTES);
        assert_eq!(round_size(&c, 1100 * MB_BYTES), 1152 * MB_BYTES);
    }

    #[test]
    fn step_zero_goes_to_next_power() {
        assert_eq!(roundup_power2_next_division(3, 8), 4);
    }

    #[test]
    fn pools_and_segment_sizes() {
        let c = AllocConf::default();
        assert!(is_small(MB_BYTES));
        assert!(!is_small(MB_BYTES + 512));
        assert_eq!(allocation_size(&c, 512), 2 * MB_BYTES);
        assert_eq!(allocation_size(&c, MB_BYTES + 512), 20 * MB_BYTES);
        assert_eq!(allocation_size(&c, 10 * MB_BYTES - 512), 20 * MB_BYTES);
        assert_eq!(allocation_size(&c, 10 * MB_BYTES), 10 * MB_BYTES, "the 10 MiB bound is exclusive");
        assert_eq!(allocation_size(&c, 11 * MB_BYTES + 512), 12 * MB_BYTES);
    }
}
