//! The GPU catalogue of `torchmem estimate`: memory sizes, compute capability and SM count of common NVIDIA
//! GPUs, and the CUDA context overhead (what NVML charges a torch process beyond torch's reserved memory)
//! where it was measured. The one table and the one alias rule (`find`): the CLI and the Python API
//! (`_native.gpu_catalogue`, `_native.find_gpu`) both look names up here.
//!
//! `nvml_total_bytes` is the total nvidia-smi shows; `cuda_total_bytes` is what CUDA reports as
//! `totalGlobalMem` (torch's `get_device_properties().total_memory`), smaller by the driver's reservation:
//! measured on the H200 (615 MiB less), taken as the same 615 MiB on the others (`cuda_total_measured`
//! says which).

use serde::Serialize;
use torchmem_units::format_bytes;

const MIB: u64 = 1 << 20;
/// NVML total − CUDA total on the H200 (CUDA 13, driver 580): 143,771 MiB vs 150,109,880,320 B.
const DRIVER_RESERVED_BYTES: u64 = 143_771 * MIB - 150_109_880_320;

/// The CUDA context and libraries of a training process, beyond torch's reserved memory, as NVML counts it
/// (`usedGpuMemory` − `reserved_bytes.all.current` at the peak step). Measured on the H200 (torch 2.11,
/// CUDA 13, driver 580, lazy module loading): 742 MiB with cuBLAS only (fp32 GEMMs), 758 MiB once half
/// precision GEMMs or cuDNN attention load their kernels, 760-762 MiB with cuDNN convolutions
/// (tests/fixtures/estimator-h200, 27 runs).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ContextOverhead {
    pub base_bytes: u64,
    pub half_precision_bytes: u64,
    pub convolution_bytes: u64,
}

pub const H200_CONTEXT: ContextOverhead =
    ContextOverhead { base_bytes: 742 * MIB, half_precision_bytes: 758 * MIB, convolution_bytes: 762 * MIB };

/// The same on the H100 80GB HBM3 (torch 2.11, CUDA 13, driver 580): 742 MiB fp32, 758 MiB half precision,
/// 760 MiB with cuDNN convolutions (tests/fixtures/corpus-h100: the 40 training scripts of the corpus; programs
/// without a backward pass load fewer kernels, 678-690 MiB, and are over-estimated by up to 80 MiB).
pub const H100_CONTEXT: ContextOverhead =
    ContextOverhead { base_bytes: 742 * MIB, half_precision_bytes: 758 * MIB, convolution_bytes: 760 * MIB };

impl ContextOverhead {
    /// The overhead for a run that uses half-precision GEMMs / cuDNN attention and/or cuDNN convolutions.
    pub fn for_run(&self, half_precision: bool, convolution: bool) -> u64 {
        if convolution {
            self.convolution_bytes
        } else if half_precision {
            self.half_precision_bytes
        } else {
            self.base_bytes
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    /// Short name used on the command line (`--gpu H100-80GB`); matched case-insensitively.
    pub key: &'static str,
    /// The device name torch reports.
    pub name: &'static str,
    pub nvml_total_bytes: u64,
    pub cuda_total_bytes: u64,
    pub cuda_total_measured: bool,
    pub major: u32,
    pub minor: u32,
    pub multi_processor_count: u32,
    /// Measured context overhead, when we have it for this GPU.
    pub context: Option<ContextOverhead>,
}

impl Gpu {
    /// The context overhead to add for NVML: measured, or the H200's (named as an assumption in reports).
    pub fn context_or_assumed(&self) -> (ContextOverhead, bool) {
        match self.context {
            Some(c) => (c, true),
            None => (H200_CONTEXT, false),
        }
    }
}

const fn gpu(key: &'static str, name: &'static str, nvml_total_mib: u64, major: u32, minor: u32, sms: u32) -> Gpu {
    Gpu {
        key,
        name,
        nvml_total_bytes: nvml_total_mib * MIB,
        cuda_total_bytes: nvml_total_mib * MIB - DRIVER_RESERVED_BYTES,
        cuda_total_measured: false,
        major,
        minor,
        multi_processor_count: sms,
        context: None,
    }
}

/// Every GPU of the catalogue (nvidia-smi totals in MiB).
pub fn catalogue() -> Vec<Gpu> {
    vec![
        Gpu {
            key: "H200",
            name: "NVIDIA H200",
            nvml_total_bytes: 143_771 * MIB,
            cuda_total_bytes: 150_109_880_320,
            cuda_total_measured: true,
            major: 9,
            minor: 0,
            multi_processor_count: 132,
            context: Some(H200_CONTEXT),
        },
        Gpu {
            cuda_total_bytes: 85_017_493_504, // torch.cuda.get_device_properties(0).total_memory (corpus-h100)
            cuda_total_measured: true,
            context: Some(H100_CONTEXT),
            ..gpu("H100-80GB", "NVIDIA H100 80GB HBM3", 81_559, 9, 0, 132)
        },
        gpu("H100-PCIE", "NVIDIA H100 PCIe", 81_559, 9, 0, 114),
        gpu("A100-80GB", "NVIDIA A100-SXM4-80GB", 81_920, 8, 0, 108),
        gpu("A100-40GB", "NVIDIA A100-SXM4-40GB", 40_960, 8, 0, 108),
        gpu("L40S", "NVIDIA L40S", 46_068, 8, 9, 142),
        gpu("L4", "NVIDIA L4", 23_034, 8, 9, 58),
        gpu("A10G", "NVIDIA A10G", 23_028, 8, 6, 80),
        gpu("A10", "NVIDIA A10", 23_028, 8, 6, 72),
        gpu("T4", "Tesla T4", 15_360, 7, 5, 40),
        gpu("V100-32GB", "Tesla V100-SXM2-32GB", 32_768, 7, 0, 80),
        gpu("V100-16GB", "Tesla V100-SXM2-16GB", 16_384, 7, 0, 80),
        gpu("RTX-4090", "NVIDIA GeForce RTX 4090", 24_564, 8, 9, 128),
        gpu("RTX-3090", "NVIDIA GeForce RTX 3090", 24_576, 8, 6, 82),
        gpu("RTX-3060", "NVIDIA GeForce RTX 3060", 12_288, 8, 6, 28),
    ]
}

/// Looks a GPU up by key (case-insensitive; `_`, spaces and `-` are the same; "H100" means the 80 GB SXM).
pub fn find(name: &str) -> Option<Gpu> {
    let norm = |s: &str| s.to_ascii_uppercase().replace(['_', ' '], "-");
    let want = match norm(name).as_str() {
        "H100" => "H100-80GB".to_string(),
        "A100" => "A100-80GB".to_string(),
        "V100" => "V100-32GB".to_string(),
        "4090" => "RTX-4090".to_string(),
        "3090" => "RTX-3090".to_string(),
        other => other.to_string(),
    };
    catalogue().into_iter().find(|g| norm(g.key) == want)
}

/// The keys, for error messages ("unknown GPU X; known: ...").
pub fn keys() -> Vec<&'static str> {
    catalogue().iter().map(|g| g.key).collect()
}

/// The catalogue as a table (`torchmem estimate --list-gpus`).
pub fn catalogue_text() -> String {
    let mut s = format!("{:<12} {:<28} {:>12} {:>12}  {:>4}  context\n", "key", "name", "nvidia-smi", "CUDA", "sm");
    for g in catalogue() {
        let ctx = match g.context {
            Some(c) => format!("{}-{} (measured)", format_bytes(c.base_bytes), format_bytes(c.convolution_bytes)),
            None => "H200's assumed".into(),
        };
        s += &format!(
            "{:<12} {:<28} {:>12} {:>12}  {:>2}.{}  {ctx}\n",
            g.key,
            g.name,
            format_bytes(g.nvml_total_bytes),
            format_bytes(g.cuda_total_bytes),
            g.major,
            g.minor
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h200_matches_the_measurement() {
        let g = find("h200").unwrap();
        assert_eq!(g.cuda_total_bytes, 150_109_880_320);
        assert_eq!(g.nvml_total_bytes - g.cuda_total_bytes, DRIVER_RESERVED_BYTES);
        assert_eq!(g.context.unwrap().for_run(false, false), 742 * MIB);
        assert_eq!(g.context.unwrap().for_run(true, true), 762 * MIB);
    }

    #[test]
    fn lookups_are_forgiving_and_unknown_names_fail() {
        assert_eq!(find("a100_40gb").unwrap().key, "A100-40GB");
        assert_eq!(find("H100").unwrap().key, "H100-80GB");
        assert_eq!(find("rtx 4090").unwrap().major, 8);
        assert!(find("TPUv5").is_none());
        assert!(keys().contains(&"L4"));
    }

    #[test]
    fn every_entry_is_consistent() {
        for g in catalogue() {
            assert!(g.cuda_total_bytes < g.nvml_total_bytes, "{}", g.key);
            assert!(g.major >= 7, "{}", g.key);
            assert_eq!(find(g.key).unwrap(), g);
        }
    }
}
