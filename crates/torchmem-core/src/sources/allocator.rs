//! PyTorch's caching-allocator counters as the in-process sampler reads them (`torch._C._cuda_memoryStats`),
//! and the `wire::ChildMessage::Torch` line it sends the recorder: a source of GPU numbers that lives in the
//! profiled process (the bindings in `crates/torchmem-py/src/api.rs` fill it from torch's dict).

use serde::{Deserialize, Serialize};

use crate::model::{Origin, TorchSample};
use crate::wire::ChildMessage;

/// PyTorch's caching-allocator counters for one device, as read from `torch._C._cuda_memoryStats(dev)`.
/// Its serde form is the wire's (`wire::ChildMessage::Torch` flattens it): the allocator's names without
/// `_bytes` (`allocated`, `reserved`, `peak_allocated`, `peak_reserved`, `active`, `inactive_split`); the
/// retry and OOM counts are not sent (the Python API reads them, the recorder does not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorCounters {
    #[serde(rename = "allocated")]
    pub allocated_bytes: u64,
    #[serde(rename = "reserved")]
    pub reserved_bytes: u64,
    #[serde(rename = "peak_allocated")]
    pub peak_allocated_bytes: u64,
    #[serde(rename = "peak_reserved")]
    pub peak_reserved_bytes: u64,
    #[serde(default, rename = "active")]
    pub active_bytes: u64,
    #[serde(default, rename = "inactive_split")]
    pub inactive_split_bytes: u64,
    #[serde(skip)]
    pub num_alloc_retries: u64,
    #[serde(skip)]
    pub num_ooms: u64,
}

impl AllocatorCounters {
    /// True when the device's allocator never held memory (a device this process does not use).
    pub fn never_used(&self) -> bool {
        self.peak_reserved_bytes == 0 && self.reserved_bytes == 0
    }

    /// The wire line (`{"type":"torch",...}` and a newline) for the recorder, in `wire::ChildMessage` form.
    pub fn wire_line(&self, t_ns: u64, device: u32) -> String {
        let msg = ChildMessage::Torch { t_ns, device, counters: *self };
        let mut line = serde_json::to_string(&msg).expect("a wire message always serialises");
        line.push('\n');
        line
    }

    /// The record the recorder stores of these counters: `t_ns` relative to the run's start, `device` the
    /// NVML index, `origin` the process that sent them.
    pub fn torch_sample(&self, t_ns: u64, device: u32, origin: Origin) -> TorchSample {
        TorchSample {
            t_ns,
            device,
            allocated_bytes: self.allocated_bytes,
            reserved_bytes: self.reserved_bytes,
            peak_allocated_bytes: self.peak_allocated_bytes,
            peak_reserved_bytes: self.peak_reserved_bytes,
            active_bytes: self.active_bytes,
            inactive_split_bytes: self.inactive_split_bytes,
            origin,
        }
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
        assert_eq!(
            line,
            concat!(
                r#"{"type":"torch","t_ns":77,"device":1,"allocated":1,"reserved":2,"peak_allocated":3,"#,
                r#""peak_reserved":4,"active":5,"inactive_split":6}"#,
                "\n"
            ),
            "the wire names stay the allocator's, without _bytes"
        );
        let ChildMessage::Torch { t_ns, device, counters } = ChildMessage::parse_line(line.trim_end()).unwrap() else {
            panic!("{line}")
        };
        assert_eq!((t_ns, device, counters), (77, 1, c));
        assert!(!c.never_used());
        assert!(AllocatorCounters::default().never_used());
    }

    #[test]
    fn the_recorder_stores_each_counter_under_its_own_name() {
        let c = AllocatorCounters {
            allocated_bytes: 10,
            reserved_bytes: 20,
            peak_allocated_bytes: 30,
            peak_reserved_bytes: 40,
            active_bytes: 50,
            inactive_split_bytes: 60,
            num_alloc_retries: 7,
            num_ooms: 8,
        };
        let origin = Origin { pid: Some(12), ..Default::default() };
        let s = c.torch_sample(5, 3, origin);
        assert_eq!((s.t_ns, s.device, s.origin), (5, 3, origin));
        let got = [s.allocated_bytes, s.reserved_bytes, s.peak_allocated_bytes, s.peak_reserved_bytes];
        assert_eq!(got, [10, 20, 30, 40]);
        assert_eq!((s.active_bytes, s.inactive_split_bytes), (50, 60));
    }
}
