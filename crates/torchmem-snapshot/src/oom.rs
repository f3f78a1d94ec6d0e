//! Out-of-memory post-mortem: splits a pasted log into its out-of-memory messages, parses each one
//! (CUDA/HIP in the torch ≤ 2.0, 2.1 and ≥ 2.2 wordings, XPU, MPS, and the CPU allocator's), and turns
//! the numbers (from a message, or from the allocator at the failure) into a diagnosis with next steps
//! that fit the PyTorch version the wording comes from. Unknown numbers stay unknown (`None`), never 0.

use serde::Serialize;

use crate::fmt::bytes;

const GIB: u64 = 1 << 30;

/// Which allocator reported the failure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    #[default]
    Cuda,
    /// ROCm builds print "HIP out of memory" with the CUDA wording.
    Hip,
    Xpu,
    Mps,
    Cpu,
}

/// The message's wording, which tells the PyTorch version range (and so which options exist).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Wording {
    /// `Tried to allocate X (GPU 0; Y total capacity; … reserved in total by PyTorch)`: torch ≤ 2.0.
    TorchLe2_0,
    /// `GPU 0 has a total capacty of …` (sic): torch 2.1.
    Torch2_1,
    /// `GPU 0 has a total capacity of …`: torch ≥ 2.2.
    TorchGe2_2,
    /// `XPU out of memory. … has a total capacity of …` (no free memory in it).
    Xpu,
    /// `MPS backend out of memory (MPS allocated: …, other allocations: …, max allowed: …)`.
    Mps,
    /// `DefaultCPUAllocator: not enough memory: you tried to allocate N bytes`.
    Cpu,
}

/// The numbers known at an out-of-memory failure. All in bytes; `None` where the source does not say.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OomNumbers {
    pub backend: Backend,
    /// The message's wording; `None` when the numbers come from the allocator, not from a message.
    pub wording: Option<Wording>,
    pub device: Option<i64>,
    /// The (rounded) allocation that failed.
    pub requested_bytes: u64,
    /// Device total, or the allowed maximum when `total_is_limit` (a memory fraction, MPS's watermark).
    pub total_bytes: Option<u64>,
    /// True when `total_bytes` is an allowed maximum rather than the device's size.
    pub total_is_limit: bool,
    pub free_bytes: Option<u64>,
    /// Everything this process holds on the device (NVML), when known.
    pub process_bytes: Option<u64>,
    /// Bytes in live tensors (allocated by PyTorch).
    pub allocated_bytes: Option<u64>,
    /// Reserved by PyTorch's cache but not allocated.
    pub reserved_unallocated_bytes: Option<u64>,
    /// MPS: driver memory of this process beyond the tensors (MPS's cache and Metal's own).
    pub other_allocations_bytes: Option<u64>,
    /// Memory of the other processes, each as (pid, bytes): the message's process lines except this one.
    pub other_processes: Vec<(u64, u64)>,
    /// Every "Process N has X memory in use" line of the message, as (pid, bytes).
    pub listed_processes: Vec<(u64, u64)>,
    /// This process's pid, when the message lists processes and one of them could be identified as this one.
    pub this_process_pid: Option<u64>,
    /// How this process was told apart from the listed ones (or why it could not be).
    pub this_process_note: Option<String>,
    /// Largest free block in the cache, when known (from a snapshot or memory_stats).
    pub largest_free_block_bytes: Option<u64>,
}

impl OomNumbers {
    /// Allocated + reserved-but-unallocated, when both are known.
    pub fn reserved_bytes(&self) -> Option<u64> {
        Some(self.allocated_bytes? + self.reserved_unallocated_bytes?)
    }
}

/// A diagnosis with the reasoning's numbers and what to do.
#[derive(Debug, Clone, Serialize)]
pub struct Diagnosis {
    pub numbers: OomNumbers,
    pub reserved_bytes: Option<u64>,
    /// "fragmentation", "capacity", "other_processes", "request_too_large", "undetermined" (the message
    /// lacks the free memory needed to decide), "mps_limit" or "host_memory".
    pub verdict: String,
    pub explanation: String,
    /// Bytes missing for the request even if the cache were perfectly packed; `None` when unknown.
    pub shortfall_bytes: Option<u64>,
    /// Non-PyTorch memory of this process (CUDA context, libraries), when known.
    pub non_pytorch_bytes: Option<u64>,
    pub other_processes_bytes: Option<u64>,
    /// True when `other_processes_bytes` is a lower bound (this process could not be identified).
    pub other_processes_at_least: bool,
    /// Suggested batch-size factor (e.g. 0.62 means ≤ 62 % of the current batch), when capacity-bound.
    pub batch_factor: Option<f64>,
    pub next_steps: Vec<String>,
    /// Caveats: unknown numbers, impossible numbers, how this process was identified.
    pub notes: Vec<String>,
}

/// One out-of-memory message found in a log, with where it was and its diagnosis (or why it could not be read).
#[derive(Debug, Clone, Serialize)]
pub struct Explained {
    /// 1-based position among the messages of the input.
    pub message_index: usize,
    /// 1-based line of the input where the message starts.
    pub line: usize,
    /// The distributed rank from a `[rankN]:` / `[defaultN]:` line prefix (torchrun), when present.
    pub rank: Option<u32>,
    #[serde(flatten)]
    pub result: ExplainedResult,
}

#[derive(Debug, Clone, Serialize)]
#[serde(untagged)]
pub enum ExplainedResult {
    Diagnosis(Box<Diagnosis>),
    Error { error: String },
}

fn unit_factor(u: &str) -> Option<f64> {
    Some(match u {
        "B" | "bytes" | "byte" => 1.0,
        "KiB" | "KB" | "kB" => 1024.0,
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

fn int_after(msg: &str, prefix: &str) -> Option<i64> {
    let i = msg.find(prefix)?;
    let rest = &msg[i + prefix.len()..];
    let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Where a message starts in a normalized text, and its backend.
fn find_starts(text: &str) -> Vec<(usize, Backend)> {
    let mut starts = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find(" out of memory. Tried to allocate").map(|i| i + from) {
        let head = &text[..i];
        let word_start = head.rfind(|c: char| !c.is_ascii_alphabetic()).map(|j| j + 1).unwrap_or(0);
        let backend = match &head[word_start..] {
            "HIP" => Backend::Hip,
            "XPU" => Backend::Xpu,
            _ => Backend::Cuda,
        };
        starts.push((word_start, backend));
        from = i + 1;
    }
    for (pat, backend) in [
        ("MPS backend out of memory", Backend::Mps),
        ("DefaultCPUAllocator: not enough memory", Backend::Cpu),
        ("DefaultCPUAllocator: can't allocate memory", Backend::Cpu),
    ] {
        let mut from = 0;
        while let Some(i) = text[from..].find(pat).map(|i| i + from) {
            starts.push((i, backend));
            from = i + pat.len();
        }
    }
    starts.sort_by_key(|s| s.0);
    starts
}

/// The input, one line per entry with its torchrun rank prefix removed, joined with single spaces
/// (a message may be wrapped over lines); `line_at[k]` = (offset in the joined text, 1-based line, rank).
struct Normalized {
    text: String,
    line_at: Vec<(usize, usize, Option<u32>)>,
}

/// Strips a torchrun `[rank3]:` / `[default3]:` prefix; returns the rank and the rest.
fn strip_rank_prefix(line: &str) -> (Option<u32>, &str) {
    let t = line.trim_start();
    for tag in ["[rank", "[default"] {
        if let Some(rest) = t.strip_prefix(tag) {
            let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
            if end > 0 {
                if let Some(after) = rest[end..].strip_prefix("]:") {
                    return (rest[..end].parse().ok(), after);
                }
            }
        }
    }
    (None, line)
}

fn normalize(input: &str) -> Normalized {
    let mut text = String::with_capacity(input.len());
    let mut line_at = Vec::new();
    for (k, line) in input.lines().enumerate() {
        let (rank, rest) = strip_rank_prefix(line);
        line_at.push((text.len(), k + 1, rank));
        for w in rest.split_whitespace() {
            text.push_str(w);
            text.push(' ');
        }
    }
    Normalized { text, line_at }
}

/// Splits a log into its out-of-memory messages (so that no message borrows numbers from another) and
/// parses each. Returns (line, rank, parse result) per message, in input order; empty when none is found.
pub fn split_and_parse(input: &str) -> Vec<(usize, Option<u32>, Result<OomNumbers, String>)> {
    let norm = normalize(input);
    let starts = find_starts(&norm.text);
    let mut out = Vec::new();
    for (k, &(start, backend)) in starts.iter().enumerate() {
        let end = starts.get(k + 1).map(|s| s.0).unwrap_or(norm.text.len());
        let seg = norm.text[start..end].trim();
        let li = norm.line_at.partition_point(|&(off, _, _)| off <= start).saturating_sub(1);
        let (line, rank) = norm.line_at.get(li).map(|&(_, l, r)| (l, r)).unwrap_or((1, None));
        out.push((line, rank, parse_one(seg, backend)));
    }
    out
}

/// Parses the first PyTorch out-of-memory message in `msg`. Errors say what was missing.
pub fn parse_message(msg: &str) -> Result<OomNumbers, String> {
    match split_and_parse(msg).into_iter().next() {
        Some((_, _, r)) => r,
        None => Err(not_found_error(msg)),
    }
}

/// The error for a text without any recognisable out-of-memory message.
pub fn not_found_error(msg: &str) -> String {
    let flat = msg.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.contains("out of memory") {
        if flat.contains("CUDA error: out of memory") {
            return "this is 'CUDA error: out of memory' (raised by a CUDA call outside PyTorch's caching allocator: context creation, cuBLAS/cuDNN/NCCL workspaces, a custom kernel), not the allocator's OOM message, so it carries no numbers to explain. Run `torchmem info` to see what else holds the GPU".into();
        }
        return "found 'out of memory' but not a PyTorch allocator message (no 'Tried to allocate <size>'). Paste the whole message, from 'CUDA out of memory. Tried to allocate' to its end".into();
    }
    "this does not look like a PyTorch out-of-memory message (no 'out of memory' in it). Paste the whole line that starts with 'CUDA out of memory. Tried to allocate', or give the log file's path".into()
}

fn parse_one(seg: &str, backend: Backend) -> Result<OomNumbers, String> {
    match backend {
        Backend::Cpu => parse_cpu(seg),
        Backend::Mps => parse_mps(seg),
        _ => parse_gpu(seg, backend),
    }
}

fn parse_cpu(seg: &str) -> Result<OomNumbers, String> {
    let requested = size_after(seg, "you tried to allocate ")
        .ok_or("found 'DefaultCPUAllocator' but not 'you tried to allocate <N> bytes'; paste the complete message")?;
    Ok(OomNumbers {
        backend: Backend::Cpu,
        wording: Some(Wording::Cpu),
        requested_bytes: requested,
        ..Default::default()
    })
}

fn parse_mps(seg: &str) -> Result<OomNumbers, String> {
    let missing =
        |what: &str| format!("found 'MPS backend out of memory' but not '{what}'; paste the complete message");
    let requested = size_after(seg, "Tried to allocate ").ok_or_else(|| missing("Tried to allocate <size>"))?;
    Ok(OomNumbers {
        backend: Backend::Mps,
        wording: Some(Wording::Mps),
        requested_bytes: requested,
        allocated_bytes: Some(size_after(seg, "MPS allocated: ").ok_or_else(|| missing("MPS allocated: <size>"))?),
        other_allocations_bytes: size_after(seg, "other allocations: "),
        total_bytes: size_after(seg, "max allowed: "),
        total_is_limit: true,
        ..Default::default()
    })
}

fn parse_gpu(seg: &str, backend: Backend) -> Result<OomNumbers, String> {
    let requested = size_after(seg, "Tried to allocate ")
        .ok_or("the message has no 'Tried to allocate <size>' part; paste the complete message")?;
    let mut n = OomNumbers { backend, requested_bytes: requested, ..Default::default() };
    let cap = ["has a total capacity of ", "has a total capacty of "].into_iter().find(|p| seg.contains(p));
    if let Some(cap) = cap {
        n.wording = Some(match (backend, cap.contains("capacty")) {
            (Backend::Xpu, _) => Wording::Xpu,
            (_, true) => Wording::Torch2_1,
            _ => Wording::TorchGe2_2,
        });
        n.device = int_after(seg, "GPU ");
        let ci = seg.find(cap).unwrap_or(0) + cap.len();
        let after_cap = &seg[ci..];
        n.total_bytes = parse_size(after_cap).map(|(b, _)| b);
        let alloc_at = after_cap.find("Of the allocated memory ").unwrap_or(after_cap.len());
        // The part between the capacity and "Of the allocated memory": free memory and process lines.
        let proc_part = &after_cap[..alloc_at];
        if let Some(i) = proc_part.find(" of which ") {
            let rest = &proc_part[i + " of which ".len()..];
            if let Some((b, tail)) = parse_size(rest) {
                if tail.trim_start().starts_with("is free") {
                    n.free_bytes = Some(b);
                }
            }
        }
        n.process_bytes = size_after(proc_part, "this process has ");
        let mut rest = proc_part;
        while let Some(i) = rest.find("Process ") {
            rest = &rest[i + "Process ".len()..];
            let end = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
            if let Ok(pid) = rest[..end].parse::<u64>() {
                if let Some((b, _)) = rest[end..].strip_prefix(" has ").and_then(parse_size) {
                    n.listed_processes.push((pid, b));
                }
            }
        }
        let alloc_part = &after_cap[alloc_at..];
        n.allocated_bytes =
            Some(size_after(alloc_part, "Of the allocated memory ").ok_or(
                "missing 'Of the allocated memory <size> is allocated by PyTorch'; paste the complete message",
            )?);
        n.reserved_unallocated_bytes = Some(
            size_after(alloc_part, "allocated by PyTorch, and ")
                .filter(|_| alloc_part.contains("reserved by PyTorch but unallocated"))
                .ok_or("missing '<size> is reserved by PyTorch but unallocated'; paste the complete message")?,
        );
        identify_this_process(&mut n);
        return Ok(n);
    }
    // torch ≤ 2.0: "Tried to allocate X (GPU 0; 7.93 GiB total capacity; 130.35 MiB already allocated;
    // 47.06 MiB free; [2.00 GiB allowed;] 188.00 MiB reserved in total by PyTorch)". Torch 1.0–1.3 said
    // "<reserved − allocated> cached" instead of the reserved total.
    let after = &seg[seg.find("Tried to allocate ").unwrap_or(0)..];
    let group = after.find('(').and_then(|o| after[o + 1..].find(')').map(|c| &after[o + 1..o + 1 + c]));
    let Some(group) = group.filter(|g| g.contains("total capacity")) else {
        return Err("found 'Tried to allocate' but not the device numbers ('total capacity of …' or '(GPU N; … total capacity; …)'); paste the complete message".into());
    };
    n.wording = Some(Wording::TorchLe2_0);
    let mut reserved_total = None;
    for part in group.split(';').map(str::trim) {
        if let Some(g) = part.strip_prefix("GPU ") {
            n.device = g.trim().parse().ok();
            continue;
        }
        let Some((b, label)) = parse_size(part) else { continue };
        match label.trim() {
            "total capacity" => n.total_bytes = n.total_bytes.or(Some(b)),
            "already allocated" => n.allocated_bytes = Some(b),
            "free" => n.free_bytes = Some(b),
            "allowed" => {
                n.total_bytes = Some(b);
                n.total_is_limit = true;
            }
            "reserved in total by PyTorch" => reserved_total = Some(b),
            "cached" => n.reserved_unallocated_bytes = Some(b),
            _ => {}
        }
    }
    let allocated = n.allocated_bytes.ok_or("missing '<size> already allocated'; paste the complete message")?;
    if let Some(r) = reserved_total {
        n.reserved_unallocated_bytes = Some(r.saturating_sub(allocated));
    }
    if n.reserved_unallocated_bytes.is_none() {
        return Err("missing '<size> reserved in total by PyTorch'; paste the complete message".into());
    }
    Ok(n)
}

/// In containers NVML's pids are not this process's, so PyTorch lists every process as "Process N has
/// X memory in use" and prints no "this process" line. This process holds at least PyTorch's reserved
/// memory; when exactly one listed process does, it is this one.
fn identify_this_process(n: &mut OomNumbers) {
    if n.listed_processes.is_empty() {
        return;
    }
    if n.process_bytes.is_some() {
        // The usual form: the listed processes are the others.
        n.other_processes = n.listed_processes.clone();
        return;
    }
    let Some(reserved) = n.reserved_bytes() else { return };
    let fits: Vec<(u64, u64)> = n.listed_processes.iter().copied().filter(|&(_, b)| b >= reserved).collect();
    match fits.as_slice() {
        [(pid, b)] => {
            n.this_process_pid = Some(*pid);
            n.process_bytes = Some(*b);
            n.other_processes = n.listed_processes.iter().copied().filter(|(p, _)| p != pid).collect();
            n.this_process_note = Some(format!(
                "the message has no 'this process' line (usual in containers); pid {pid} is taken as this process, the only listed process holding at least PyTorch's reserved {}",
                bytes(reserved)
            ));
        }
        [] => {
            n.other_processes = n.listed_processes.clone();
            n.this_process_note = Some(format!(
                "the message has no 'this process' line and no listed process holds PyTorch's reserved {}, so this process is not among them; all listed processes are counted as others",
                bytes(reserved)
            ));
        }
        several => {
            let pids: Vec<String> = several.iter().map(|(p, _)| p.to_string()).collect();
            let closest = several.iter().min_by_key(|&&(_, b)| b).copied().unwrap_or_default();
            n.this_process_note = Some(format!(
                "the message has no 'this process' line and several listed processes (pids {}) hold at least PyTorch's reserved {}: cannot tell which one is this process (pid {} is the closest, {} above the reserved memory); whichever it is, the others hold at least what the largest candidate does not",
                pids.join(", "),
                bytes(reserved),
                closest.0,
                bytes(closest.1 - reserved)
            ));
        }
    }
}

/// The advice against fragmentation for the version the message comes from.
fn fragmentation_steps(n: &OomNumbers) -> Vec<String> {
    match n.wording {
        Some(Wording::TorchLe2_0) => vec![
            "Set PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:<N> (e.g. 128–512; before torch initialises CUDA) so large cached blocks are not split into unusable pieces, or call torch.cuda.empty_cache() before the large allocation".to_string(),
            "This wording comes from torch ≤ 2.0; torch ≥ 2.1 adds PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which removes most of this fragmentation: upgrading is the better fix".to_string(),
        ],
        Some(Wording::Xpu) => vec!["Call torch.xpu.empty_cache() before the large allocation so cached blocks are returned and can be reallocated as one".to_string()],
        _ => vec![
            "Set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (before torch initialises CUDA) so the cache can grow segments instead of leaving holes".to_string(),
            "Or call torch.cuda.empty_cache() before the large allocation, or set max_split_size_mb to limit splitting of large blocks".to_string(),
        ],
    }
}

/// Diagnoses an OOM from its numbers.
pub fn diagnose(n: &OomNumbers) -> Diagnosis {
    match n.backend {
        Backend::Cpu => diagnose_cpu(n),
        Backend::Mps => diagnose_mps(n),
        _ => diagnose_gpu(n),
    }
}

fn sanity_notes(n: &OomNumbers, reserved: Option<u64>) -> Vec<String> {
    let mut notes = Vec::new();
    if let (Some(t), Some(f)) = (n.total_bytes, n.free_bytes) {
        if f > t {
            notes.push(format!("the numbers are impossible: free {} is more than the total {}; the message may be edited or come from a broken driver, so the diagnosis below is unreliable", bytes(f), bytes(t)));
        }
    }
    if let (Some(t), Some(r)) = (n.total_bytes, reserved) {
        if r > t && !n.total_is_limit {
            notes.push(format!(
                "the numbers are impossible: PyTorch's reserved {} is more than the device total {}",
                bytes(r),
                bytes(t)
            ));
        }
    }
    if let (Some(p), Some(r)) = (n.process_bytes, reserved) {
        if p < r && n.this_process_pid.is_none() {
            notes.push(format!(
                "the numbers are inconsistent: this process is said to hold {} but PyTorch alone reserved {}",
                bytes(p),
                bytes(r)
            ));
        }
    }
    if let Some(t) = n.total_bytes {
        let listed: u64 = n.listed_processes.iter().map(|p| p.1).sum();
        if listed > t && !n.total_is_limit {
            notes.push(format!(
                "the numbers are impossible: the listed processes hold {} together, more than the device total {}",
                bytes(listed),
                bytes(t)
            ));
        }
    }
    notes
}

fn diagnose_gpu(n: &OomNumbers) -> Diagnosis {
    let req = n.requested_bytes;
    let reserved = n.reserved_bytes();
    let allocated = n.allocated_bytes.unwrap_or(0);
    let cached = n.reserved_unallocated_bytes.unwrap_or(0);
    let mut notes = sanity_notes(n, reserved);
    if let Some(note) = &n.this_process_note {
        notes.push(note.clone());
    }
    let non_pytorch = match (n.process_bytes, reserved) {
        (Some(p), Some(r)) => Some(p.saturating_sub(r)),
        _ => None,
    };
    let listed_others: u64 = n.other_processes.iter().map(|p| p.1).sum();
    // When this process cannot be told apart from other listed ones, the others hold at least the listed
    // total minus the largest process that could be this one.
    let ambiguous_min = (n.process_bytes.is_none() && n.other_processes.is_empty() && !n.listed_processes.is_empty())
        .then(|| {
            let sum: u64 = n.listed_processes.iter().map(|p| p.1).sum();
            let largest = n.listed_processes.iter().filter(|p| reserved.is_some_and(|r| p.1 >= r)).map(|p| p.1).max();
            sum - largest.unwrap_or(0)
        });
    let others = match (n.total_bytes, n.free_bytes, n.process_bytes) {
        (Some(t), Some(f), Some(p)) if !n.total_is_limit => {
            Some(t.saturating_sub(f).saturating_sub(p).max(listed_others))
        }
        _ if !n.other_processes.is_empty() && (n.process_bytes.is_some() || n.this_process_note.is_some()) => {
            Some(listed_others)
        }
        _ => ambiguous_min,
    };
    // Under a memory fraction (an "allowed" maximum), PyTorch may use only the limit minus its reserved
    // memory, however much the device has free.
    let free_known = match (n.free_bytes, n.total_bytes, reserved) {
        (Some(f), Some(limit), Some(r)) if n.total_is_limit => {
            let room = limit.saturating_sub(r);
            if room < f {
                notes.push(format!(
                    "a memory fraction limits PyTorch to {} (set_per_process_memory_fraction or per_process_memory_fraction); the device has {} free, but only {} of it is within the limit",
                    bytes(limit),
                    bytes(f),
                    bytes(room)
                ));
            }
            Some(f.min(room))
        }
        (f, _, _) => f,
    };
    // With the free memory unknown, the most that could be free is what PyTorch has not reserved.
    let free_max = free_known.or_else(|| Some(n.total_bytes?.saturating_sub(reserved?)));
    if free_known.is_none() {
        notes.push(format!(
            "the message does not say how much device memory was free{}: free memory is unknown",
            free_max.map(|m| format!(" (at most {} that PyTorch had not reserved)", bytes(m))).unwrap_or_default()
        ));
    }
    // The shortfall is known when free is; a lower bound when only the maximum free is.
    let shortfall_min = free_max.map(|f| req.saturating_sub(f + cached));
    let shortfall = if free_known.is_some() { shortfall_min } else { shortfall_min.filter(|&s| s > 0) };
    let mut steps = Vec::new();
    let verdict;
    let explanation;
    let mut batch_factor = None;
    let total = n.total_bytes.unwrap_or(0);
    let free_text = |f: Option<u64>| f.map(bytes).unwrap_or_else(|| "unknown".into());
    if total > 0 && req > total {
        verdict = "request_too_large";
        explanation = format!(
            "one request of {} is larger than the whole {} ({}): no setting can make it fit",
            bytes(req),
            if n.total_is_limit { "allowed maximum" } else { "device" },
            bytes(total)
        );
        steps.push("Check the shape that produced this tensor (a wrong dimension or a huge matmul/attention matrix): print the shapes before the failing line".to_string());
        steps.push(
            "Split the computation into chunks (e.g. chunked attention / loss, smaller sequence length)".to_string(),
        );
    } else if cached > 0 && (cached >= req || (free_known.is_some() && shortfall == Some(0))) {
        verdict = "fragmentation";
        explanation = format!(
            "the cache holds {} reserved but unallocated and the device has {} free; together that is enough for the {} request, but no single free block is large enough: fragmentation caused this OOM",
            bytes(cached),
            free_text(free_known),
            bytes(req)
        );
        steps.extend(fragmentation_steps(n));
    } else if others.is_some_and(|o| o > req.max(GIB) && shortfall.is_none_or(|s| o >= s)) {
        verdict = "other_processes";
        explanation = format!(
            "other processes hold {}{} of the device; without them the {} request would fit",
            if ambiguous_min.is_some() { "at least " } else { "" },
            bytes(others.unwrap_or(0)),
            bytes(req)
        );
        let list: Vec<String> = n.other_processes.iter().map(|(p, b)| format!("pid {p} ({})", bytes(*b))).collect();
        steps.push(format!(
            "Stop or move the other processes on this GPU{} (see `torchmem info` or nvidia-smi), or run on a free GPU with CUDA_VISIBLE_DEVICES",
            if list.is_empty() { String::new() } else { format!(": {}", list.join(", ")) }
        ));
    } else if free_known.is_none() && shortfall.is_none() {
        verdict = "undetermined";
        explanation = format!(
            "live tensors hold {} and the request needs {} more; the cache holds {} reserved but unallocated, which is not enough alone, and whether the device had the rest free is not in the message: this is either fragmentation or a workload that does not fit",
            bytes(allocated),
            bytes(req),
            bytes(cached)
        );
        steps.push("Check the free device memory at the failure (`torchmem info`, nvidia-smi, or torch.cuda.mem_get_info() in an except block) to tell the two apart".to_string());
        steps.extend(fragmentation_steps(n));
        steps.push("If the device was full: reduce the batch size (with gradient accumulation), autocast to bf16, or gradient checkpointing".to_string());
    } else {
        verdict = "capacity";
        let free = free_max.unwrap_or(0);
        // What PyTorch could use at best vs what it needed at the failure.
        let usable = allocated + cached + free;
        let needed = allocated + req;
        let f = if needed > 0 { usable as f64 / needed as f64 } else { 1.0 };
        // Leave a 10 % margin for rounding and allocator overhead; round down to 0.05.
        let f = ((f * 0.9) * 20.0).floor() / 20.0;
        let f = f.clamp(0.05, 0.95);
        batch_factor = Some(f);
        let left =
            if free_known.is_some() { bytes(free + cached) } else { format!("at most {}", bytes(free + cached)) };
        explanation = format!(
            "live tensors hold {} and the request needs {} more, but only {} is left (free {} + reserved-unallocated {}): the workload does not fit; {}{} is missing even with a perfectly packed cache",
            bytes(allocated),
            bytes(req),
            left,
            free_text(free_known),
            bytes(cached),
            if free_known.is_some() { "" } else { "at least " },
            bytes(shortfall.unwrap_or(0))
        );
        if let Some(o) = others.filter(|&o| o >= 256 << 20) {
            steps.push(format!(
                "Other processes hold {} of this device{}; freeing it would give PyTorch that much more",
                bytes(o),
                if n.other_processes.is_empty() {
                    String::new()
                } else {
                    format!(
                        " ({})",
                        n.other_processes
                            .iter()
                            .map(|(p, b)| format!("pid {p}: {}", bytes(*b)))
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            ));
        }
        if n.total_is_limit && n.wording == Some(Wording::TorchLe2_0) {
            steps.push(format!(
                "Raise or remove the memory fraction (torch.cuda.set_per_process_memory_fraction): it caps PyTorch at {}",
                bytes(total)
            ));
        }
        steps.push(format!(
            "Reduce the batch size to about {:.0}% of the current one (assuming activation memory grows with the batch), and use gradient accumulation to keep the effective batch",
            f * 100.0
        ));
        steps.push("Or cut activation memory: torch.autocast(dtype=torch.bfloat16), gradient checkpointing, a shorter sequence length".to_string());
        steps.push("Or cut state memory: a lighter optimizer (e.g. 8-bit Adam, SGD), bf16 weights, or sharding (FSDP/ZeRO) across GPUs".to_string());
        if cached > req / 2 && cached > 256 << 20 {
            steps.push(match n.wording {
                Some(Wording::TorchLe2_0) => format!(
                    "Also: {} is reserved but unallocated; max_split_size_mb (or expandable_segments:True after upgrading to torch ≥ 2.1) would return part of it",
                    bytes(cached)
                ),
                _ => format!(
                    "Also: {} is reserved but unallocated; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would return part of it",
                    bytes(cached)
                ),
            });
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
        other_processes_at_least: ambiguous_min.is_some(),
        batch_factor,
        next_steps: steps,
        notes,
    }
}

fn diagnose_mps(n: &OomNumbers) -> Diagnosis {
    let req = n.requested_bytes;
    let allocated = n.allocated_bytes.unwrap_or(0);
    let other = n.other_allocations_bytes;
    let used = allocated + other.unwrap_or(0);
    let mut notes = Vec::new();
    if other.is_none() {
        notes.push("the message does not give 'other allocations': unknown".to_string());
    }
    let (verdict, explanation, shortfall, batch_factor);
    let mut steps = Vec::new();
    match n.total_bytes {
        Some(limit) if req > limit => {
            verdict = "request_too_large";
            explanation = format!(
                "one request of {} is larger than MPS's allowed maximum ({}): check the shape of this tensor",
                bytes(req),
                bytes(limit)
            );
            shortfall = Some(req + used - limit.min(req + used));
            batch_factor = None;
            steps.push("Check the shape that produced this tensor (print the shapes before the failing line), or split the computation into chunks".to_string());
        }
        Some(limit) => {
            verdict = "mps_limit";
            let s = (used + req).saturating_sub(limit);
            shortfall = Some(s);
            explanation = format!(
                "MPS tensors hold {} and other allocations of this process (MPS's cache, Metal) {}; with the {} request that is {}, over the allowed maximum of {} by {}",
                bytes(allocated),
                other.map(bytes).unwrap_or_else(|| "unknown".into()),
                bytes(req),
                bytes(used + req),
                bytes(limit),
                bytes(s)
            );
            let f = if allocated + req > 0 {
                limit.saturating_sub(other.unwrap_or(0)) as f64 / (allocated + req) as f64
            } else {
                1.0
            };
            let f = (((f * 0.9) * 20.0).floor() / 20.0).clamp(0.05, 0.95);
            batch_factor = Some(f);
            steps.push(format!(
                "Reduce the batch size to about {:.0}% of the current one, with gradient accumulation to keep the effective batch",
                f * 100.0
            ));
            if other.is_some_and(|o| o > req) {
                steps.push("Call torch.mps.empty_cache() before the large allocation: 'other allocations' includes MPS's cached memory".to_string());
            }
            steps.push("Or raise the limit with PYTORCH_MPS_HIGH_WATERMARK_RATIO (e.g. 1.4; 0.0 disables it): the machine's unified memory is shared with the system, so a higher limit can make macOS swap or fail".to_string());
        }
        None => {
            verdict = "undetermined";
            explanation = format!(
                "MPS tensors hold {} and the request needs {} more; the message does not give the allowed maximum",
                bytes(allocated),
                bytes(req)
            );
            shortfall = None;
            batch_factor = None;
            steps
                .push("Reduce the batch size, or call torch.mps.empty_cache() before the large allocation".to_string());
        }
    }
    Diagnosis {
        numbers: n.clone(),
        reserved_bytes: None,
        verdict: verdict.to_string(),
        explanation,
        shortfall_bytes: shortfall,
        non_pytorch_bytes: other,
        other_processes_bytes: None,
        other_processes_at_least: false,
        batch_factor,
        next_steps: steps,
        notes,
    }
}

fn diagnose_cpu(n: &OomNumbers) -> Diagnosis {
    let req = n.requested_bytes;
    let mut steps = Vec::new();
    let explanation = format!(
        "the CPU allocator could not get {} of host memory from the operating system (malloc failed): the machine's RAM, swap or the container's memory limit was exhausted",
        bytes(req)
    );
    if req >= 64 * GIB {
        steps.push(format!(
            "{} in one tensor is more than most machines have: check the shape that produced it (a wrong dimension, an outer product, a dense matrix that should be sparse)",
            bytes(req)
        ));
    }
    steps.push("Compare the request with the free host memory and the container's limit (`torchmem info`; /sys/fs/cgroup/memory.max)".to_string());
    steps.push("Reduce the batch size, or the number of DataLoader workers (each holds its own copies), or load the data memory-mapped (np.load(mmap_mode='r'), safetensors) instead of into RAM".to_string());
    steps.push(
        "Profile the run with `torchmem run -- python train.py` to see which phase holds the host memory".to_string(),
    );
    Diagnosis {
        numbers: n.clone(),
        reserved_bytes: None,
        verdict: "host_memory".to_string(),
        explanation,
        shortfall_bytes: None,
        non_pytorch_bytes: None,
        other_processes_bytes: None,
        other_processes_at_least: false,
        batch_factor: None,
        next_steps: steps,
        notes: vec!["a CPU out-of-memory message gives only the request: the host's total and free memory are unknown"
            .to_string()],
    }
}

/// One "  label      value" line of the numbers block.
fn row(o: &mut String, label: &str, value: String) {
    use std::fmt::Write;
    let _ = writeln!(o, "  {label:<29}{value:>12}");
}

/// Renders a diagnosis as text.
pub fn render_text(d: &Diagnosis) -> String {
    use std::fmt::Write;
    let n = &d.numbers;
    let unknown = || "unknown".to_string();
    let b = |v: Option<u64>| v.map(bytes).unwrap_or_else(unknown);
    let mut o = String::new();
    let place = match n.backend {
        Backend::Cpu => " in host memory (CPU)".to_string(),
        Backend::Mps => " on MPS (Apple GPU)".to_string(),
        _ => n.device.map(|g| format!(" on GPU {g}")).unwrap_or_default(),
    };
    let from = match n.wording {
        Some(Wording::TorchLe2_0) => " (torch ≤ 2.0 wording)",
        Some(Wording::Torch2_1) => " (torch 2.1 wording)",
        Some(Wording::TorchGe2_2) => " (torch ≥ 2.2 wording)",
        Some(Wording::Xpu) => " (XPU wording)",
        _ => "",
    };
    let _ = writeln!(o, "Out of memory{place}{from}");
    row(&mut o, "tried to allocate", bytes(n.requested_bytes));
    if n.backend != Backend::Cpu {
        row(&mut o, if n.total_is_limit { "allowed maximum" } else { "device total" }, b(n.total_bytes));
    }
    if !matches!(n.backend, Backend::Cpu | Backend::Mps) {
        row(&mut o, "device free", b(n.free_bytes));
    }
    if n.backend != Backend::Cpu {
        row(&mut o, "allocated (live tensors)", b(n.allocated_bytes));
    }
    if n.backend == Backend::Mps {
        row(&mut o, "other allocations", b(n.other_allocations_bytes));
    } else if n.backend != Backend::Cpu {
        row(&mut o, "reserved by PyTorch", b(d.reserved_bytes));
        row(&mut o, "reserved but unallocated", b(n.reserved_unallocated_bytes));
        if let Some(p) = n.process_bytes {
            let who = n.this_process_pid.map(|p| format!(" (pid {p})")).unwrap_or_default();
            row(&mut o, &format!("this process, all{who}"), bytes(p));
        }
        if let Some(np) = d.non_pytorch_bytes {
            row(&mut o, "this process, non-PyTorch", bytes(np));
        }
        if let Some(op) = d.other_processes_bytes {
            row(
                &mut o,
                if d.other_processes_at_least { "other processes, at least" } else { "other processes" },
                bytes(op),
            );
        }
        if !n.listed_processes.is_empty() {
            let _ = writeln!(o, "\nProcesses listed in the message");
            for (pid, by) in &n.listed_processes {
                let role = if Some(*pid) == n.this_process_pid {
                    "this process"
                } else if n.other_processes.iter().any(|p| p.0 == *pid) {
                    "other process"
                } else {
                    "this one or another (cannot tell)"
                };
                let _ = writeln!(o, "  pid {pid:<10} {:>12}  {role}", bytes(*by));
            }
        }
    }
    let _ = writeln!(o, "\nDiagnosis: {}", d.verdict);
    let _ = writeln!(o, "  {}", d.explanation);
    if !d.notes.is_empty() {
        let _ = writeln!(o, "\nNotes");
        for s in &d.notes {
            let _ = writeln!(o, "  - {s}");
        }
    }
    let _ = writeln!(o, "\nNext steps");
    for (i, s) in d.next_steps.iter().enumerate() {
        let _ = writeln!(o, "  {}. {s}", i + 1);
    }
    o
}

/// Finds every out-of-memory message of a log and explains each (a message that cannot be read gets
/// its error). Empty when the input has none.
pub fn explain_all(input: &str) -> Vec<Explained> {
    split_and_parse(input)
        .into_iter()
        .enumerate()
        .map(|(i, (line, rank, r))| Explained {
            message_index: i + 1,
            line,
            rank,
            result: match r {
                Ok(n) => ExplainedResult::Diagnosis(Box::new(diagnose(&n))),
                Err(error) => ExplainedResult::Error { error },
            },
        })
        .collect()
}

/// Renders the explanations of a whole log: one section per message when there are several.
pub fn render_all_text(all: &[Explained]) -> String {
    use std::fmt::Write;
    if let [one] = all {
        return match &one.result {
            ExplainedResult::Diagnosis(d) => render_text(d),
            ExplainedResult::Error { error } => {
                format!("The out-of-memory message at line {} cannot be read: {error}\n", one.line)
            }
        };
    }
    let mut o = String::new();
    let _ = writeln!(o, "{} out-of-memory messages in the input; each is explained on its own.", all.len());
    for e in all {
        let rank = e.rank.map(|r| format!(", rank {r}")).unwrap_or_default();
        let _ = writeln!(o, "\n=== Message {} of {} (line {}{rank}) ===", e.message_index, all.len(), e.line);
        match &e.result {
            ExplainedResult::Diagnosis(d) => o.push_str(&render_text(d)),
            ExplainedResult::Error { error } => {
                let _ = writeln!(o, "cannot be read: {error}");
            }
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    const MSG_2_11: &str = "CUDA out of memory. Tried to allocate 60.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 39.00 GiB is free. Including non-PyTorch memory, this process has 100.80 GiB memory in use. Of the allocated memory 100.06 GiB is allocated by PyTorch, and 1024.00 KiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";
    const OLD: &str = "CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; 130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) If reserved memory is >> allocated memory try setting max_split_size_mb";
    const CONTAINER: &str = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 2.50 GiB is free. Process 1111 has 20.00 GiB memory in use. Process 2222 has 36.60 GiB memory in use. Process 3333 has 20.05 GiB memory in use. Of the allocated memory 35.00 GiB is allocated by PyTorch, and 1.00 GiB is reserved by PyTorch but unallocated.";

    #[test]
    fn parses_2_11_message() {
        let n = parse_message(MSG_2_11).unwrap();
        assert_eq!(n.requested_bytes, 60 * GIB);
        assert_eq!(n.device, Some(0));
        assert_eq!(n.wording, Some(Wording::TorchGe2_2));
        assert_eq!(n.total_bytes, Some((139.80 * GIB as f64).round() as u64));
        assert_eq!(n.free_bytes, Some(39 * GIB));
        assert_eq!(n.reserved_unallocated_bytes, Some(1024 * 1024));
        assert_eq!(n.allocated_bytes, Some((100.06 * GIB as f64).round() as u64));
        let d = diagnose(&n);
        assert_eq!(d.verdict, "capacity");
        // usable = 100.06 + 0.001 + 39 = 139.06 GiB; needed = 160.06 GiB → 0.869 × 0.9 = 0.78 → 0.75
        assert_eq!(d.batch_factor, Some(0.75));
    }

    #[test]
    fn parses_old_and_2_1_messages() {
        let n = parse_message(OLD).unwrap();
        assert_eq!(n.requested_bytes, 36 << 20);
        assert_eq!(n.wording, Some(Wording::TorchLe2_0));
        assert_eq!(n.free_bytes, Some((47.06 * (1u64 << 20) as f64).round() as u64));
        assert_eq!(n.reserved_unallocated_bytes, Some((188u64 << 20) - (130.35 * (1u64 << 20) as f64).round() as u64));
        let d = diagnose(&n);
        assert_eq!(d.verdict, "fragmentation");
        assert!(d.next_steps[0].contains("max_split_size_mb"), "{:?}", d.next_steps);
        assert!(!d.next_steps[0].contains("expandable_segments"));
        let v21 = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacty of 79.15 GiB of which 1.50 GiB is free. Process 1234 has 20.00 GiB memory in use. Including non-PyTorch memory, this process has 57.60 GiB memory in use. Of the allocated memory 50.00 GiB is allocated by PyTorch, and 6.00 GiB is reserved by PyTorch but unallocated.";
        let n = parse_message(v21).unwrap();
        assert_eq!(n.wording, Some(Wording::Torch2_1));
        assert_eq!(n.other_processes, vec![(1234, 20 * GIB)]);
        assert_eq!(diagnose(&n).verdict, "fragmentation");
    }

    #[test]
    fn container_form_finds_this_process_and_counts_the_others() {
        let n = parse_message(CONTAINER).unwrap();
        assert_eq!(n.this_process_pid, Some(2222));
        assert_eq!(n.process_bytes, Some((36.60 * GIB as f64).round() as u64));
        assert_eq!(n.other_processes, vec![(1111, 20 * GIB), (3333, (20.05 * GIB as f64).round() as u64)]);
        let d = diagnose(&n);
        assert_eq!(d.verdict, "other_processes");
        let op = d.other_processes_bytes.unwrap();
        assert!(op.abs_diff((40.05 * GIB as f64) as u64) < 16, "{op}");
        let text = render_text(&d);
        assert!(text.contains("pid 1111") && text.contains("pid 2222") && text.contains("this process"), "{text}");
        // Both 40.00 and 36.60 GiB are ≥ the reserved 36 GiB: cannot tell which is this process, but the
        // other holds at least 36.60 GiB either way.
        let amb = CONTAINER
            .replace("Process 1111 has 20.00 GiB memory in use. ", "")
            .replace("Process 3333 has 20.05", "Process 1111 has 40.00");
        let n = parse_message(&amb).unwrap();
        assert_eq!(n.this_process_pid, None);
        assert!(n.this_process_note.as_deref().unwrap().contains("cannot tell"));
        let d = diagnose(&n);
        assert_eq!(
            (d.other_processes_bytes, d.other_processes_at_least),
            (Some((36.60 * GIB as f64).round() as u64), true)
        );
        assert_eq!(d.verdict, "other_processes");
        assert!(render_text(&d).contains("cannot tell"));
    }

    #[test]
    fn splits_messages_and_never_mixes_their_numbers() {
        let log = format!("{OLD}\nretry\n[rank1]: {MSG_2_11}\n");
        let all = split_and_parse(&log);
        assert_eq!(all.len(), 2);
        let a = all[0].2.as_ref().unwrap();
        let b = all[1].2.as_ref().unwrap();
        assert_eq!((a.requested_bytes, a.total_bytes), (36 << 20, Some((7.93 * GIB as f64).round() as u64)));
        assert_eq!(b.requested_bytes, 60 * GIB);
        assert_eq!((all[1].0, all[1].1), (3, Some(1)));
    }

    #[test]
    fn unknown_free_is_not_zero_and_impossible_numbers_are_flagged() {
        let xpu = "XPU out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 64.00 GiB. Of the allocated memory 60.00 GiB is allocated by PyTorch, and 1.50 GiB is reserved by PyTorch but unallocated. Please use `empty_cache` to release all unoccupied cached memory.";
        let n = parse_message(xpu).unwrap();
        assert_eq!((n.backend, n.free_bytes), (Backend::Xpu, None));
        let d = diagnose(&n);
        let text = render_text(&d);
        assert!(!text.contains("free 0 B"), "{text}");
        assert!(text.contains("unknown"), "{text}");
        let bad = MSG_2_11.replace("of which 39.00 GiB", "of which 239.00 GiB");
        assert!(diagnose(&parse_message(&bad).unwrap()).notes.iter().any(|s| s.contains("impossible")));
    }

    #[test]
    fn cpu_and_mps_messages() {
        let cpu = "RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to allocate 1099511627776 bytes.";
        let d = diagnose(&parse_message(cpu).unwrap());
        assert_eq!((d.numbers.requested_bytes, d.verdict.as_str()), (1 << 40, "host_memory"));
        let mps = "RuntimeError: MPS backend out of memory (MPS allocated: 18.04 GB, other allocations: 2.05 MB, max allowed: 18.13 GB). Tried to allocate 256.00 MB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may cause system failure).";
        let n = parse_message(mps).unwrap();
        assert_eq!(n.requested_bytes, 256 << 20);
        assert_eq!(n.allocated_bytes, Some((18.04 * GIB as f64).round() as u64));
        assert_eq!(diagnose(&n).verdict, "mps_limit");
    }

    #[test]
    fn rejects_non_oom_text() {
        assert!(parse_message("hello").unwrap_err().contains("out-of-memory"));
        assert!(parse_message("CUDA out of memory.").unwrap_err().contains("Tried to allocate"));
    }
}
