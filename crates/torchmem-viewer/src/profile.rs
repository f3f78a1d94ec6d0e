//! A `torchmem run` profile as the viewer sees it: CPU and GPU memory series (RSS, NVML used, PyTorch's
//! allocated and reserved per device) and the epoch / step / phase lanes, queried per window as per-column
//! min/max envelopes so a long run costs the page the same as a short one.

use std::collections::HashMap;

use serde_json::{json, Value};
use torchmem_core::model::{Edge, MarkerKind, Profile};

/// One series: sample times (ns from the run's first sample) and values (bytes).
pub struct Series {
    pub name: String,
    pub t_ns: Vec<u64>,
    pub bytes: Vec<u64>,
}

/// A span of a lane (an epoch, a step, a phase) or a point mark (`t1_ns == t0_ns`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Span {
    pub lane: &'static str,
    pub name: String,
    pub t0_ns: u64,
    pub t1_ns: u64,
    pub peak_allocated_bytes: Option<u64>,
}

pub struct ProfileView {
    pub command: String,
    /// Wall clock (Unix µs) of the view's time 0 (the run's first sample), to line it up with snapshots.
    pub start_unix_us: i64,
    pub series: Vec<Series>,
    pub spans: Vec<Span>,
    pub end_ns: u64,
}

impl ProfileView {
    pub fn build(p: &Profile) -> ProfileView {
        let t_first = p
            .cpu
            .first()
            .map(|s| s.t_ns)
            .into_iter()
            .chain(p.gpu.first().map(|s| s.t_ns))
            .chain(p.torch.first().map(|s| s.t_ns))
            .chain(p.markers.first().map(|m| m.t_ns))
            .min()
            .unwrap_or(0);
        let rel = |t: u64| t.saturating_sub(t_first);
        let mut series = vec![Series {
            name: "CPU RSS (process tree)".into(),
            t_ns: p.cpu.iter().map(|s| rel(s.t_ns)).collect(),
            bytes: p.cpu.iter().map(|s| s.rss_bytes).collect(),
        }];
        let mut gpu: HashMap<u32, Series> = HashMap::new();
        for s in &p.gpu {
            let e = gpu.entry(s.device).or_insert_with(|| Series {
                name: format!("GPU {} used (NVML)", s.device),
                t_ns: vec![],
                bytes: vec![],
            });
            e.t_ns.push(rel(s.t_ns));
            e.bytes.push(s.used_bytes);
        }
        let mut torch: HashMap<(u32, bool), Series> = HashMap::new();
        for s in &p.torch {
            for reserved in [false, true] {
                let e = torch.entry((s.device, reserved)).or_insert_with(|| Series {
                    name: format!("GPU {} {}", s.device, if reserved { "reserved" } else { "allocated" }),
                    t_ns: vec![],
                    bytes: vec![],
                });
                e.t_ns.push(rel(s.t_ns));
                e.bytes.push(if reserved { s.reserved_bytes } else { s.allocated_bytes });
            }
        }
        let mut g: Vec<_> = gpu.into_iter().collect();
        g.sort_by_key(|(d, _)| *d);
        series.extend(g.into_iter().map(|(_, s)| s));
        let mut t: Vec<_> = torch.into_iter().collect();
        t.sort_by_key(|(k, _)| *k);
        series.extend(t.into_iter().map(|(_, s)| s));
        series.retain(|s| !s.t_ns.is_empty());
        let mut open: HashMap<(MarkerKind, String, u32), Vec<u64>> = HashMap::new();
        let mut spans = Vec::new();
        for m in &p.markers {
            let lane = m.kind.as_str();
            let key = (m.kind, m.name.clone(), m.origin.pid.unwrap_or(0));
            let name = match m.index {
                Some(i) => format!("{} {i}", m.name),
                None => m.name.clone(),
            };
            match m.edge {
                Edge::Start => open.entry(key).or_default().push(rel(m.t_ns)),
                Edge::End => {
                    if let Some(t0) = open.get_mut(&key).and_then(Vec::pop) {
                        spans.push(Span {
                            lane,
                            name,
                            t0_ns: t0,
                            t1_ns: rel(m.t_ns),
                            peak_allocated_bytes: m.memory.peak_allocated_bytes,
                        });
                    }
                }
                Edge::Point => {
                    spans.push(Span { lane, name, t0_ns: rel(m.t_ns), t1_ns: rel(m.t_ns), peak_allocated_bytes: None })
                }
            }
        }
        spans.sort_by_key(|s| s.t0_ns);
        let end_ns = series
            .iter()
            .filter_map(|s| s.t_ns.last().copied())
            .chain(spans.iter().map(|s| s.t1_ns))
            .max()
            .unwrap_or(1)
            .max(1);
        let start_unix_us = (p.meta.started_unix_s * 1e6) as i64 + (t_first / 1000) as i64;
        ProfileView { command: p.meta.command.join(" "), start_unix_us, series, spans, end_ns }
    }

    /// The wall clock (Unix µs) of a view time (ns from the first sample).
    pub fn unix_us(&self, t_ns: u64) -> i64 {
        self.start_unix_us + (t_ns / 1000) as i64
    }

    /// Per-column max/min of every series over [t0_ns, t1_ns), and the spans that overlap it (spans
    /// narrower than a column merged into their neighbour: at most a few per column).
    pub fn query(&self, t0_ns: f64, t1_ns: f64, cols: usize) -> Value {
        let cols = cols.clamp(1, 8192);
        let t1_ns = t1_ns.max(t0_ns + 1.0);
        let per_col = (t1_ns - t0_ns) / cols as f64;
        let series: Vec<Value> = self
            .series
            .iter()
            .map(|s| {
                let mut max: Vec<Option<u64>> = vec![None; cols];
                let mut min: Vec<Option<u64>> = vec![None; cols];
                let lo = s.t_ns.partition_point(|&t| (t as f64) < t0_ns);
                let hi = s.t_ns.partition_point(|&t| (t as f64) < t1_ns);
                for i in lo.saturating_sub(1)..(hi + 1).min(s.t_ns.len()) {
                    let c = (((s.t_ns[i] as f64 - t0_ns) / per_col).floor().max(0.0) as usize).min(cols - 1);
                    let v = s.bytes[i];
                    max[c] = Some(max[c].map_or(v, |m| m.max(v)));
                    min[c] = Some(min[c].map_or(v, |m| m.min(v)));
                }
                json!({"name": s.name, "max": max, "min": min})
            })
            .collect();
        let mut spans: Vec<&Span> = Vec::new();
        let mut last_px: HashMap<&str, i64> = HashMap::new();
        for s in self.spans.iter().filter(|s| (s.t1_ns as f64) >= t0_ns && (s.t0_ns as f64) <= t1_ns) {
            let px = ((s.t0_ns as f64 - t0_ns) / per_col).floor() as i64;
            let px1 = ((s.t1_ns as f64 - t0_ns) / per_col).floor() as i64;
            let last = last_px.entry(s.lane).or_insert(i64::MIN);
            // Phases and steps shorter than a pixel column: one per column is enough.
            if px1 <= *last && s.lane != "epoch" {
                continue;
            }
            *last = px1.max(px);
            spans.push(s);
        }
        json!({"t0": t0_ns, "t1": t1_ns, "cols": cols, "series": series, "spans": spans})
    }
}
