//! Messages from the profiled Python processes to the recorder (`torchmem run`), one JSON object per line.
//! Each process connects by itself to the Unix socket named by `TORCHMEM_EVENT_SOCKET` (so processes started
//! by multiprocessing's `spawn`, which inherit the environment but not the descriptors, reach it too) and
//! opens its connection with a `Hello` saying who it is; the recorder stamps that identity on everything
//! the connection carries. (`TORCHMEM_EVENT_FD`, an inherited pipe, carries the same lines without identity,
//! for tests.) Times are absolute CLOCK_MONOTONIC nanoseconds (`time.monotonic_ns()`); the recorder makes
//! them relative to the run's start.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::lines::LineProfile;
use crate::model::{DeviceBreakdown, Edge, Launch, MarkerKind, MarkerMemory, Origin};
use crate::sources::allocator::AllocatorCounters;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ChildMessage {
    /// The first line of a connection: the process behind it (and its node and attempt, when launched so).
    Hello {
        #[serde(flatten)]
        origin: Origin,
        #[serde(flatten)]
        launch: Launch,
    },
    /// The allocator's counters for one CUDA device (flattened: `allocated`, `reserved`, `peak_allocated`,
    /// `peak_reserved`, and `active`, `inactive_split` which may be absent; see `AllocatorCounters`).
    Torch {
        t_ns: u64,
        /// The device's NVML index (see `model::TorchSample::device`).
        device: u32,
        #[serde(flatten)]
        counters: AllocatorCounters,
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
        /// What the memory is at this boundary, per device (`breakdown::DeviceBreakdown`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        breakdown: Option<Vec<DeviceBreakdown>>,
        /// Bytes each module's forward left saved for backward (end-of-forward markers, opt-in).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        activations_by_module: Option<BTreeMap<String, u64>>,
    },
    /// The line profiler's tables (`lines::LineProfile`, schema in docs/line-profiler.md).
    LineProfile { t_ns: u64, data: LineProfile },
    /// A side record under its name: `oom` (`torchmem.on_oom`) and `leaks` (the leak probe) today. The
    /// recorder reads it as its kind (`record::Blob::from_parts`); a name it does not know is kept as it is.
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
        let ChildMessage::Torch { t_ns: 5, device: 0, counters } = m else { panic!("{m:?}") };
        let want = AllocatorCounters {
            allocated_bytes: 1,
            reserved_bytes: 2,
            peak_allocated_bytes: 3,
            peak_reserved_bytes: 4,
            ..Default::default()
        };
        assert_eq!(counters, want, "active and inactive_split may be absent (older senders): 0");
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
        // A boundary marker with the Monitor's breakdown (the interface record) and activations by module.
        let m = ChildMessage::parse_line(
            r#"{"type":"marker","t_ns":9,"kind":"phase","edge":"end","name":"forward","memory":{},
                "breakdown":[{"device":"cpu","parameters_bytes":4096,"gradients_bytes":0,"optimizer_state_bytes":0,
                  "activations_bytes":512,"inputs_bytes":64,"other_bytes":null,"allocated_bytes":null,
                  "reserved_bytes":null,"cache_bytes":null,"non_torch_bytes":null,"rss_bytes":1000000,
                  "by_module":{"parameters":{"0":4096},"gradients":{}},"by_param_group":[]}],
                "activations_by_module":{"0":512}}"#,
        )
        .unwrap();
        match &m {
            ChildMessage::Marker { breakdown: Some(b), activations_by_module: Some(a), .. } => {
                assert_eq!((b[0].parameters_bytes, b[0].rss_bytes, a["0"]), (Some(4096), Some(1_000_000), 512));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ChildMessage::parse_line(&serde_json::to_string(&m).unwrap()).unwrap(), m);
        let bad = ChildMessage::parse_line(
            r#"{"type":"marker","t_ns":9,"kind":"step","edge":"start","name":"step","breakdown":[{"parameters_bytes":-1}]}"#,
        );
        assert!(bad.is_err(), "a breakdown entry without its device, or with negative bytes, is refused");
        let m = ChildMessage::parse_line(r#"{"type":"hello","pid":12,"rank":1,"world_size":2}"#).unwrap();
        let want = Origin { pid: Some(12), rank: Some(1), local_rank: None, world_size: Some(2) };
        assert_eq!(m, ChildMessage::Hello { origin: want, launch: Launch::default() });
        assert_eq!(ChildMessage::parse_line(&serde_json::to_string(&m).unwrap()).unwrap(), m);
        // A torchrun worker's hello also says its node and attempt (a restarted job's second try).
        let m =
            ChildMessage::parse_line(r#"{"type":"hello","pid":12,"rank":1,"group_rank":0,"restart_count":1}"#).unwrap();
        let ChildMessage::Hello { launch, .. } = m else { panic!("{m:?}") };
        assert_eq!(launch, Launch { group_rank: Some(0), restart_count: Some(1) });
        let line = serde_json::to_string(&ChildMessage::Hello { origin: want, launch }).unwrap();
        assert!(line.contains(r#""restart_count":1"#) && line.contains(r#""group_rank":0"#), "{line}");
    }

    #[test]
    fn launch_variables_torchrun_first_then_slurm() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |n: &str| pairs.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string())
        };
        let torchrun = vars(&[("GROUP_RANK", "2"), ("SLURM_NODEID", "5"), ("TORCHELASTIC_RESTART_COUNT", "1")]);
        assert_eq!(Launch::from_vars(&torchrun), Launch { group_rank: Some(2), restart_count: Some(1) });
        let slurm = vars(&[("SLURM_NODEID", "5"), ("SLURM_RESTART_COUNT", " 3 "), ("SLURM_PROCID", "9")]);
        let place = crate::model::JobPlace::from_vars(&slurm).unwrap();
        assert_eq!(
            (place.origin.rank, place.launch.group_rank, place.launch.restart_count),
            (Some(9), Some(5), Some(3))
        );
        assert_eq!(crate::model::JobPlace::from_vars(&vars(&[("RANK", "x")])), None, "not a number: not set");
    }
}
