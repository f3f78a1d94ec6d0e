//! The device under the allocator: how much physical memory `cudaMalloc` / `cuMemCreate` can still get
//! (`--device-memory`), and which virtual address a new segment or expandable reservation gets. Addresses
//! come from the recording while the replay follows it (so best-fit ties break as they did on the GPU);
//! otherwise from a synthetic model: the driver hands out descending addresses, as the recordings show
//! for large allocations. Only ties between equal-size free blocks depend on addresses.

/// Where the synthetic address model starts (below it, descending; far from real 0x7f.. addresses).
const SYNTHETIC_TOP: u64 = 0x4000_0000_0000_0000;
/// Alignment of synthetic reservations.
const SYNTHETIC_ALIGN: u64 = 2 << 20;

#[derive(Debug, Clone)]
pub struct Device {
    /// Bytes the allocator can hold at once (None: unlimited).
    pub capacity_bytes: Option<u64>,
    /// Physical bytes held (segments plus mapped pages).
    pub used_bytes: u64,
    /// `totalGlobalMem`: sizes the address space of an expandable segment (9/8 of it).
    pub total_global_bytes: u64,
    next_synthetic: u64,
}

impl Device {
    pub fn new(capacity_bytes: Option<u64>, total_global_bytes: u64) -> Device {
        Device { capacity_bytes, used_bytes: 0, total_global_bytes, next_synthetic: SYNTHETIC_TOP }
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

    /// A virtual address range of `bytes`: the recorded one when given, else the next synthetic one.
    pub fn address(&mut self, bytes: u64, recorded: Option<u64>) -> u64 {
        if let Some(a) = recorded {
            return a;
        }
        let span = bytes.div_ceil(SYNTHETIC_ALIGN) * SYNTHETIC_ALIGN;
        self.next_synthetic -= span;
        self.next_synthetic
    }
}
