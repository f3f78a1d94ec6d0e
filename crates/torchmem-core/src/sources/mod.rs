//! Where memory numbers come from: the kernel's /proc files (CPU: `procfs` for any process, `self_proc` for
//! this one, kept open), `host` (the machine's RAM), NVML (`gpu`: GPU) and `device_info` (the machine in one value); `allocator` holds PyTorch's
//! allocator counters as the in-process sampler reads them.

pub mod allocator;
pub mod device_info;
pub mod gpu;
pub mod host;
pub mod procfs;
pub mod self_proc;
