//! GPU memory from NVML (loaded at run time with dlopen, so torchmem builds and runs without a GPU):
//! device-wide total/used/free and the memory each process uses, CUDA context included.
//!
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

pub struct NvmlSource {
    nvml: Nvml,
    devices: Vec<GpuDevice>,
}

impl NvmlSource {
    /// Loads libnvidia-ml and lists the devices. Fails with a clear reason on machines without NVIDIA's driver.
    pub fn open() -> Result<Self> {
        let nvml = Nvml::init()
            .map_err(|e| CoreError::Nvml(format!("{e} (no NVIDIA driver / libnvidia-ml.so.1 on this machine?)")))?;
        let count = nvml.device_count().map_err(|e| CoreError::Nvml(e.to_string()))?;
        let mut devices = Vec::new();
        for index in 0..count {
            let d = nvml.device_by_index(index).map_err(|e| CoreError::Nvml(e.to_string()))?;
            let mem = d.memory_info().map_err(|e| CoreError::Nvml(e.to_string()))?;
            devices.push(GpuDevice {
                index,
                name: d.name().unwrap_or_else(|_| "unknown".into()),
                uuid: d.uuid().unwrap_or_default(),
                total_bytes: mem.total,
            });
        }
        Ok(NvmlSource { nvml, devices })
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

impl GpuSource for NvmlSource {
    fn devices(&self) -> &[GpuDevice] {
        &self.devices
    }

    fn read(&self) -> Vec<GpuReading> {
        let mut out = Vec::with_capacity(self.devices.len());
        for dev in &self.devices {
            let Ok(d) = self.nvml.device_by_index(dev.index) else { continue };
            let Ok(mem) = d.memory_info() else { continue };
            let mut process_bytes = BTreeMap::new();
            let lists = [d.running_compute_processes(), d.running_graphics_processes()];
            for list in lists.into_iter().flatten() {
                for p in list {
                    if let UsedGpuMemory::Used(bytes) = p.used_gpu_memory {
                        let e = process_bytes.entry(p.pid).or_insert(0u64);
                        *e = (*e).max(bytes);
                    }
                }
            }
            out.push(GpuReading {
                index: dev.index,
                total_bytes: mem.total,
                used_bytes: mem.used,
                free_bytes: mem.free,
                process_bytes,
            });
        }
        out
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

    #[test]
    fn tree_bytes_sums_only_the_tree() {
        let reading = GpuReading {
            index: 0,
            total_bytes: 100,
            used_bytes: 50,
            free_bytes: 50,
            process_bytes: BTreeMap::from([(1, 10), (2, 20), (3, 5)]),
        };
        assert_eq!(tree_bytes(&reading, [1, 3]), Some(15));
        assert_eq!(tree_bytes(&reading, [9]), None);
    }

    #[test]
    fn nvml_absent_is_a_clear_error_not_a_zero() {
        // On a machine without the NVIDIA driver this must fail with a message; with one, it lists devices.
        match NvmlSource::open() {
            Ok(src) => assert!(src.devices().iter().all(|d| d.total_bytes > 0)),
            Err(e) => assert!(e.to_string().contains("NVML unavailable"), "{e}"),
        }
    }
}
