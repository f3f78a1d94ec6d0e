//! Messages from the profiled Python processes to the recorder (`torchmem run`), one JSON object per line.
//! Each process connects by itself to the Unix socket named by `TORCHMEM_EVENT_SOCKET` (so processes started
//! by multiprocessing's `spawn`, which inherit the environment but not the descriptors, reach it too) and
//! opens its connection with a `Hello` saying who it is; the recorder stamps that identity on everything
//! the connection carries. (`TORCHMEM_EVENT_FD`, an inherited pipe, carries the same lines without identity,
//! for tests.) Times are absolute CLOCK_MONOTONIC nanoseconds (`time.monotonic_ns()`); the recorder makes
//! them relative to the run's start.

use serde::{Deserialize, Serialize};

use crate::model::{Edge, MarkerKind, MarkerMemory, Origin};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ChildMessage {
    /// The first line of a connection: the process behind it.
    Hello {
        #[serde(flatten)]
        origin: Origin,
    },
    /// The allocator's counters for one CUDA device.
    Torch {
        t_ns: u64,
        /// The device's NVML index (see `model::TorchSample::device`).
        device: u32,
        allocated: u64,
        reserved: u64,
        peak_allocated: u64,
        peak_reserved: u64,
        #[serde(default)]
        active: u64,
        #[serde(default)]
        inactive_split: u64,
    },
    Marker {
        t_ns: u64,
        kind: MarkerKind,
        edge: Edge,
        name: String,
        #[serde(default)]
        index: Option<i64>,
        #[serde(default)]
        memory: MarkerMemory,
        /// The GPU the marker read, by NVML index; absent for CPU only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        device: Option<u32>,
    },
    /// The line profiler's result table (schema owned by the line profiler), stored as JSON.
    LineProfile { t_ns: u64, data: serde_json::Value },
    /// Free-form JSON stored under a name (e.g. "journey", "torch_info").
    Blob { t_ns: u64, name: String, data: serde_json::Value },
}

impl ChildMessage {
    pub fn parse_line(line: &str) -> crate::Result<Self> {
        Ok(serde_json::from_str(line)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_python_side_format() {
        let m = ChildMessage::parse_line(
            r#"{"type":"torch","t_ns":5,"device":0,"allocated":1,"reserved":2,"peak_allocated":3,"peak_reserved":4}"#,
        )
        .unwrap();
        assert!(matches!(m, ChildMessage::Torch { reserved: 2, .. }));
        let m = ChildMessage::parse_line(
            r#"{"type":"marker","t_ns":9,"kind":"phase","edge":"end","name":"forward","memory":{"allocated_bytes":7}}"#,
        )
        .unwrap();
        match m {
            ChildMessage::Marker { kind, edge, memory, .. } => {
                assert_eq!(kind, MarkerKind::Phase);
                assert_eq!(edge, Edge::End);
                assert_eq!(memory.allocated_bytes, Some(7));
            }
            other => panic!("{other:?}"),
        }
        assert!(ChildMessage::parse_line(r#"{"type":"nope"}"#).is_err());
        let m = ChildMessage::parse_line(r#"{"type":"hello","pid":12,"rank":1,"world_size":2}"#).unwrap();
        let want = Origin { pid: Some(12), rank: Some(1), local_rank: None, world_size: Some(2) };
        assert_eq!(m, ChildMessage::Hello { origin: want });
        assert_eq!(ChildMessage::parse_line(&serde_json::to_string(&m).unwrap()).unwrap(), m);
    }
}
