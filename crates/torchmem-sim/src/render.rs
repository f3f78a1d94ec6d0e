//! Text and JSON output of a simulation: per device the peaks, the device calls, retries, the OOM (where,
//! what was live) and the verdict against the recording; `--min-memory` and `--compare` tables.

use std::fmt::Write;

use serde_json::{json, Value};
use torchmem_snapshot::fmt::bytes;

use crate::allocator::SegEvent;
use crate::replay::DeviceResult;
use crate::search::{CompareRow, MinMemory};
use crate::SimResult;

fn event_text(e: &Option<SegEvent>) -> String {
    match e {
        Some(e) => format!("{} {} at {:#x} (entry {})", e.kind.name(), bytes(e.size_bytes), e.addr, e.entry),
        None => "nothing".into(),
    }
}

/// The verdict line against the recording.
pub fn verdict(d: &DeviceResult) -> String {
    match &d.comparison {
        None => "settings differ from the recording: nothing to check against".into(),
        Some(c) if c.matches => format!("replay matches the recording ({} segment events)", c.segment_events),
        Some(c) => match &c.divergence {
            Some(dv) => format!(
                "replay diverges from the recording at entry {} (segment event {}): expected {}, got {} — {}",
                dv.entry,
                dv.event_index,
                event_text(&dv.expected),
                event_text(&dv.got),
                dv.what
            ),
            None => format!(
                "replay has the recorded segment events but peak reserved {} != recorded {}",
                bytes(d.peak_reserved_bytes),
                bytes(c.recorded_peak_reserved_bytes)
            ),
        },
    }
}

pub fn device_text(d: &DeviceResult, out: &mut String) {
    let as_recorded = if d.settings == d.recorded_settings { " (as recorded)" } else { "" };
    let _ = writeln!(out, "device {}: {} trace entries, settings: {}{as_recorded}", d.device, d.entries, d.settings);
    if let Some(l) = d.memory_limit_bytes {
        let _ = writeln!(out, "  memory limit:          {}", bytes(l));
    }
    if let Some(m) = d.device_memory_bytes {
        let _ = writeln!(out, "  device memory:         {}", bytes(m));
    }
    let _ = writeln!(out, "  peak allocated:        {}", bytes(d.peak_allocated_bytes));
    let _ = writeln!(out, "  peak reserved:         {}", bytes(d.peak_reserved_bytes));
    let _ =
        writeln!(out, "  reserved, unallocated: {} at the reserved peak", bytes(d.reserved_unallocated_at_peak_bytes));
    if d.num_map + d.num_unmap > 0 {
        let _ = writeln!(out, "  page maps / unmaps:    {} / {}", d.num_map, d.num_unmap);
    }
    if d.num_cuda_malloc + d.num_cuda_free > 0 || d.num_map + d.num_unmap == 0 {
        let _ = writeln!(out, "  cudaMalloc / cudaFree: {} / {}", d.num_cuda_malloc, d.num_cuda_free);
    }
    let _ = writeln!(out, "  alloc retries:         {}", d.num_alloc_retries);
    match &d.oom {
        None => {
            let _ = writeln!(out, "  out of memory:         no");
        }
        Some(o) => {
            let why = if o.failure.over_memory_limit { "over the memory limit" } else { "the device is full" };
            let _ = writeln!(
                out,
                "  OUT OF MEMORY at entry {} ({} into the trace): {} requested ({} rounded, a {} segment), {why}; {} allocated, \
                 {} reserved{}",
                o.entry,
                torchmem_snapshot::fmt::since_start(o.time_us, o.trace_start_us),
                bytes(o.failure.requested_bytes),
                bytes(o.failure.rounded_bytes),
                bytes(o.failure.segment_bytes),
                bytes(o.failure.allocated_bytes),
                bytes(o.failure.reserved_bytes),
                if o.recorded { " (the recording failed here too)" } else { "" }
            );
            for f in o.frames.iter().take(8) {
                let _ = writeln!(out, "      at {f}");
            }
            if !o.largest_live.is_empty() {
                let _ = writeln!(out, "    {} live blocks; the largest:", o.live_blocks);
                for b in &o.largest_live {
                    let from = match (&b.entry, &b.frame) {
                        (Some(e), Some(f)) => format!("entry {e}, {f}"),
                        (Some(e), None) => format!("entry {e}"),
                        _ => "before the trace".into(),
                    };
                    let _ = writeln!(out, "      {:>10}  {from}", bytes(b.size_bytes));
                }
            }
        }
    }
    let _ = writeln!(out, "  {}", verdict(d));
    for n in &d.notes {
        let _ = writeln!(out, "  note: {n}");
    }
}

pub fn text(r: &SimResult) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}: allocator simulation ({} rules)", r.file, r.rules);
    if let Some(n) = &r.version_note {
        let _ = writeln!(out, "note: {n}");
    }
    for d in &r.devices {
        device_text(d, &mut out);
    }
    for x in &r.refused {
        let _ = writeln!(out, "device {}: not simulated: {}", x.device, x.reason);
    }
    if r.devices.is_empty() && r.refused.is_empty() {
        let _ = writeln!(out, "the snapshot has no trace and no segments: nothing to simulate");
    }
    out
}

fn oom_json(d: &DeviceResult) -> Value {
    match &d.oom {
        None => Value::Null,
        Some(o) => serde_json::to_value(o).unwrap_or(Value::Null),
    }
}

/// JSON of one device, with the contract fields at the top.
pub fn device_json(d: &DeviceResult) -> Value {
    let mut v = serde_json::to_value(d).unwrap_or(Value::Null);
    v["oom"] = oom_json(d);
    v["matches_recording"] = match &d.comparison {
        None => Value::Null,
        Some(c) => Value::Bool(c.matches),
    };
    v["verdict"] = Value::String(verdict(d));
    v
}

/// The whole result: the first device's fields at the top (`peak_allocated_bytes`, `peak_reserved_bytes`,
/// `num_alloc_retries`, `oom`, `matches_recording`, `settings`), every device under `devices`.
pub fn json(r: &SimResult) -> Value {
    let devices: Vec<Value> = r.devices.iter().map(device_json).collect();
    let mut top = devices.first().cloned().unwrap_or_else(|| json!({}));
    top["file"] = json!(r.file);
    top["rules"] = json!(r.rules);
    top["version_note"] = json!(r.version_note);
    top["refused"] = serde_json::to_value(&r.refused).unwrap_or(Value::Null);
    top["devices"] = Value::Array(devices);
    top
}

pub fn min_memory_text(device: i64, rows: &[MinMemory]) -> String {
    let mut out = String::new();
    let parts: Vec<String> = rows
        .iter()
        .map(|m| {
            let need = match m.min_memory_bytes {
                Some(b) => format!("needs {}", bytes(b)),
                None => "does not fit even without a limit".into(),
            };
            if m.settings == "default" {
                need
            } else {
                format!("with {} {need}", m.settings)
            }
        })
        .collect();
    let _ = writeln!(out, "device {device}: {}", parts.join("; "));
    out
}

pub fn compare_text(device: i64, rows: &[CompareRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "device {device}:");
    let _ = writeln!(
        out,
        "  {:<52} {:>11} {:>11} {:>11} {:>8} {:>7} {:>5} {:>11}",
        "settings", "peak alloc", "peak resv", "unalloc", "malloc", "retries", "OOM", "min memory"
    );
    for r in rows {
        let d = &r.result;
        let _ = writeln!(
            out,
            "  {:<52} {:>11} {:>11} {:>11} {:>8} {:>7} {:>5} {:>11}",
            r.settings,
            bytes(d.peak_allocated_bytes),
            bytes(d.peak_reserved_bytes),
            bytes(d.reserved_unallocated_at_peak_bytes),
            d.num_cuda_malloc + d.num_map,
            d.num_alloc_retries,
            if d.oom.is_some() { "yes" } else { "no" },
            r.min_memory_bytes.map(bytes).unwrap_or_else(|| "-".into())
        );
    }
    out
}
