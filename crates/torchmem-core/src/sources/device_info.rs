//! The machine's memory in one value, built once for `torchmem info` and `torchmem.device_info()`: host RAM
//! and every NVIDIA device (NVML index order) with what each process uses on it, the driver and the CUDA
//! version it supports, or why there is no device. Needs neither torch nor a CUDA context.

use std::collections::BTreeMap;

use serde::Serialize;

use super::gpu::{GpuSource, NvmlSource};
use super::host::host_memory;

/// One NVIDIA device as NVML reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceEntry {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub free_bytes: u64,
    /// NVML's used memory of the asking process on the device; None when NVML does not list it.
    pub this_process_bytes: Option<u64>,
    /// Memory used by every other process NVML lists on the device.
    pub other_processes_bytes: u64,
    /// pid → used bytes for every process NVML lists (CUDA context included).
    pub processes: BTreeMap<u32, u64>,
}

/// The host and its NVIDIA devices (`torchmem.device_info()`'s JSON is this value's serde form).
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

/// Reads the machine now; `pid` is the process whose share `this_process_bytes` is.
pub fn device_info(pid: u32) -> DeviceInfo {
    let host = host_memory();
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
                    this_process_bytes: r.this_process_bytes(pid),
                    other_processes_bytes: r.other_processes_bytes(pid),
                    processes: r.process_bytes.clone(),
                });
            }
        }
    }
    info
}

impl DeviceInfo {
    /// One short line for why there is no GPU list (None when there is one). The raw libloading text
    /// ("a libloading error occurred: libnvidia-ml.so.1: cannot open shared object file …") only means there
    /// is no driver.
    pub fn gpu_unavailable(&self) -> Option<String> {
        match &self.nvml_error {
            Some(err) => Some(nvml_unavailable(err)),
            None if self.devices.is_empty() => Some("NVML found no GPU".into()),
            None => None,
        }
    }
}

fn nvml_unavailable(err: &str) -> String {
    if err.contains("libloading") || err.contains("cannot open shared object") || err.contains("LibloadingError") {
        "NVML not available (libnvidia-ml.so.1 not found): no NVIDIA driver on this machine".into()
    } else if err.contains("DriverNotLoaded") || err.contains("driver is not loaded") {
        "NVML not available: the NVIDIA driver is not loaded (no GPU, or the kernel module is missing)".into()
    } else {
        format!("NVML not available: {err}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_is_always_there_and_gpus_only_with_nvml() {
        let info = device_info(std::process::id());
        assert!(info.host_total_bytes.unwrap() >= info.host_available_bytes.unwrap());
        assert_eq!(info.nvml_error.is_some(), info.driver_version.is_none());
        if info.nvml_error.is_some() {
            assert!(info.devices.is_empty());
            assert!(info.gpu_unavailable().unwrap().starts_with("NVML not available"));
        }
        for d in &info.devices {
            assert!(d.total_bytes >= d.free_bytes && !d.name.is_empty());
        }
    }

    #[test]
    fn nvml_errors_are_one_short_line() {
        let raw = "NVML error: a libloading error occurred: libnvidia-ml.so.1: cannot open shared object file: No such file or directory (no NVIDIA driver / libnvidia-ml.so.1 on this machine?)";
        assert_eq!(
            nvml_unavailable(raw),
            "NVML not available (libnvidia-ml.so.1 not found): no NVIDIA driver on this machine"
        );
        assert!(nvml_unavailable("NVML error: Unknown").starts_with("NVML not available: "));
        let none = DeviceInfo {
            host_total_bytes: None,
            host_available_bytes: None,
            nvml_error: None,
            driver_version: Some("1".into()),
            cuda_driver_version: Some("13.0".into()),
            devices: Vec::new(),
        };
        assert_eq!(none.gpu_unavailable().as_deref(), Some("NVML found no GPU"));
    }
}
