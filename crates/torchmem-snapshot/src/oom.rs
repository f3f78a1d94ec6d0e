//! Out-of-memory post-mortem: parses PyTorch's CUDA OOM message (torch ≤ 2.0, 2.1 and ≥ 2.2
//! wordings) into numbers and turns numbers (from a message, or from the allocator at the failure)
//! into a diagnosis with concrete next steps.

use serde::Serialize;

use crate::fmt::bytes;

const GIB: u64 = 1 << 30;

/// The numbers known at an out-of-memory failure. All in bytes.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OomNumbers {
    pub device: Option<i64>,
    /// The (rounded) allocation that failed.
    pub requested_bytes: u64,
    /// Device total (or the allowed maximum when a memory fraction is set).
    pub total_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    /// Everything this process holds on the device (NVML), when known.
    pub process_bytes: Option<u64>,
    /// Bytes in live tensors (allocated by PyTorch).
    pub allocated_bytes: u64,
    /// Reserved by PyTorch's cache but not allocated.
    pub reserved_unallocated_bytes: u64,
    /// Memory of other processes, each as (pid, bytes), from the message.
    pub other_processes: Vec<(u64, u64)>,
    /// Largest free block in the cache, when known (from a snapshot or memory_stats).
    pub largest_free_block_bytes: Option<u64>,
}

/// A diagnosis with the reasoning's numbers and what to do.
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    pub numbers: OomNumbers,
    pub reserved_bytes: u64,
    /// "fragmentation", "capacity", "other_processes" or "request_too_large".
    pub verdict: String,
    pub explanation: String,
    /// Bytes missing for the request even if the cache were perfectly packed.
    pub shortfall_bytes: u64,
    /// Non-PyTorch memory of this process (CUDA context, libraries), when known.
    pub non_pytorch_bytes: Option<u64>,
    pub other_processes_bytes: Option<u64>,
    /// Suggested batch-size factor (e.g. 0.62 means ≤ 62 % of the current batch), when capacity-bound.
    pub batch_factor: Option<f64>,
    pub next_steps: Vec<String>,
}

fn unit_factor(u: &str) -> Option<f64> {
    Some(match u {
        "B" | "bytes" | "byte" => 1.0,
        "KiB" | "KB" => 1024.0,
        "MiB" | "MB" => 1024.0 * 1024.0,
        "GiB" | "GB" => 1024.0 * 1024.0 * 1024.0,
        "TiB" | "TB" => 1024.0f64.powi(4),
        _ => return None,
    })
}

/// Parses "12.34 GiB" at the start of `s`; returns bytes and the rest.
fn parse_size(s: &str) -> Option<(u64, &str)> {
    let s = s.trim_start();
    let end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let num: f64 = s[..end].parse().ok()?;
    let rest = s[end..].trim_start();
    let uend = rest.find(|c: char| !c.is_ascii_alphabetic()).unwrap_or(rest.len());
    let f = unit_factor(&rest[..uend])?;
    Some(((num * f).round() as u64, &rest[uend..]))
}

/// The size right after the first occurrence of `prefix`.
fn size_after(msg: &str, prefix: &str) -> Option<u64> {
    let i = msg.find(prefix)?;
    parse_size(&msg[i + prefix.len()..]).map(|(b, _)| b)
}

/// The size right before the first occurrence of `suffix` (e.g. "7.93 GiB total capacity").
fn size_before(msg: &str, suffix: &str) -> Option<u64> {
    let i = msg.find(suffix)?;
    let head = msg[..i].trim_end();
    // walk back over "<num> <unit>"
    let unit_start = head.rfind(' ')?;
    let num_part = head[..unit_start].trim_end();
    let num_start = num_part.rfind(|c: char| !(c.is_ascii_digit() || c == '.')).map(|j| j + 1).unwrap_or(0);
    parse_size(&head[num_start..]).map(|(b, _)| b)
}

fn int_after(msg: &str, prefix: &str) -> Option<i64> {
    let i = msg.find(prefix)?;
    let rest = &msg[i + prefix.len()..];
    let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Parses a PyTorch CUDA out-of-memory message. Errors say what was missing.
pub fn parse_message(msg: &str) -> Result<OomNumbers, String> {
    let msg = msg.split_whitespace().collect::<Vec<_>>().join(" ");
    if !msg.contains("out of memory") {
        return Err("this does not look like a PyTorch out-of-memory message (no 'out of memory' in it). Paste the whole line that starts with 'CUDA out of memory. Tried to allocate'".into());
    }
    let requested = size_after(&msg, "Tried to allocate ")
        .ok_or("the message has no 'Tried to allocate <size>' part; paste the complete message")?;
    let mut n = OomNumbers { requested_bytes: requested, device: int_after(&msg, "GPU "), ..Default::default() };
    if msg.contains("total capacity of") || msg.contains("total capacty of") {
        // torch ≥ 2.1
        let cap = if msg.contains("total capacity of") { "total capacity of " } else { "total capacty of " };
        n.total_bytes = size_after(&msg, cap);
        n.free_bytes = size_after(&msg, " of which ");
        n.process_bytes = size_after(&msg, "this process has ");
        n.allocated_bytes = size_after(&msg, "Of the allocated memory ")
            .ok_or("missing 'Of the allocated memory <size> is allocated by PyTorch'")?;
        n.reserved_unallocated_bytes = size_after(&msg, "and ")
            .filter(|_| msg.contains("reserved by PyTorch but unallocated"))
            .ok_or("missing '<size> is reserved by PyTorch but unallocated'")?;
        let mut rest = msg.as_str();
        while let Some(i) = rest.find("Process ") {
            rest = &rest[i + 8..];
            let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
            if let Ok(pid) = rest[..end].parse::<u64>() {
                if let Some(b) = size_after(rest, " has ") {
                    n.other_processes.push((pid, b));
                }
            }
        }
    } else if msg.contains("total capacity;") {
        // torch ≤ 2.0: (GPU 0; 7.93 GiB total capacity; 130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch)
        n.total_bytes = size_before(&msg, "total capacity;");
        n.allocated_bytes = size_before(&msg, "already allocated").ok_or("missing '<size> already allocated'")?;
        n.free_bytes = size_before(&msg, "free;");
        let reserved =
            size_before(&msg, "reserved in total by PyTorch").ok_or("missing '<size> reserved in total by PyTorch'")?;
        n.reserved_unallocated_bytes = reserved.saturating_sub(n.allocated_bytes);
        if let Some(allowed) = size_before(&msg, "allowed;") {
            n.total_bytes = Some(allowed);
        }
    } else {
        return Err("found 'Tried to allocate' but not the device numbers ('total capacity of …' or '(GPU N; … total capacity; …)'); paste the complete message".into());
    }
    Ok(n)
}

/// Diagnoses an OOM from its numbers.
pub fn diagnose(n: &OomNumbers) -> Diagnosis {
    let req = n.requested_bytes;
    let reserved = n.allocated_bytes + n.reserved_unallocated_bytes;
    let free = n.free_bytes.unwrap_or(0);
    let non_pytorch = n.process_bytes.map(|p| p.saturating_sub(reserved));
    let others = match (n.total_bytes, n.free_bytes, n.process_bytes) {
        (Some(t), Some(f), Some(p)) => Some(t.saturating_sub(f).saturating_sub(p)),
        _ => None,
    };
    let shortfall = req.saturating_sub(free + n.reserved_unallocated_bytes);
    let mut steps = Vec::new();
    let verdict;
    let explanation;
    let mut batch_factor = None;
    let total = n.total_bytes.unwrap_or(0);
    if total > 0 && req > total {
        verdict = "request_too_large";
        explanation = format!(
            "one request of {} is larger than the whole device ({}): no setting can make it fit",
            bytes(req),
            bytes(total)
        );
        steps.push("Check the shape that produced this tensor (a wrong dimension or a huge matmul/attention matrix): print the shapes before the failing line".to_string());
        steps.push(
            "Split the computation into chunks (e.g. chunked attention / loss, smaller sequence length)".to_string(),
        );
    } else if shortfall == 0 && n.reserved_unallocated_bytes > 0 {
        verdict = "fragmentation";
        explanation = format!(
            "the cache holds {} reserved but unallocated and the device has {} free; together that is enough for the {} request, but no single free block is large enough: fragmentation caused this OOM",
            bytes(n.reserved_unallocated_bytes),
            bytes(free),
            bytes(req)
        );
        steps.push("Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before torch initialises CUDA) so the cache can grow segments instead of leaving holes".to_string());
        steps.push("Or call torch.cuda.empty_cache() before the large allocation, or set max_split_size_mb to limit splitting of large blocks".to_string());
    } else if others.is_some_and(|o| o > req.max(GIB) && o >= shortfall) {
        verdict = "other_processes";
        explanation = format!(
            "other processes hold {} of the device; without them the {} request would fit",
            bytes(others.unwrap_or(0)),
            bytes(req)
        );
        let list: Vec<String> = n.other_processes.iter().map(|(p, b)| format!("pid {p} ({})", bytes(*b))).collect();
        steps.push(format!(
            "Stop or move the other processes on this GPU{} (see `torchmem info` or nvidia-smi), or run on a free GPU with CUDA_VISIBLE_DEVICES",
            if list.is_empty() { String::new() } else { format!(": {}", list.join(", ")) }
        ));
    } else {
        verdict = "capacity";
        // What PyTorch could use at best vs what it needed at the failure.
        let usable = n.allocated_bytes + n.reserved_unallocated_bytes + free;
        let needed = n.allocated_bytes + req;
        let f = if needed > 0 { usable as f64 / needed as f64 } else { 1.0 };
        // Leave a 10 % margin for rounding and allocator overhead; round down to 0.05.
        let f = ((f * 0.9) * 20.0).floor() / 20.0;
        let f = f.clamp(0.05, 0.95);
        batch_factor = Some(f);
        explanation = format!(
            "live tensors hold {} and the request needs {} more, but only {} is left (free {} + reserved-unallocated {}): the workload does not fit; {} is missing even with a perfectly packed cache",
            bytes(n.allocated_bytes),
            bytes(req),
            bytes(free + n.reserved_unallocated_bytes),
            bytes(free),
            bytes(n.reserved_unallocated_bytes),
            bytes(shortfall)
        );
        steps.push(format!(
            "Reduce the batch size to about {:.0}% of the current one (assuming activation memory grows with the batch), and use gradient accumulation to keep the effective batch",
            f * 100.0
        ));
        steps.push("Or cut activation memory: torch.autocast(dtype=torch.bfloat16), gradient checkpointing, a shorter sequence length".to_string());
        steps.push("Or cut state memory: a lighter optimizer (e.g. 8-bit Adam, SGD), bf16 weights, or sharding (FSDP/ZeRO) across GPUs".to_string());
        if n.reserved_unallocated_bytes > req / 2 && n.reserved_unallocated_bytes > 256 << 20 {
            steps.push(format!(
                "Also: {} is reserved but unallocated; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would return part of it",
                bytes(n.reserved_unallocated_bytes)
            ));
        }
    }
    if let Some(np) = non_pytorch {
        if np > 2 * GIB {
            steps.push(format!(
                "{} of this process's device memory is not PyTorch tensors (CUDA context, cuBLAS/cuDNN workspaces, NCCL, other libraries); measure it with `torchmem info` and check for non-PyTorch CUDA users",
                bytes(np)
            ));
        }
    }
    Diagnosis {
        numbers: n.clone(),
        reserved_bytes: reserved,
        verdict: verdict.to_string(),
        explanation,
        shortfall_bytes: shortfall,
        non_pytorch_bytes: non_pytorch,
        other_processes_bytes: others,
        batch_factor,
        next_steps: steps,
    }
}

/// Renders a diagnosis as text.
pub fn render_text(d: &Diagnosis) -> String {
    use std::fmt::Write;
    let n = &d.numbers;
    let mut o = String::new();
    let _ = writeln!(o, "Out of memory{}", n.device.map(|g| format!(" on GPU {g}")).unwrap_or_default());
    let _ = writeln!(o, "  tried to allocate          {:>12}", bytes(n.requested_bytes));
    if let Some(t) = n.total_bytes {
        let _ = writeln!(o, "  device total               {:>12}", bytes(t));
    }
    if let Some(f) = n.free_bytes {
        let _ = writeln!(o, "  device free                {:>12}", bytes(f));
    }
    let _ = writeln!(o, "  allocated (live tensors)   {:>12}", bytes(n.allocated_bytes));
    let _ = writeln!(o, "  reserved by PyTorch        {:>12}", bytes(d.reserved_bytes));
    let _ = writeln!(o, "  reserved but unallocated   {:>12}", bytes(n.reserved_unallocated_bytes));
    if let Some(np) = d.non_pytorch_bytes {
        let _ = writeln!(o, "  this process, non-PyTorch  {:>12}", bytes(np));
    }
    if let Some(op) = d.other_processes_bytes {
        let _ = writeln!(o, "  other processes            {:>12}", bytes(op));
    }
    let _ = writeln!(o, "\nDiagnosis: {}", d.verdict);
    let _ = writeln!(o, "  {}", d.explanation);
    let _ = writeln!(o, "\nNext steps");
    for (i, s) in d.next_steps.iter().enumerate() {
        let _ = writeln!(o, "  {}. {s}", i + 1);
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    const MSG_2_11: &str = "CUDA out of memory. Tried to allocate 60.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 39.00 GiB is free. Including non-PyTorch memory, this process has 100.80 GiB memory in use. Of the allocated memory 100.06 GiB is allocated by PyTorch, and 1024.00 KiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";

    #[test]
    fn parses_2_11_message() {
        let n = parse_message(MSG_2_11).unwrap();
        assert_eq!(n.requested_bytes, 60 * GIB);
        assert_eq!(n.device, Some(0));
        assert_eq!(n.total_bytes, Some((139.80 * GIB as f64).round() as u64));
        assert_eq!(n.free_bytes, Some(39 * GIB));
        assert_eq!(n.reserved_unallocated_bytes, 1024 * 1024);
        assert_eq!(n.allocated_bytes, (100.06 * GIB as f64).round() as u64);
        let d = diagnose(&n);
        assert_eq!(d.verdict, "capacity");
        // usable = 100.06 + 0.001 + 39 = 139.06 GiB; needed = 160.06 GiB → 0.869 × 0.9 = 0.78 → 0.75
        assert_eq!(d.batch_factor, Some(0.75));
    }

    #[test]
    fn parses_old_and_2_1_messages() {
        let old = "CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb";
        let n = parse_message(old).unwrap();
        assert_eq!(n.requested_bytes, 36 << 20);
        assert_eq!(n.free_bytes, Some((47.06 * (1u64 << 20) as f64).round() as u64));
        assert_eq!(n.reserved_unallocated_bytes, (188u64 << 20) - (130.35 * (1u64 << 20) as f64).round() as u64);
        assert_eq!(diagnose(&n).verdict, "fragmentation");
        let v21 = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacty of 79.15 GiB of which 1.50 GiB is free. Process 1234 has 20.00 GiB memory in use. Including non-PyTorch memory, this process has 57.60 GiB memory in use. Of the allocated memory 50.00 GiB is allocated by PyTorch, and 6.00 GiB is reserved by PyTorch but unallocated.";
        let n = parse_message(v21).unwrap();
        assert_eq!(n.other_processes, vec![(1234, 20 * GIB)]);
        assert_eq!(diagnose(&n).verdict, "fragmentation");
    }

    #[test]
    fn rejects_non_oom_text() {
        assert!(parse_message("hello").unwrap_err().contains("out-of-memory"));
        assert!(parse_message("CUDA out of memory.").unwrap_err().contains("Tried to allocate"));
    }
}
