//! Peaks of the whole run: CPU (RSS, PSS, USS of the tree) and, per GPU, the allocator's and NVML's highest
//! values. A marker's peaks count for the GPU it read (its `device`) only.

use serde::Serialize;

use crate::model::*;

/// The highest value a series reached and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PeakAt {
    pub bytes: u64,
    pub t_ns: u64,
}

pub(crate) fn max_by<T>(items: &[T], f: impl Fn(&T) -> Option<u64>, t: impl Fn(&T) -> u64) -> Option<PeakAt> {
    let mut best: Option<PeakAt> = None;
    for it in items {
        if let Some(b) = f(it) {
            if best.is_none_or(|p| b > p.bytes) {
                best = Some(PeakAt { bytes: b, t_ns: t(it) });
            }
        }
    }
    best
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuPeak {
    pub device: u32,
    pub name: Option<String>,
    pub total_bytes: Option<u64>,
    /// PyTorch allocator, exact (from its own peak counters when recorded).
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    /// NVML: memory of the profiled processes on this device (CUDA context included).
    pub nvml_process_bytes: Option<u64>,
    /// NVML: device-wide used memory, every process.
    pub nvml_used_bytes: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Peaks {
    pub cpu_rss_bytes: Option<u64>,
    pub cpu_rss_t_ns: Option<u64>,
    pub cpu_pss_bytes: Option<u64>,
    pub cpu_uss_bytes: Option<u64>,
    pub gpus: Vec<GpuPeak>,
}

/// The GPUs with samples, by NVML index (the in-process sampler reports the allocator's numbers under the
/// NVML index of the device, matched by UUID, so CUDA_VISIBLE_DEVICES renumbering does not split a GPU).
pub fn devices(torch: &[TorchSample], gpu: &[GpuSample]) -> Vec<u32> {
    let mut devices: Vec<u32> = torch.iter().map(|s| s.device).chain(gpu.iter().map(|s| s.device)).collect();
    devices.sort_unstable();
    devices.dedup();
    devices
}

/// Peaks per GPU. A marker or folded row counts for the GPU it read; one without a device (a v1 profile)
/// counts only when the run had a single GPU, where it cannot belong to another.
pub fn gpu_peaks(
    meta: &RunMeta,
    torch: &[TorchSample],
    gpu: &[GpuSample],
    markers: &[Marker],
    aggregates: &[SpanAggregate],
) -> Vec<GpuPeak> {
    let devices = devices(torch, gpu);
    let single = devices.len() == 1;
    let counts_for = |device: Option<u32>, d: u32| device == Some(d) || (device.is_none() && single);
    devices
        .iter()
        .map(|&d| {
            let t: Vec<&TorchSample> = torch.iter().filter(|s| s.device == d).collect();
            let g: Vec<&GpuSample> = gpu.iter().filter(|s| s.device == d).collect();
            let mine = || markers.iter().filter(|m| counts_for(m.device, d));
            let rows = || aggregates.iter().filter(|a| counts_for(a.device, d));
            let marker_alloc = opt_max(
                mine().filter_map(|m| m.memory.peak_allocated_bytes).max(),
                rows().filter_map(|a| a.totals.peak_allocated_bytes).max(),
            );
            let marker_reserved = opt_max(
                mine().filter_map(|m| m.memory.peak_reserved_bytes).max(),
                rows().filter_map(|a| a.totals.peak_reserved_bytes).max(),
            );
            let torch_alloc = t.iter().map(|s| s.peak_allocated_bytes.max(s.allocated_bytes)).max();
            let torch_reserved = t.iter().map(|s| s.peak_reserved_bytes.max(s.reserved_bytes)).max();
            GpuPeak {
                device: d,
                name: meta.gpu_names.get(d as usize).cloned(),
                total_bytes: meta.gpu_total_bytes.get(d as usize).copied().or_else(|| g.first().map(|s| s.total_bytes)),
                allocated_bytes: if t.is_empty() { None } else { opt_max(torch_alloc, marker_alloc) },
                reserved_bytes: if t.is_empty() { None } else { opt_max(torch_reserved, marker_reserved) },
                nvml_process_bytes: g.iter().filter_map(|s| s.process_bytes).max(),
                nvml_used_bytes: g.iter().map(|s| s.used_bytes).max(),
            }
        })
        .collect()
}
