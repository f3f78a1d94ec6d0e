//! PyTorch's caching-allocator counters as the in-process sampler reads them (`torch._C._cuda_memoryStats`),
//! and the `wire::ChildMessage::Torch` line it sends the recorder: a source of GPU numbers that lives in the
//! profiled process (the bindings in `crates/torchmem-py/src/api.rs` fill it from torch's dict).

use serde::{Deserialize, Serialize};

use crate::wire::ChildMessage;

/// PyTorch's caching-allocator counters for one device, as read from `torch._C._cuda_memoryStats(dev)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorCounters {
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub active_bytes: u64,
    pub inactive_split_bytes: u64,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
}

impl AllocatorCounters {
    /// True when the device's allocator never held memory (a device this process does not use).
    pub fn never_used(&self) -> bool {
        self.peak_reserved_bytes == 0 && self.reserved_bytes == 0
    }

    /// The wire line (`{"type":"torch",...}` and a newline) for the recorder, in `wire::ChildMessage` form.
    pub fn wire_line(&self, t_ns: u64, device: u32) -> String {
        let msg = ChildMessage::Torch {
            t_ns,
            device,
            allocated: self.allocated_bytes,
            reserved: self.reserved_bytes,
            peak_allocated: self.peak_allocated_bytes,
            peak_reserved: self.peak_reserved_bytes,
            active: self.active_bytes,
            inactive_split: self.inactive_split_bytes,
        };
        let mut line = serde_json::to_string(&msg).expect("a wire message always serialises");
        line.push('\n');
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_line_is_what_the_recorder_parses() {
        let c = AllocatorCounters {
            allocated_bytes: 1,
            reserved_bytes: 2,
            peak_allocated_bytes: 3,
            peak_reserved_bytes: 4,
            active_bytes: 5,
            inactive_split_bytes: 6,
            ..Default::default()
        };
        let line = c.wire_line(77, 1);
        assert!(line.ends_with('\n'));
        match ChildMessage::parse_line(line.trim_end()).unwrap() {
            ChildMessage::Torch {
                t_ns,
                device,
                allocated,
                reserved,
                peak_allocated,
                peak_reserved,
                active,
                inactive_split,
            } => {
                assert_eq!(
                    (t_ns, device, allocated, reserved, peak_allocated, peak_reserved, active, inactive_split),
                    (77, 1, 1, 2, 3, 4, 5, 6)
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(!c.never_used());
        assert!(AllocatorCounters::default().never_used());
    }
}
