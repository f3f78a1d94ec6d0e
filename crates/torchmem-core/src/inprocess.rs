//! What the Python API reads and computes inside the user's own process (this process's memory from /proc
//! is `sources::self_proc`): NVML's view of this process on one device, the allocator-counter
//! record the in-process sampler sends to the recorder, and the Monitor's summaries (epoch line, tables,
//! journey) computed from its markers.

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;
use serde::{Deserialize, Serialize};

use crate::analysis::{EpochRow, MarkerAggregates, Summary};
use crate::error::{CoreError, Result};
use crate::journey;
use crate::model::Marker;
use crate::report::table;
use crate::units::{format_delta, format_opt_bytes};
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

/// NVML opened once for the in-process API: one device's memory and this process's share of it.
pub struct ProcessGpu {
    nvml: Nvml,
}

/// NVML's view of one device and of one process on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessGpuReading {
    pub index: u32,
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// What NVML charges to the process (CUDA context, libraries and torch's reserved memory); None when
    /// NVML does not list the pid (no context yet, or a container whose pids NVML does not see).
    pub process_bytes: Option<u64>,
    /// Every other process NVML lists on the device, summed.
    pub other_processes_bytes: u64,
}

impl ProcessGpu {
    pub fn open() -> Result<Self> {
        let nvml = Nvml::init()
            .map_err(|e| CoreError::Nvml(format!("{e} (no NVIDIA driver / libnvidia-ml.so.1 on this machine?)")))?;
        Ok(ProcessGpu { nvml })
    }

    pub fn device_count(&self) -> Result<u32> {
        self.nvml.device_count().map_err(|e| CoreError::Nvml(e.to_string()))
    }

    /// The NVML index of the device with this UUID ("GPU-…" or "MIG-…").
    pub fn index_of_uuid(&self, uuid: &str) -> Option<u32> {
        self.nvml.device_by_uuid(uuid).ok()?.index().ok()
    }

    pub fn read(&self, index: u32, pid: u32) -> Result<ProcessGpuReading> {
        let nv = |e: nvml_wrapper::error::NvmlError| CoreError::Nvml(e.to_string());
        let d = self.nvml.device_by_index(index).map_err(nv)?;
        let mem = d.memory_info().map_err(nv)?;
        let mut mine: Option<u64> = None;
        let mut others: std::collections::BTreeMap<u32, u64> = Default::default();
        for list in [d.running_compute_processes(), d.running_graphics_processes()].into_iter().flatten() {
            for p in list {
                let UsedGpuMemory::Used(bytes) = p.used_gpu_memory else {
                    continue;
                };
                if p.pid == pid {
                    mine = Some(mine.unwrap_or(0).max(bytes));
                } else {
                    let e = others.entry(p.pid).or_insert(0);
                    *e = (*e).max(bytes);
                }
            }
        }
        Ok(ProcessGpuReading {
            index,
            total_bytes: mem.total,
            used_bytes: mem.used,
            free_bytes: mem.free,
            process_bytes: mine,
            other_processes_bytes: others.values().sum(),
        })
    }
}

/// Parses markers in their `model::Marker` serde form (a JSON list).
pub fn parse_markers(markers_json: &str) -> Result<Vec<Marker>> {
    Ok(serde_json::from_str(markers_json)?)
}

/// The Monitor's summary (epochs, phases, growth, journey) as JSON, from its markers alone.
pub fn summary_json(markers: &[Marker], capacity_bytes: Option<u64>, agg: Option<&MarkerAggregates>) -> Result<String> {
    Ok(serde_json::to_string(&monitor_summary(markers, capacity_bytes, agg))?)
}

fn monitor_summary(markers: &[Marker], capacity_bytes: Option<u64>, agg: Option<&MarkerAggregates>) -> Summary {
    match agg {
        Some(a) => Summary::from_markers_aggregated(markers, capacity_bytes, a),
        None => Summary::from_markers(markers, capacity_bytes),
    }
}

/// The Monitor's aggregates (`MarkerAggregates`) from JSON.
pub fn parse_aggregates(json: &str) -> Result<MarkerAggregates> {
    serde_json::from_str(json).map_err(|e| CoreError::Invalid(format!("bad Monitor aggregates JSON: {e}")))
}

/// The Monitor's `summary()` text: the per-epoch table, the per-phase table, growth warnings.
pub fn summary_text(markers: &[Marker], capacity_bytes: Option<u64>, agg: Option<&MarkerAggregates>) -> String {
    let s = monitor_summary(markers, capacity_bytes, agg);
    let mut out = String::new();
    if !s.epochs.is_empty() {
        out.push_str(&table::render_epochs(&s.epochs));
    }
    if s.steps > 0 {
        out.push_str(&format!("{} step{}\n", s.steps, if s.steps == 1 { "" } else { "s" }));
    }
    if !s.phases.is_empty() {
        out.push_str(&table::render_phases(&s.phases));
    }
    out.push_str(&table::render_growth(&s.growth));
    if out.is_empty() {
        out.push_str("no epochs, steps or phases recorded yet\n");
    }
    out
}

/// The journey as text or as a Mermaid `journey` diagram.
pub fn journey_render(
    markers: &[Marker],
    capacity_bytes: Option<u64>,
    agg: Option<&MarkerAggregates>,
    mermaid: bool,
    title: &str,
) -> String {
    let stages = monitor_summary(markers, capacity_bytes, agg).journey;
    if mermaid {
        journey::render_mermaid(&stages, title)
    } else {
        journey::render_text(&stages)
    }
}

/// What the Monitor prints and warns about when an epoch ends.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochReport {
    /// One line: `epoch 3: allocated 1.2 GiB, reserved 2.0 GiB, peak 1.8 GiB, CPU RSS 900.1 MiB, growth +0 B`.
    pub line: String,
    pub row: Option<EpochRow>,
    /// Growth warnings over all epochs so far (empty when memory does not grow every epoch).
    pub growth: Vec<String>,
    pub growth_per_epoch_bytes: Option<i64>,
}

/// The line and warnings for the last finished epoch, from the epoch markers (start/end pairs) so far.
pub fn epoch_report(epoch_markers: &[Marker]) -> EpochReport {
    let s = Summary::from_markers(epoch_markers, None);
    let row = s.epochs.iter().rev().find(|r| r.duration_ns.is_some()).cloned();
    let line = match &row {
        None => "epoch: no finished epoch".to_string(),
        Some(r) => epoch_line(r),
    };
    EpochReport {
        line,
        row,
        growth_per_epoch_bytes: s.growth.first().map(|g| g.per_unit_bytes),
        growth: s.growth.into_iter().map(|g| g.message).collect(),
    }
}

pub fn epoch_line(r: &EpochRow) -> String {
    let mut parts = Vec::new();
    if r.allocated_bytes.is_some() || r.reserved_bytes.is_some() {
        parts.push(format!("allocated {}", format_opt_bytes(r.allocated_bytes)));
        parts.push(format!("reserved {}", format_opt_bytes(r.reserved_bytes)));
        parts.push(format!("peak {}", format_opt_bytes(r.peak_allocated_bytes)));
    }
    parts.push(format!("CPU RSS {}", format_opt_bytes(r.rss_bytes)));
    parts.push(format!("peak RSS {}", format_opt_bytes(r.peak_rss_bytes)));
    let growth = match (r.growth_allocated_bytes, r.growth_rss_bytes) {
        (Some(g), Some(c)) => format!("growth {} (RSS {})", format_delta(g), format_delta(c)),
        (None, Some(c)) => format!("growth RSS {}", format_delta(c)),
        (Some(g), None) => format!("growth {}", format_delta(g)),
        (None, None) => "growth -".to_string(),
    };
    parts.push(growth);
    let secs = r.duration_ns.map(|ns| format!(" ({:.2} s)", ns as f64 / 1e9)).unwrap_or_default();
    format!("epoch {}{}: {}", r.index, secs, parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Edge, MarkerKind, MarkerMemory};

    const MIB: u64 = 1 << 20;

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

    fn epoch(t: u64, edge: Edge, idx: i64, rss: u64) -> Marker {
        Marker {
            t_ns: t,
            kind: MarkerKind::Epoch,
            edge,
            name: "epoch".into(),
            index: Some(idx),
            memory: MarkerMemory {
                rss_bytes: Some(rss),
                peak_rss_bytes: (edge == Edge::End).then_some(rss + MIB),
                ..Default::default()
            },
            origin: Default::default(),
            device: None,
        }
    }

    #[test]
    fn epoch_report_says_the_growth_per_epoch() {
        let mut m = Vec::new();
        for e in 0..4 {
            m.push(epoch(e as u64 * 10, Edge::Start, e, 100 * MIB + e as u64 * 8 * MIB));
            m.push(epoch(e as u64 * 10 + 5, Edge::End, e, 100 * MIB + (e as u64 + 1) * 8 * MIB));
        }
        let r = epoch_report(&m);
        assert!(r.line.starts_with("epoch 3"), "{}", r.line);
        assert!(r.line.contains("CPU RSS 132.0 MiB") && r.line.contains("growth RSS +8.0 MiB"), "{}", r.line);
        assert_eq!(r.growth_per_epoch_bytes, Some(8 * MIB as i64));
        assert!(r.growth[0].contains("+8.0 MiB per epoch"), "{:?}", r.growth);
        // Flat memory: no warning.
        let flat: Vec<Marker> = (0..4)
            .flat_map(|e| {
                [epoch(e as u64 * 10, Edge::Start, e, 100 * MIB), epoch(e as u64 * 10 + 5, Edge::End, e, 100 * MIB)]
            })
            .collect();
        assert!(epoch_report(&flat).growth.is_empty());
    }

    #[test]
    fn markers_round_trip_from_python_json() {
        let json = r#"[{"t_ns":1,"kind":"mark","edge":"point","name":"Device checked","index":null,"memory":{"rss_bytes":10}},
                       {"t_ns":2,"kind":"phase","edge":"start","name":"forward","index":null,"memory":{"rss_bytes":10}},
                       {"t_ns":3,"kind":"phase","edge":"end","name":"forward","index":null,"memory":{"rss_bytes":20,"peak_rss_bytes":30}}]"#;
        let m = parse_markers(json).unwrap();
        assert_eq!(m.len(), 3);
        let text = journey_render(&m, Some(1000), None, false, "run");
        assert!(text.contains("Device checked") && text.contains("forward"), "{text}");
        let mermaid = journey_render(&m, Some(1000), None, true, "run");
        assert!(mermaid.starts_with("journey\n"));
        assert!(summary_json(&m, None, None).unwrap().contains("\"phases\""));
        assert!(parse_markers("[{}]").is_err());
    }

    #[test]
    fn nvml_absent_is_an_error_not_a_zero() {
        match ProcessGpu::open() {
            Ok(g) => {
                let n = g.device_count().unwrap();
                if n > 0 {
                    let r = g.read(0, std::process::id()).unwrap();
                    assert!(r.total_bytes > 0);
                }
            }
            Err(e) => assert!(e.to_string().contains("NVML unavailable")),
        }
    }
}

/// One NVIDIA device as `torchmem.device_info()` reports it (NVML index order).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceEntry {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// NVML's used memory of this process on the device; None when NVML does not list it.
    pub this_process_bytes: Option<u64>,
    /// Memory used by every other process NVML lists on the device.
    pub other_processes_bytes: u64,
    pub processes: std::collections::BTreeMap<u32, u64>,
}

/// The host and its NVIDIA devices, without torch and without creating a CUDA context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    pub host_total_bytes: Option<u64>,
    pub host_available_bytes: Option<u64>,
    /// Why there are no devices (no driver, NVML failed); None when NVML answered.
    pub nvml_error: Option<String>,
    pub driver_version: Option<String>,
    pub cuda_driver_version: Option<String>,
    pub devices: Vec<DeviceEntry>,
}

pub fn device_info(pid: u32) -> DeviceInfo {
    use crate::sources::gpu::{GpuSource, NvmlSource};
    let host = crate::sources::host::host_memory();
    let mut info = DeviceInfo {
        host_total_bytes: host.map(|h| h.total_bytes),
        host_available_bytes: host.map(|h| h.available_bytes),
        nvml_error: None,
        driver_version: None,
        cuda_driver_version: None,
        devices: Vec::new(),
    };
    match NvmlSource::open() {
        Err(e) => info.nvml_error = Some(e.to_string()),
        Ok(src) => {
            let driver = src.driver_info();
            info.driver_version = Some(driver.driver_version);
            info.cuda_driver_version = Some(driver.cuda_driver_version);
            let readings = src.read();
            for dev in src.devices() {
                let Some(r) = readings.iter().find(|r| r.index == dev.index) else {
                    continue;
                };
                info.devices.push(DeviceEntry {
                    index: dev.index,
                    name: dev.name.clone(),
                    uuid: dev.uuid.clone(),
                    total_bytes: r.total_bytes,
                    used_bytes: r.used_bytes,
                    free_bytes: r.free_bytes,
                    this_process_bytes: r.process_bytes.get(&pid).copied(),
                    other_processes_bytes: r.process_bytes.iter().filter(|(p, _)| **p != pid).map(|(_, b)| b).sum(),
                    processes: r.process_bytes.clone(),
                });
            }
        }
    }
    info
}

#[cfg(test)]
mod device_info_tests {
    #[test]
    fn host_is_always_there_and_gpus_only_with_nvml() {
        let info = super::device_info(std::process::id());
        assert!(info.host_total_bytes.unwrap() >= info.host_available_bytes.unwrap());
        assert_eq!(info.nvml_error.is_some(), info.driver_version.is_none());
        if info.nvml_error.is_some() {
            assert!(info.devices.is_empty());
        }
    }
}
