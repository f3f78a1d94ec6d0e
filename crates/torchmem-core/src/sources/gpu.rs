//! GPU memory from NVML (loaded at run time with dlopen, so torchmem builds and runs without a GPU):
//! device-wide total/used/free and the memory each process uses, CUDA context included.
//!
//! `NvmlLib` is the one wrapper over NVML: every reader goes through it (the recorder, the in-process API,
//! `torchmem info`, `device_info()`), so the process walk, the error texts and the index mapping exist once.
//! `GpuSource` is the seam the recorder samples through; `NvmlSource` is the real one. Unit tests of pure
//! logic use a fake, named as such, in the tests that need it.

use std::collections::BTreeMap;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::Nvml;

use crate::error::{CoreError, Result};

/// One device's identity and size.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GpuDevice {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub total_bytes: u64,
}

/// One reading of one device.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GpuReading {
    pub index: u32,
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// pid → used bytes for every process NVML lists on this device (compute and graphics).
    pub process_bytes: BTreeMap<u32, u64>,
}

pub trait GpuSource: Send {
    fn devices(&self) -> &[GpuDevice];
    fn read(&self) -> Vec<GpuReading>;
}

/// Driver-level facts for `torchmem info`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DriverInfo {
    pub driver_version: String,
    /// The CUDA version the driver supports, e.g. "13.0".
    pub cuda_driver_version: String,
}

impl GpuReading {
    /// What NVML charges to `pid` on this device; None when NVML does not list it (no context yet, or a
    /// container whose pids NVML does not see).
    pub fn this_process_bytes(&self, pid: u32) -> Option<u64> {
        self.process_bytes.get(&pid).copied()
    }

    /// Every other process NVML lists on this device, summed.
    pub fn other_processes_bytes(&self, pid: u32) -> u64 {
        self.process_bytes.iter().filter(|(p, _)| **p != pid).map(|(_, b)| b).sum()
    }
}

fn nvml_err(e: nvml_wrapper::error::NvmlError) -> CoreError {
    CoreError::Nvml(e.to_string())
}

/// NVML, loaded once.
pub struct NvmlLib {
    nvml: Nvml,
}

impl NvmlLib {
    /// Loads libnvidia-ml. Fails with a clear reason on machines without NVIDIA's driver.
    pub fn open() -> Result<Self> {
        let nvml = Nvml::init()
            .map_err(|e| CoreError::Nvml(format!("{e} (no NVIDIA driver / libnvidia-ml.so.1 on this machine?)")))?;
        Ok(NvmlLib { nvml })
    }

    pub fn device_count(&self) -> Result<u32> {
        self.nvml.device_count().map_err(nvml_err)
    }

    /// Device `index`'s identity and size.
    pub fn device(&self, index: u32) -> Result<GpuDevice> {
        let d = self.nvml.device_by_index(index).map_err(nvml_err)?;
        let mem = d.memory_info().map_err(nvml_err)?;
        Ok(GpuDevice {
            index,
            name: d.name().unwrap_or_else(|_| "unknown".into()),
            uuid: d.uuid().unwrap_or_default(),
            total_bytes: mem.total,
        })
    }

    /// One reading of device `index`: its memory and every process NVML lists on it (compute and
    /// graphics; a pid in both lists counts once, at its larger figure).
    pub fn read(&self, index: u32) -> Result<GpuReading> {
        let d = self.nvml.device_by_index(index).map_err(nvml_err)?;
        let mem = d.memory_info().map_err(nvml_err)?;
        let mut process_bytes = BTreeMap::new();
        for list in [d.running_compute_processes(), d.running_graphics_processes()].into_iter().flatten() {
            for p in list {
                if let UsedGpuMemory::Used(bytes) = p.used_gpu_memory {
                    let e = process_bytes.entry(p.pid).or_insert(0u64);
                    *e = (*e).max(bytes);
                }
            }
        }
        Ok(GpuReading { index, total_bytes: mem.total, used_bytes: mem.used, free_bytes: mem.free, process_bytes })
    }

    /// The NVML index of the device with this UUID, as NVML writes it ("GPU-…"/"MIG-…") or as torch does
    /// (without the prefix); None when NVML does not know it.
    pub fn index_of_uuid(&self, uuid: &str) -> Option<u32> {
        let lookup = |u: &str| self.nvml.device_by_uuid(u).ok()?.index().ok();
        if uuid.starts_with("GPU-") || uuid.starts_with("MIG-") {
            return lookup(uuid);
        }
        ["GPU-", "MIG-", ""].iter().find_map(|prefix| lookup(&format!("{prefix}{uuid}")))
    }

    pub fn driver_info(&self) -> DriverInfo {
        let cuda = self
            .nvml
            .sys_cuda_driver_version()
            .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10))
            .unwrap_or_else(|_| "unknown".into());
        DriverInfo {
            driver_version: self.nvml.sys_driver_version().unwrap_or_else(|_| "unknown".into()),
            cuda_driver_version: cuda,
        }
    }
}

/// The NVML index of torch's CUDA device `torch_index` (they differ when CUDA_VISIBLE_DEVICES renumbers the
/// devices: torch's cuda:0 can be NVML's GPU 3). The one rule, for `torchmem.stats()`, the markers and the
/// allocator sampler: by torch's UUID of the device when NVML knows it; else by the `torch_index`-th entry
/// of CUDA_VISIBLE_DEVICES (`visible`: an NVML index, or a UUID NVML knows); with no CUDA_VISIBLE_DEVICES
/// set, torch's own index. None when CUDA_VISIBLE_DEVICES names the device in a way NVML cannot map.
/// `index_of_uuid` is [`NvmlLib::index_of_uuid`] (a parameter, so the rule is tested without a GPU).
pub fn nvml_index_of_torch_device(
    index_of_uuid: impl Fn(&str) -> Option<u32>,
    torch_index: u32,
    torch_uuid: Option<&str>,
    visible: Option<&str>,
) -> Option<u32> {
    if let Some(index) = torch_uuid.and_then(&index_of_uuid) {
        return Some(index);
    }
    let visible = visible.unwrap_or("");
    if visible.is_empty() {
        return Some(torch_index);
    }
    let entry = visible.split(',').map(str::trim).filter(|p| !p.is_empty()).nth(torch_index as usize)?;
    if entry.bytes().all(|b| b.is_ascii_digit()) {
        return entry.parse().ok();
    }
    index_of_uuid(entry)
}

/// NVML and its device list: the recorder's GPU source.
pub struct NvmlSource {
    lib: NvmlLib,
    devices: Vec<GpuDevice>,
}

impl NvmlSource {
    /// Loads libnvidia-ml and lists the devices. Fails with a clear reason on machines without NVIDIA's driver.
    pub fn open() -> Result<Self> {
        let lib = NvmlLib::open()?;
        let devices = (0..lib.device_count()?).map(|index| lib.device(index)).collect::<Result<Vec<_>>>()?;
        Ok(NvmlSource { lib, devices })
    }

    pub fn driver_info(&self) -> DriverInfo {
        self.lib.driver_info()
    }
}

impl GpuSource for NvmlSource {
    fn devices(&self) -> &[GpuDevice] {
        &self.devices
    }

    fn read(&self) -> Vec<GpuReading> {
        self.devices.iter().filter_map(|dev| self.lib.read(dev.index).ok()).collect()
    }
}

/// Sums the bytes NVML attributes to any pid of `pids` on one device; None when none of them is listed.
pub fn tree_bytes(reading: &GpuReading, pids: impl IntoIterator<Item = u32>) -> Option<u64> {
    let mut total = None;
    for pid in pids {
        if let Some(b) = reading.process_bytes.get(&pid) {
            *total.get_or_insert(0) += b;
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One device's reading with three processes (pids 1, 2, 3 using 10, 20 and 5 bytes).
    fn three_processes() -> GpuReading {
        GpuReading {
            index: 0,
            total_bytes: 100,
            used_bytes: 50,
            free_bytes: 50,
            process_bytes: BTreeMap::from([(1, 10), (2, 20), (3, 5)]),
        }
    }

    #[test]
    fn tree_bytes_sums_only_the_tree() {
        let reading = three_processes();
        assert_eq!(tree_bytes(&reading, [1, 3]), Some(15));
        assert_eq!(tree_bytes(&reading, [9]), None);
    }

    #[test]
    fn a_reading_splits_this_process_from_the_others() {
        let reading = three_processes();
        assert_eq!((reading.this_process_bytes(2), reading.other_processes_bytes(2)), (Some(20), 15));
        assert_eq!((reading.this_process_bytes(9), reading.other_processes_bytes(9)), (None, 35));
    }

    #[test]
    fn torch_devices_map_by_uuid_then_cuda_visible_devices() {
        // A fake NVML UUID table (NVML's two devices, "GPU-aaa" = 3 and "GPU-bbb" = 1), for the pure rule.
        let fake_nvml = |u: &str| match u {
            "GPU-aaa" | "aaa" => Some(3),
            "GPU-bbb" => Some(1),
            _ => None,
        };
        assert_eq!(nvml_index_of_torch_device(fake_nvml, 0, Some("aaa"), Some("1,3")), Some(3));
        assert_eq!(nvml_index_of_torch_device(fake_nvml, 1, Some("zzz"), None), Some(1));
        assert_eq!(nvml_index_of_torch_device(fake_nvml, 1, None, Some("")), Some(1));
        assert_eq!(nvml_index_of_torch_device(fake_nvml, 0, Some("zzz"), Some(" 3, 1")), Some(3));
        assert_eq!(nvml_index_of_torch_device(fake_nvml, 1, None, Some("3,,GPU-bbb")), Some(1));
        assert_eq!(nvml_index_of_torch_device(fake_nvml, 2, None, Some("3,1")), None);
        assert_eq!(nvml_index_of_torch_device(fake_nvml, 0, None, Some("GPU-nonexistent")), None);
        assert_eq!(nvml_index_of_torch_device(fake_nvml, 0, None, Some("-1")), None);
    }

    #[test]
    fn nvml_absent_is_a_clear_error_not_a_zero() {
        match NvmlLib::open() {
            Ok(lib) => {
                if lib.device_count().unwrap() > 0 {
                    let r = lib.read(0).unwrap();
                    assert!(r.total_bytes > 0 && r.total_bytes >= r.free_bytes);
                }
            }
            Err(e) => assert!(e.to_string().contains("NVML unavailable"), "{e}"),
        }
        // On a machine without the NVIDIA driver this must fail with a message; with one, it lists devices.
        match NvmlSource::open() {
            Ok(src) => assert!(src.devices().iter().all(|d| d.total_bytes > 0)),
            Err(e) => assert!(e.to_string().contains("NVML unavailable"), "{e}"),
        }
    }
}
