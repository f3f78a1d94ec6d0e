//! The device under the allocator: how much physical memory `cudaMalloc` / `cuMemCreate` can still get
//! (`--device-memory`), and which virtual address a new segment or expandable reservation gets. Addresses
//! come from the recording while the replay follows it (so best-fit ties break as they did on the GPU);
//! otherwise from a synthetic model: the driver hands out descending addresses, as the recordings show
//! for large allocations, or (`driver_model`, for the estimator's address-less traces) ranges filled upward
//! first-fit, new ranges below. Only ties between equal-size free blocks depend on addresses.

/// Where the synthetic address model starts (below it, descending; far from real 0x7f.. addresses).
const SYNTHETIC_TOP: u64 = 0x4000_0000_0000_0000;
/// Alignment of synthetic reservations.
const SYNTHETIC_ALIGN: u64 = 2 << 20;
/// The driver model's first address range (the recordings fill about 512 MiB upward first).
const SYNTHETIC_FIRST_RANGE: u64 = 512 << 20;
/// Later ranges: the allocation rounded up to this.
const SYNTHETIC_RANGE_ALIGN: u64 = 32 << 20;

use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone)]
pub struct Device {
    /// Bytes the allocator can hold at once (None: unlimited).
    pub capacity_bytes: Option<u64>,
    /// Physical bytes held (segments plus mapped pages).
    pub used_bytes: u64,
    /// `totalGlobalMem`: sizes the address space of an expandable segment (9/8 of it).
    pub total_global_bytes: u64,
    next_synthetic: u64,
    /// The recording's segment addresses by size, in recorded order: a what-if's new segment of a size the
    /// recording also had takes the first of those addresses that is free (the driver placed that size
    /// there once), before any synthetic address.
    pub recorded_by_size: HashMap<u64, Vec<u64>>,
    /// Address ranges in use: start -> end.
    live: BTreeMap<u64, u64>,
    /// The driver model's reserved ranges: start -> end.
    reserved: BTreeMap<u64, u64>,
    /// New addresses from the driver model (`driver_address`) instead of plain descending ones. The estimator
    /// uses it (its traces come from a training program: the recordings of those follow it, MLP and ResNet-18
    /// exact); a what-if of a recorded snapshot keeps the descending model (it matched the GPU's replays of
    /// recorded traces more often: 111 against 106 of 132 rows of `tests/truth.rs`).
    pub driver_model: bool,
}

impl Device {
    pub fn new(capacity_bytes: Option<u64>, total_global_bytes: u64) -> Device {
        Device {
            capacity_bytes,
            used_bytes: 0,
            total_global_bytes,
            next_synthetic: SYNTHETIC_TOP,
            recorded_by_size: HashMap::new(),
            live: BTreeMap::new(),
            reserved: BTreeMap::new(),
            driver_model: false,
        }
    }

    /// Physical memory for a segment or pages; false when the device is full (`cudaErrorMemoryAllocation`).
    pub fn take(&mut self, bytes: u64) -> bool {
        if let Some(cap) = self.capacity_bytes {
            if self.used_bytes + bytes > cap {
                return false;
            }
        }
        self.used_bytes += bytes;
        true
    }

    pub fn give_back(&mut self, bytes: u64) {
        self.used_bytes -= bytes;
    }

    fn is_free(&self, addr: u64, bytes: u64) -> bool {
        let end = addr + bytes;
        match self.live.range(..end).next_back() {
            Some((_, &e)) => e <= addr,
            None => true,
        }
    }

    /// A virtual address range of `bytes`: the recorded one when given, else a recorded address of that size
    /// that is free, else the next synthetic one.
    pub fn address(&mut self, bytes: u64, recorded: Option<u64>) -> u64 {
        let addr = match recorded {
            Some(a) => a,
            None => {
                let reuse =
                    self.recorded_by_size.get(&bytes).and_then(|v| v.iter().copied().find(|&a| self.is_free(a, bytes)));
                match reuse {
                    Some(a) => a,
                    None if self.driver_model => self.driver_address(bytes),
                    None => loop {
                        let span = bytes.div_ceil(SYNTHETIC_ALIGN) * SYNTHETIC_ALIGN;
                        self.next_synthetic -= span;
                        if self.is_free(self.next_synthetic, bytes) {
                            break self.next_synthetic;
                        }
                    },
                }
            }
        };
        self.live.insert(addr, addr + bytes);
        addr
    }

    /// The driver model of `cudaMalloc`'s virtual addresses, as the H200's recordings of training programs show
    /// them (`driver_model`): the first allocations fill an initial range upward; a new allocation takes the
    /// lowest free gap of the ranges reserved so far where it fits (first fit); when none does, a new range of
    /// its size rounded up to 32 MiB is reserved below all earlier ones.
    fn driver_address(&mut self, bytes: u64) -> u64 {
        let span = bytes.div_ceil(SYNTHETIC_ALIGN) * SYNTHETIC_ALIGN;
        if self.reserved.is_empty() {
            self.reserved.insert(SYNTHETIC_TOP - SYNTHETIC_FIRST_RANGE, SYNTHETIC_TOP);
            self.next_synthetic = SYNTHETIC_TOP - SYNTHETIC_FIRST_RANGE;
        }
        for (&start, &end) in &self.reserved {
            let mut at = start;
            for (&ls, &le) in self.live.range(start..end) {
                if ls >= at + span {
                    break;
                }
                at = at.max(le.div_ceil(SYNTHETIC_ALIGN) * SYNTHETIC_ALIGN);
            }
            if at + span <= end {
                return at;
            }
        }
        let range = span.div_ceil(SYNTHETIC_RANGE_ALIGN) * SYNTHETIC_RANGE_ALIGN;
        self.next_synthetic -= range;
        self.reserved.insert(self.next_synthetic, self.next_synthetic + range);
        self.next_synthetic
    }

    /// The range at `addr` is given back (cudaFree, or an expandable segment released).
    pub fn release_address(&mut self, addr: u64) {
        self.live.remove(&addr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn descending_model_hands_out_lower_addresses() {
        let mut d = Device::new(None, 1 << 40);
        let a = d.address(20 * MIB, None);
        let b = d.address(20 * MIB, None);
        assert!(b < a);
    }

    #[test]
    fn driver_model_fills_upward_then_below_first_fit() {
        let mut d = Device::new(None, 1 << 40);
        d.driver_model = true;
        // The first range fills upward.
        let a = d.address(100 * MIB, None);
        let b = d.address(200 * MIB, None);
        assert_eq!(b, a + 100 * MIB);
        // 300 MiB no longer fits in the 512 MiB range: a new 320 MiB range below it.
        let c = d.address(300 * MIB, None);
        assert_eq!(c, a - 320 * MIB);
        // 20 MiB fits the gap left at the top of c's range (the lowest gap that fits), before the first range's.
        let e = d.address(20 * MIB, None);
        assert_eq!(e, c + 300 * MIB);
        // A freed range is reused first-fit.
        d.release_address(a);
        assert_eq!(d.address(50 * MIB, None), a);
    }
}
