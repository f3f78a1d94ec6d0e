//! Where memory numbers come from: the kernel's /proc files (CPU) and NVML (GPU).

pub mod gpu;
pub mod host;
pub mod procfs;
