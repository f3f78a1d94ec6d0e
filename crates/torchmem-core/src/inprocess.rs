//! What the Python API reads and computes inside the user's own process: this process's memory from /proc
//! (RSS, peak RSS and its reset, USS/PSS), NVML's view of this process on one device, the allocator-counter
//! record the in-process sampler sends to the recorder, and the Monitor's summaries (epoch line, tables,
//! journey) computed from its markers.

use std::fs;
use std::io::Write;

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

/// RSS and its high-water mark, both from one read of `/proc/self/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SelfMemory {
    pub rss_bytes: u64,
    /// `VmHWM`: the highest RSS since the process started or since the last [`reset_peak_rss`].
    pub peak_rss_bytes: u64,
}

/// This process's /proc files, opened once and re-read with `pread` (about half the cost of open+read+close).
/// A fork gives the child the parent's descriptors, which still point at the parent: they are reopened when
/// the pid changes.
struct SelfFiles {
    pid: u32,
    statm: fs::File,
    status: fs::File,
    clear_refs: Option<fs::File>,
}

static SELF_FILES: std::sync::Mutex<Option<SelfFiles>> = std::sync::Mutex::new(None);

fn with_self_files<T>(f: impl FnOnce(&SelfFiles) -> Option<T>) -> Option<T> {
    let mut guard = SELF_FILES.lock().unwrap_or_else(|p| p.into_inner());
    let pid = std::process::id();
    if guard.as_ref().is_none_or(|files| files.pid != pid) {
        *guard = Some(SelfFiles {
            pid,
            statm: fs::File::open("/proc/self/statm").ok()?,
            status: fs::File::open("/proc/self/status").ok()?,
            clear_refs: fs::OpenOptions::new().write(true).open("/proc/self/clear_refs").ok(),
        });
    }
    f(guard.as_ref()?)
}

fn pread_text(file: &fs::File, buf: &mut [u8]) -> Option<usize> {
    use std::os::unix::fs::FileExt;
    let n = file.read_at(buf, 0).ok()?;
    (n > 0).then_some(n)
}

///
/// Fast path (~1.5 µs instead of ~5–12 µs for `/proc/self/status`): RSS from statm and the high-water mark
/// from `getrusage`, whose `ru_maxrss` is `max(high-water mark, maxrss inherited across exec)`. The first
/// call learns an upper bound of the inherited part (see [`exec_maxrss_bound`]); a `ru_maxrss` above that
/// bound can only be the high-water mark itself. Otherwise (or without /proc) it reads status.
pub fn self_memory() -> Option<SelfMemory> {
    let bound = exec_maxrss_bound();
    if let (Some(max_rss), Some(rss)) = (rusage_maxrss_bytes(), self_rss_bytes()) {
        if max_rss > bound {
            return Some(SelfMemory { rss_bytes: rss, peak_rss_bytes: max_rss.max(rss) });
        }
    }
    self_memory_from_status()
}

/// RSS and VmHWM from one read of `/proc/self/status` (the reference the fast path is checked against).
pub fn self_memory_from_status() -> Option<SelfMemory> {
    let mut buf = [0u8; 4096];
    let n = with_self_files(|f| pread_text(&f.status, &mut buf))?;
    parse_self_status(std::str::from_utf8(&buf[..n]).ok()?)
}

/// `getrusage(RUSAGE_SELF).ru_maxrss` in bytes.
fn rusage_maxrss_bytes() -> Option<u64> {
    // SAFETY: getrusage fills the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    (unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } == 0).then(|| ru.ru_maxrss.max(0) as u64 * 1024)
}

/// An upper bound (bytes) of the maxrss the kernel carried over from the image before `exec`, which
/// `ru_maxrss` folds in: with `ru` and VmHWM read together, `ru > VmHWM` means the inherited value is `ru`;
/// `ru == VmHWM` means it is at most VmHWM. A fork child inherits nothing (0), so the bound stays valid.
/// `u64::MAX` (fast path off) where status or getrusage cannot be read.
pub fn exec_maxrss_bound() -> u64 {
    static BOUND: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *BOUND.get_or_init(|| match (self_memory_from_status(), rusage_maxrss_bytes()) {
        (Some(m), Some(ru)) => ru.max(m.peak_rss_bytes),
        _ => u64::MAX,
    })
}

pub fn parse_self_status(text: &str) -> Option<SelfMemory> {
    Some(SelfMemory {
        rss_bytes: crate::sources::procfs::status_field_bytes(text, "VmRSS")?,
        peak_rss_bytes: crate::sources::procfs::status_field_bytes(text, "VmHWM")?,
    })
}

/// This process's RSS from `/proc/self/statm` (the cheapest read the kernel offers).
pub fn self_rss_bytes() -> Option<u64> {
    let mut buf = [0u8; 256];
    let n = with_self_files(|f| pread_text(&f.statm, &mut buf))?;
    let text = std::str::from_utf8(&buf[..n]).ok()?;
    crate::sources::procfs::parse_statm_rss_pages(text).map(|p| p * crate::sources::procfs::page_size())
}

/// Resets `VmHWM` to the current RSS (writes "5" to `/proc/self/clear_refs`), so that the next peak read
/// is the peak since now. Fails where the kernel or a sandbox forbids it; callers then keep the old peak.
pub fn reset_peak_rss() -> Result<()> {
    let written = with_self_files(|f| {
        let mut file = f.clear_refs.as_ref()?;
        Some(file.write_all(b"5").is_ok())
    });
    match written {
        Some(true) => Ok(()),
        _ => Err(CoreError::Invalid("cannot write /proc/self/clear_refs: the peak RSS cannot be reset here".into())),
    }
}

/// Returns freed heap memory at the top and in the middle of glibc's arenas to the kernel (the CPU side of
/// "empty the cache"). True when some memory was released.
pub fn malloc_trim() -> bool {
    // SAFETY: malloc_trim has no preconditions; it only walks glibc's own arenas under their locks.
    unsafe { libc::malloc_trim(0) != 0 }
}

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
    /// The peak-RSS tests reset this process's high-water mark: one at a time.
    static PEAK_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn reads_this_process_and_resets_its_peak() {
        let _one = PEAK_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let m = self_memory().unwrap();
        assert!(m.rss_bytes > MIB && m.peak_rss_bytes >= m.rss_bytes);
        let statm = self_rss_bytes().unwrap();
        assert!(statm > MIB);
        // Touch 64 MiB, free it, reset: the peak falls back to about the current RSS.
        let big = vec![1u8; 64 * MIB as usize];
        assert!(big.iter().map(|b| *b as u64).sum::<u64>() == 64 * MIB);
        let with_big = self_memory().unwrap();
        drop(big);
        if reset_peak_rss().is_ok() {
            let after = self_memory().unwrap();
            assert!(after.peak_rss_bytes + 32 * MIB < with_big.peak_rss_bytes, "{after:?} vs {with_big:?}");
        }
    }

    #[test]
    fn fast_peak_rss_agrees_with_status() {
        let _one = PEAK_TESTS.lock().unwrap_or_else(|p| p.into_inner());
        let _ = exec_maxrss_bound();
        let big = vec![3u8; 48 * MIB as usize];
        assert!(big.iter().map(|b| *b as u64).sum::<u64>() == 3 * 48 * MIB);
        drop(big);
        // RSS moves between two reads (other tests run in parallel threads): compare each read with the
        // status read taken just after it, which can only be equal or later.
        for _ in 0..3 {
            let fast = self_memory().unwrap();
            let status = self_memory_from_status().unwrap();
            assert!(fast.peak_rss_bytes <= status.peak_rss_bytes, "{fast:?} vs {status:?}");
            assert!(fast.peak_rss_bytes + 8 * MIB >= status.peak_rss_bytes, "{fast:?} vs {status:?}");
            if reset_peak_rss().is_err() {
                break;
            }
        }
    }

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
