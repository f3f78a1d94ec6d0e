//! `torchmem info`: the machine's memory as PyTorch users need it: each GPU's total, free and used memory and
//! who uses it (NVML), driver and CUDA versions, the torch that the current Python sees, and host RAM. The
//! machine part is core's `sources::device_info` (the value `torchmem.device_info()` returns too).

use std::process::Command;

use serde::Serialize;
use serde_json::json;
use torchmem_core::sources::device_info::device_info;
use torchmem_core::sources::procfs;
use torchmem_core::units::{format_bytes, format_opt_bytes};

#[derive(Debug, clap::Args)]
pub struct InfoArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize, Default)]
struct TorchInfo {
    python: String,
    torch_version: Option<String>,
    torch_cuda_version: Option<String>,
    error: Option<String>,
}

/// The reader of torch's version (`python/torchmem/_torch_version.py`), run as text in the user's Python: the
/// same code gives `torchmem.device_info()`'s `torch_version`, and that Python need not have torchmem.
const TORCH_VERSION_PY: &str = include_str!("../../../python/torchmem/_torch_version.py");

/// Asks the current Python for its torch version and CUDA build, read from torch's `version.py` without
/// importing torch (which takes seconds): a Python start, about 30 ms.
fn torch_info() -> TorchInfo {
    // The Python `run` and `estimate` would start (`launch`'s one rule).
    let python = torchmem_recorder::launch::python_interpreter();
    let mut info = TorchInfo { python: python.clone(), ..Default::default() };
    let child = Command::new(&python).args(["-c", TORCH_VERSION_PY]).stderr(std::process::Stdio::null()).output();
    #[derive(serde::Deserialize)]
    struct Answer {
        torch_version: Option<String>,
        torch_cuda_version: Option<String>,
        error: Option<String>,
    }
    match child {
        Ok(out) if out.status.success() => match serde_json::from_slice::<Answer>(&out.stdout) {
            Ok(Answer { torch_version: Some(v), torch_cuda_version, .. }) => {
                info.torch_version = Some(v);
                info.torch_cuda_version = torch_cuda_version;
            }
            Ok(Answer { error, .. }) => {
                info.error = Some(format!("torch is not installed for {python}: {}", error.unwrap_or_default()))
            }
            Err(e) => info.error = Some(format!("unexpected answer from {python}: {e}")),
        },
        Ok(out) => info.error = Some(format!("{python} failed with {}", out.status)),
        Err(e) => info.error = Some(format!("cannot run {python}: {e}")),
    }
    info
}

pub fn run(args: InfoArgs) -> anyhow::Result<i32> {
    let info = device_info(std::process::id());
    let torch = torch_info();
    let gpu_unavailable = info.gpu_unavailable();
    if args.json {
        // `torchmem info --json`'s own keys (`gpus`, `gpu_unavailable`, each process's `cmdline`, `torch`):
        // a view of the one `DeviceInfo` that `torchmem.device_info()` returns as it is.
        let gpus: Vec<serde_json::Value> = info
            .devices
            .iter()
            .map(|g| {
                let processes: Vec<serde_json::Value> = g
                    .processes
                    .iter()
                    .map(|(&pid, &used_bytes)| json!({"pid": pid, "used_bytes": used_bytes, "cmdline": procfs::cmdline(pid)}))
                    .collect();
                json!({
                    "index": g.index,
                    "name": g.name,
                    "uuid": g.uuid,
                    "total_bytes": g.total_bytes,
                    "free_bytes": g.free_bytes,
                    "used_bytes": g.used_bytes,
                    "processes": processes,
                })
            })
            .collect();
        let out = json!({
            "host_total_bytes": info.host_total_bytes,
            "host_available_bytes": info.host_available_bytes,
            "gpu_unavailable": gpu_unavailable,
            "driver_version": info.driver_version,
            "cuda_driver_version": info.cuda_driver_version,
            "gpus": gpus,
            "torch": torch,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(0);
    }
    let mut out = String::new();
    out.push_str(&format!(
        "Host RAM       total {}, available {}\n",
        format_opt_bytes(info.host_total_bytes),
        format_opt_bytes(info.host_available_bytes)
    ));
    match (&torch.torch_version, &torch.error) {
        (Some(v), _) => out.push_str(&format!(
            "torch          {v} (CUDA build {}) in {}\n",
            torch.torch_cuda_version.as_deref().unwrap_or("none: CPU-only build"),
            torch.python
        )),
        (None, Some(e)) => out.push_str(&format!("torch          not available: {e}\n")),
        _ => {}
    }
    if let Some(why) = &gpu_unavailable {
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
        for g in &info.devices {
            let procs = if g.processes.is_empty() {
                "none".to_string()
            } else {
                g.processes
                    .iter()
                    .map(|(&pid, &used_bytes)| {
                        let cmdline = procfs::cmdline(pid);
                        format!("{pid} {} ({})", format_bytes(used_bytes), cmdline.chars().take(40).collect::<String>())
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
