//! `torchmem info`: the machine's memory as PyTorch users need it: each GPU's total, free and used memory and
//! who uses it (NVML), driver and CUDA versions, the torch that the current Python sees, and host RAM.

use std::process::Command;

use serde::Serialize;
use torchmem_core::sources::gpu::{GpuSource, NvmlSource};
use torchmem_core::sources::{host, procfs};
use torchmem_core::units::format_bytes;

#[derive(Debug, clap::Args)]
pub struct InfoArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct GpuProcess {
    pid: u32,
    used_bytes: u64,
    cmdline: String,
}

#[derive(Debug, Serialize)]
struct GpuInfo {
    index: u32,
    name: String,
    uuid: String,
    total_bytes: u64,
    free_bytes: u64,
    used_bytes: u64,
    processes: Vec<GpuProcess>,
}

#[derive(Debug, Serialize, Default)]
struct TorchInfo {
    python: String,
    torch_version: Option<String>,
    torch_cuda_version: Option<String>,
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct Info {
    host_total_bytes: Option<u64>,
    host_available_bytes: Option<u64>,
    /// Why there is no GPU list, when there is none.
    gpu_unavailable: Option<String>,
    driver_version: Option<String>,
    cuda_driver_version: Option<String>,
    gpus: Vec<GpuInfo>,
    torch: TorchInfo,
}

/// Asks the current Python for its torch version (torch is imported in a child so the CLI never links it).
fn torch_info() -> TorchInfo {
    let python = std::env::var("TORCHMEM_PYTHON").ok().filter(|s| !s.is_empty()).unwrap_or_else(|| "python3".into());
    let code = "import json\ntry:\n    import torch\n    print(json.dumps([torch.__version__, torch.version.cuda]))\nexcept ImportError as e:\n    print(json.dumps(['', str(e)]))\n";
    let mut info = TorchInfo { python: python.clone(), ..Default::default() };
    let child = Command::new(&python).args(["-c", code]).stderr(std::process::Stdio::null()).output();
    match child {
        Ok(out) if out.status.success() => match serde_json::from_slice::<(String, Option<String>)>(&out.stdout) {
            Ok((v, cuda)) if !v.is_empty() => {
                info.torch_version = Some(v);
                info.torch_cuda_version = cuda;
            }
            Ok((_, err)) => {
                info.error = Some(format!("torch is not installed for {python}: {}", err.unwrap_or_default()))
            }
            Err(e) => info.error = Some(format!("unexpected answer from {python}: {e}")),
        },
        Ok(out) => info.error = Some(format!("{python} failed with {}", out.status)),
        Err(e) => info.error = Some(format!("cannot run {python}: {e}")),
    }
    info
}

pub fn run(args: InfoArgs) -> anyhow::Result<i32> {
    let host = host::host_memory();
    let mut info = Info {
        host_total_bytes: host.map(|h| h.total_bytes),
        host_available_bytes: host.map(|h| h.available_bytes),
        gpu_unavailable: None,
        driver_version: None,
        cuda_driver_version: None,
        gpus: Vec::new(),
        torch: torch_info(),
    };
    match NvmlSource::open() {
        Ok(nvml) => {
            let driver = nvml.driver_info();
            info.driver_version = Some(driver.driver_version);
            info.cuda_driver_version = Some(driver.cuda_driver_version);
            let readings = nvml.read();
            for (dev, r) in nvml.devices().iter().zip(readings) {
                info.gpus.push(GpuInfo {
                    index: dev.index,
                    name: dev.name.clone(),
                    uuid: dev.uuid.clone(),
                    total_bytes: r.total_bytes,
                    free_bytes: r.free_bytes,
                    used_bytes: r.used_bytes,
                    processes: r
                        .process_bytes
                        .iter()
                        .map(|(&pid, &b)| GpuProcess { pid, used_bytes: b, cmdline: procfs::cmdline(pid) })
                        .collect(),
                });
            }
            if info.gpus.is_empty() {
                info.gpu_unavailable = Some("NVML found no GPU".into());
            }
        }
        Err(e) => info.gpu_unavailable = Some(nvml_unavailable(&e.to_string())),
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&info)?);
        return Ok(0);
    }
    let mut out = String::new();
    out.push_str(&format!(
        "Host RAM       total {}, available {}\n",
        info.host_total_bytes.map(format_bytes).unwrap_or_else(|| "-".into()),
        info.host_available_bytes.map(format_bytes).unwrap_or_else(|| "-".into())
    ));
    match (&info.torch.torch_version, &info.torch.error) {
        (Some(v), _) => out.push_str(&format!(
            "torch          {v} (CUDA build {}) in {}\n",
            info.torch.torch_cuda_version.as_deref().unwrap_or("none: CPU-only build"),
            info.torch.python
        )),
        (None, Some(e)) => out.push_str(&format!("torch          not available: {e}\n")),
        _ => {}
    }
    if let Some(why) = &info.gpu_unavailable {
        out.push_str(&format!("GPU            {why}\n"));
    } else {
        out.push_str(&format!(
            "NVIDIA driver  {} (supports CUDA {})\n",
            info.driver_version.as_deref().unwrap_or("?"),
            info.cuda_driver_version.as_deref().unwrap_or("?")
        ));
        out.push_str(&format!(
            "\n{:<4} {:<28} {:>12} {:>12} {:>12}  {}\n",
            "GPU", "name", "total", "free", "used", "processes (NVML, CUDA context included)"
        ));
        for g in &info.gpus {
            let procs = if g.processes.is_empty() {
                "none".to_string()
            } else {
                g.processes
                    .iter()
                    .map(|p| {
                        format!(
                            "{} {} ({})",
                            p.pid,
                            format_bytes(p.used_bytes),
                            p.cmdline.chars().take(40).collect::<String>()
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            };
            out.push_str(&format!(
                "{:<4} {:<28} {:>12} {:>12} {:>12}  {}\n",
                g.index,
                g.name,
                format_bytes(g.total_bytes),
                format_bytes(g.free_bytes),
                format_bytes(g.used_bytes),
                procs
            ));
        }
    }
    print!("{out}");
    Ok(0)
}

/// One short line for why NVML could not be used; the raw libloading text ("a libloading error
/// occurred: libnvidia-ml.so.1: cannot open shared object file …") only means there is no driver.
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
    #[test]
    fn nvml_errors_are_one_short_line() {
        let raw = "NVML error: a libloading error occurred: libnvidia-ml.so.1: cannot open shared object file: No such file or directory (no NVIDIA driver / libnvidia-ml.so.1 on this machine?)";
        assert_eq!(
            super::nvml_unavailable(raw),
            "NVML not available (libnvidia-ml.so.1 not found): no NVIDIA driver on this machine"
        );
        assert!(super::nvml_unavailable("NVML error: Unknown").starts_with("NVML not available: "));
    }
}
