//! NVML for the Python API: the library opened once, a torch device's NVML index (its UUID, else
//! CUDA_VISIBLE_DEVICES), one device's reading with this process's bytes, and `device_info`.

use std::sync::{Mutex, OnceLock};

use pyo3::prelude::*;
use torchmem_core::sources::device_info;
use torchmem_core::sources::gpu::{nvml_index_of_torch_device, NvmlLib};

use crate::convert::to_py;
use crate::errors::{Error, Result};

static NVML: OnceLock<std::result::Result<Mutex<NvmlLib>, String>> = OnceLock::new();

/// NVML, opened once per process (core's one wrapper, `sources::gpu::NvmlLib`).
fn nvml() -> Result<&'static Mutex<NvmlLib>> {
    NVML.get_or_init(|| NvmlLib::open().map(Mutex::new).map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| Error::Tool(e.clone()))
}

/// Why NVML cannot be used here, or None when it can (opens it once per process).
#[pyfunction]
fn nvml_error(py: Python<'_>) -> Option<String> {
    py.detach(|| nvml().err().map(|e| PyErr::from(e).to_string()))
}

/// The NVML index of torch's CUDA device `torch_index` (`sources::gpu::nvml_index_of_torch_device`: by
/// torch's `uuid` of it, else by CUDA_VISIBLE_DEVICES, else torch's index); None without NVML or when
/// CUDA_VISIBLE_DEVICES names the device in a way NVML cannot map.
#[pyfunction]
#[pyo3(signature = (torch_index, uuid=None))]
fn nvml_index_of_device(py: Python<'_>, torch_index: u32, uuid: Option<String>) -> Option<u32> {
    py.detach(|| nvml_index_of_torch(torch_index, uuid.as_deref()))
}

/// The one rule, read without the interpreter (opening NVML can take milliseconds).
pub(crate) fn nvml_index_of_torch(torch_index: u32, uuid: Option<&str>) -> Option<u32> {
    let nvml = nvml().ok()?.lock().expect("NVML lock");
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    nvml_index_of_torch_device(|u| nvml.index_of_uuid(u), torch_index, uuid, visible.as_deref())
}

/// One NVML read of a device, in bytes: what `nvml_read` returns (`torchmem.stats()`'s device numbers).
#[pyclass(frozen, get_all, eq, module = "torchmem._native")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NvmlReading {
    total_bytes: u64,
    used_bytes: u64,
    free_bytes: u64,
    /// What NVML charges to the pid asked about; None when NVML lists no such process on the device.
    process_bytes: Option<u64>,
    /// What NVML charges to every other process on the device.
    other_processes_bytes: u64,
}

#[pymethods]
impl NvmlReading {
    /// A reading built by hand (tests, fakes of NVML); `nvml_read` makes the real ones.
    #[new]
    #[pyo3(signature = (*, total_bytes, used_bytes, free_bytes, process_bytes, other_processes_bytes))]
    fn new(
        total_bytes: u64,
        used_bytes: u64,
        free_bytes: u64,
        process_bytes: Option<u64>,
        other_processes_bytes: u64,
    ) -> Self {
        NvmlReading { total_bytes, used_bytes, free_bytes, process_bytes, other_processes_bytes }
    }

    fn __repr__(&self) -> String {
        let process = self.process_bytes.map_or_else(|| "None".to_owned(), |b| b.to_string());
        format!(
            "NvmlReading(total_bytes={}, used_bytes={}, free_bytes={}, process_bytes={process}, \
             other_processes_bytes={})",
            self.total_bytes, self.used_bytes, self.free_bytes, self.other_processes_bytes
        )
    }
}

/// NVML device `index` now, with what NVML charges to `pid` and to the other processes.
#[pyfunction]
fn nvml_read(py: Python<'_>, index: u32, pid: u32) -> Result<NvmlReading> {
    py.detach(|| {
        let r = nvml()?.lock().expect("NVML lock").read(index)?;
        Ok(NvmlReading {
            total_bytes: r.total_bytes,
            used_bytes: r.used_bytes,
            free_bytes: r.free_bytes,
            process_bytes: r.this_process_bytes(pid),
            other_processes_bytes: r.other_processes_bytes(pid),
        })
    })
}

/// The host and its NVIDIA devices (`sources::device_info::DeviceInfo` as a dict); never creates a CUDA context.
#[pyfunction]
#[pyo3(name = "device_info")]
fn device_info_dict(py: Python<'_>) -> Result<Bound<'_, PyAny>> {
    let pid = std::process::id();
    let info = py.detach(|| device_info::device_info(pid));
    to_py(py, &info)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NvmlReading>()?;
    m.add_function(wrap_pyfunction!(nvml_error, m)?)?;
    m.add_function(wrap_pyfunction!(nvml_index_of_device, m)?)?;
    m.add_function(wrap_pyfunction!(nvml_read, m)?)?;
    m.add_function(wrap_pyfunction!(device_info_dict, m)?)?;
    Ok(())
}
