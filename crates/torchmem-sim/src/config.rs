//! The allocator's settings: parsing a `PYTORCH_CUDA_ALLOC_CONF` / `PYTORCH_ALLOC_CONF` string the way
//! torch 2.11 does (keys, bounds, the per-interval `roundup_power2_divisions` form, the reset of every
//! `parseArgs` call), and reading the settings a snapshot recorded (`allocator_settings`).

use serde::Serialize;

use crate::rounding::MB_BYTES;

/// Number of `roundup_power2_divisions` intervals: [1 MiB, 2 MiB), …, [32 GiB, ∞) — index `log2(size) - 20`.
pub const ROUNDUP_INTERVALS: usize = 16;
/// Default `large_segment_size` (the old `kLargeBuffer`): segment size for 1–10 MiB requests, and the
/// large pool's page size under expandable segments.
pub const DEFAULT_LARGE_SEGMENT_BYTES: u64 = 20 * MB_BYTES;

/// Everything of the configuration that changes allocator decisions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocConf {
    pub expandable_segments: bool,
    /// `max_split_size_mb` in bytes; `u64::MAX` when unset (nothing is "oversize").
    pub max_split_size_bytes: u64,
    /// `max_non_split_rounding_mb` in bytes (default 20 MiB).
    pub max_non_split_rounding_bytes: u64,
    /// `large_segment_size_mb` in bytes (default 20 MiB).
    pub large_segment_size_bytes: u64,
    /// Divisions per interval (0 or 1: plain 512-byte rounding).
    pub roundup_power2_divisions: [u64; ROUNDUP_INTERVALS],
    /// `garbage_collection_threshold` (0: off). Active only with a memory fraction.
    pub garbage_collection_threshold: f64,
    /// `per_process_memory_fraction` from the string (the same effect as `set_per_process_memory_fraction`).
    pub per_process_memory_fraction: Option<f64>,
}

impl Default for AllocConf {
    fn default() -> Self {
        AllocConf {
            expandable_segments: false,
            max_split_size_bytes: u64::MAX,
            max_non_split_rounding_bytes: 20 * MB_BYTES,
            large_segment_size_bytes: DEFAULT_LARGE_SEGMENT_BYTES,
            roundup_power2_divisions: [0; ROUNDUP_INTERVALS],
            garbage_collection_threshold: 0.0,
            per_process_memory_fraction: None,
        }
    }
}

/// A configuration string that torch would reject (or that the simulator cannot honour).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("alloc conf {conf:?}: {msg}")]
pub struct ConfError {
    pub conf: String,
    pub msg: String,
}

impl AllocConf {
    /// Parses a `PYTORCH_CUDA_ALLOC_CONF` string ("" is the default). Keys torch accepts but that do not change
    /// the caching allocator's decisions (pinned-memory and lock keys) are accepted and ignored;
    /// `backend:cudaMallocAsync` is refused (a different allocator).
    pub fn parse(conf: &str) -> Result<AllocConf, ConfError> {
        let err = |msg: String| ConfError { conf: conf.to_string(), msg };
        let mut c = AllocConf::default();
        for item in split_top_level(conf) {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            let (key, value) = match item.split_once(':') {
                Some((k, v)) => (k.trim(), v.trim()),
                None => return Err(err(format!("{item:?} is not KEY:VALUE (e.g. expandable_segments:True)"))),
            };
            match key {
                "expandable_segments" => c.expandable_segments = parse_bool(value).map_err(err)?,
                "max_split_size_mb" => {
                    let mb = parse_u64(key, value).map_err(err)?;
                    if mb * MB_BYTES < c.large_segment_size_bytes {
                        return Err(err(format!(
                            "max_split_size_mb must be at least {} (large_segment_size_mb); got {mb}",
                            c.large_segment_size_bytes / MB_BYTES
                        )));
                    }
                    c.max_split_size_bytes = mb.saturating_mul(MB_BYTES);
                }
                "max_non_split_rounding_mb" => {
                    let mb = parse_u64(key, value).map_err(err)?;
                    if mb * MB_BYTES < c.large_segment_size_bytes {
                        return Err(err(format!("max_non_split_rounding_mb must be at least 20; got {mb}")));
                    }
                    c.max_non_split_rounding_bytes = mb.saturating_mul(MB_BYTES);
                }
                "large_segment_size_mb" => {
                    let mb = parse_u64(key, value).map_err(err)?;
                    if mb == 0 || mb % 2 != 0 {
                        return Err(err(format!("large_segment_size_mb must be a positive multiple of 2; got {mb}")));
                    }
                    c.large_segment_size_bytes = mb * MB_BYTES;
                }
                "garbage_collection_threshold" => {
                    let t: f64 = value
                        .parse()
                        .map_err(|_| err(format!("garbage_collection_threshold {value:?} is not a number")))?;
                    if !(t > 0.0 && t < 1.0) {
                        return Err(err(format!("garbage_collection_threshold must be in (0, 1); got {value}")));
                    }
                    c.garbage_collection_threshold = t;
                }
                "per_process_memory_fraction" => {
                    let f: f64 = value
                        .parse()
                        .map_err(|_| err(format!("per_process_memory_fraction {value:?} is not a number")))?;
                    if !(0.0..=1.0).contains(&f) {
                        return Err(err(format!("per_process_memory_fraction must be in [0, 1]; got {value}")));
                    }
                    c.per_process_memory_fraction = Some(f);
                }
                "roundup_power2_divisions" => {
                    c.roundup_power2_divisions = parse_roundup(value).map_err(err)?;
                }
                "backend" => {
                    if value != "native" {
                        return Err(err(format!(
                            "backend:{value} is not the caching allocator; the simulator models backend:native only"
                        )));
                    }
                }
                "release_lock_on_cudamalloc"
                | "pinned_use_cuda_host_register"
                | "pinned_num_register_threads"
                | "pinned_use_background_threads"
                | "pinned_reserve_segment_size_mb"
                | "graph_capture_record_stream_reuse" => {}
                other => {
                    return Err(err(format!(
                        "unknown key {other:?}; known: expandable_segments, max_split_size_mb, \
                         max_non_split_rounding_mb, roundup_power2_divisions, garbage_collection_threshold, \
                         large_segment_size_mb, per_process_memory_fraction"
                    )))
                }
            }
        }
        Ok(c)
    }

    /// The settings a snapshot recorded (`allocator_settings`: `max_split_size` -1 when unset, the 16-entry
    /// `roundup_power2_divisions` table keyed by the interval's start in MiB, …). Returns the settings and the
    /// recorded configuration string.
    pub fn from_snapshot(settings: &serde_json::Map<String, serde_json::Value>) -> (AllocConf, String) {
        let mut c = AllocConf::default();
        let conf_str = ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"]
            .iter()
            .filter_map(|k| settings.get(*k).and_then(|v| v.as_str()))
            .find(|s| !s.is_empty())
            .unwrap_or("")
            .to_string();
        if let Some(v) = settings.get("expandable_segments").and_then(|v| v.as_bool()) {
            c.expandable_segments = v;
        }
        if let Some(v) = settings.get("max_split_size").and_then(|v| v.as_i64()) {
            if v > 0 {
                c.max_split_size_bytes = v as u64;
            }
        }
        if let Some(v) = settings.get("garbage_collection_threshold").and_then(|v| v.as_f64()) {
            c.garbage_collection_threshold = v;
        }
        if let Some(v) = settings.get("max_non_split_rounding_size").and_then(|v| v.as_i64()) {
            if v > 0 {
                c.max_non_split_rounding_bytes = v as u64;
            }
        }
        if let Some(v) = settings.get("large_segment_size").and_then(|v| v.as_i64()) {
            if v > 0 {
                c.large_segment_size_bytes = v as u64;
            }
        }
        if let Some(table) = settings.get("roundup_power2_divisions").and_then(|v| v.as_object()) {
            for (k, v) in table {
                let (Ok(mb), Some(d)) = (k.parse::<u64>(), v.as_u64()) else { continue };
                if mb.is_power_of_two() {
                    let idx = (mb.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
                    c.roundup_power2_divisions[idx] = d;
                }
            }
        }
        // Keys the snapshot does not carry (max_non_split_rounding, large_segment_size) come from the string.
        if let Ok(parsed) = AllocConf::parse(&conf_str) {
            if settings.get("max_non_split_rounding_size").is_none() {
                c.max_non_split_rounding_bytes = parsed.max_non_split_rounding_bytes;
            }
            if settings.get("large_segment_size").is_none() {
                c.large_segment_size_bytes = parsed.large_segment_size_bytes;
            }
            c.per_process_memory_fraction = parsed.per_process_memory_fraction;
        }
        (c, conf_str)
    }

    /// A short human description ("default", "expandable_segments, max_split_size_mb:64", …).
    pub fn describe(&self) -> String {
        let d = AllocConf::default();
        let mut parts = Vec::new();
        if self.expandable_segments {
            parts.push("expandable_segments:True".to_string());
        }
        if self.max_split_size_bytes != d.max_split_size_bytes {
            parts.push(format!("max_split_size_mb:{}", self.max_split_size_bytes / MB_BYTES));
        }
        if self.max_non_split_rounding_bytes != d.max_non_split_rounding_bytes {
            parts.push(format!("max_non_split_rounding_mb:{}", self.max_non_split_rounding_bytes / MB_BYTES));
        }
        if self.large_segment_size_bytes != d.large_segment_size_bytes {
            parts.push(format!("large_segment_size_mb:{}", self.large_segment_size_bytes / MB_BYTES));
        }
        if self.roundup_power2_divisions != d.roundup_power2_divisions {
            let t = &self.roundup_power2_divisions;
            if t.iter().all(|&x| x == t[0]) {
                parts.push(format!("roundup_power2_divisions:{}", t[0]));
            } else {
                let items: Vec<String> = t.iter().enumerate().map(|(i, x)| format!("{}:{x}", 1u64 << i)).collect();
                parts.push(format!("roundup_power2_divisions:[{}]", items.join(",")));
            }
        }
        if self.garbage_collection_threshold > 0.0 {
            parts.push(format!("garbage_collection_threshold:{}", self.garbage_collection_threshold));
        }
        if let Some(f) = self.per_process_memory_fraction {
            parts.push(format!("per_process_memory_fraction:{f}"));
        }
        if parts.is_empty() {
            "default".into()
        } else {
            parts.join(",")
        }
    }
}

/// Splits on commas outside `[...]`.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, ch) in s.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

fn parse_bool(v: &str) -> Result<bool, String> {
    match v {
        "True" | "true" | "1" => Ok(true),
        "False" | "false" | "0" => Ok(false),
        _ => Err(format!("expected True or False, got {v:?}")),
    }
}

fn parse_u64(key: &str, v: &str) -> Result<u64, String> {
    v.parse::<u64>().map_err(|_| format!("{key} {v:?} is not a whole number of MiB"))
}

fn parse_division(v: &str) -> Result<u64, String> {
    let d = v.trim().parse::<u64>().map_err(|_| format!("roundup_power2_divisions value {v:?} is not a number"))?;
    if d != 0 && !d.is_power_of_two() {
        return Err(format!("roundup_power2_divisions values must be 0 or a power of two; got {d}"));
    }
    Ok(d)
}

/// `4` (every interval) or `[256:1,512:2,>:8]`: each boundary (MiB, a power of two) sets its interval, the
/// first one also every interval below it, and `>` every interval after the last boundary.
fn parse_roundup(v: &str) -> Result<[u64; ROUNDUP_INTERVALS], String> {
    let mut t = [0u64; ROUNDUP_INTERVALS];
    let v = v.trim();
    if let Some(inner) = v.strip_prefix('[') {
        let inner = inner.strip_suffix(']').ok_or_else(|| format!("{v:?}: missing ']'"))?;
        let mut last: Option<usize> = None;
        for part in inner.split(',') {
            let (k, val) = part.split_once(':').ok_or_else(|| format!("{part:?} is not BOUNDARY:DIVISIONS"))?;
            let d = parse_division(val)?;
            let k = k.trim();
            if k == ">" {
                let from = last.map(|l| l + 1).unwrap_or(0);
                for x in t.iter_mut().skip(from) {
                    *x = d;
                }
                continue;
            }
            let mb = k.parse::<u64>().map_err(|_| format!("boundary {k:?} is not a number of MiB"))?;
            if !mb.is_power_of_two() {
                return Err(format!("boundary {mb} must be a power of two (MiB)"));
            }
            let idx = (mb.trailing_zeros() as usize).min(ROUNDUP_INTERVALS - 1);
            if let Some(l) = last {
                if idx <= l {
                    return Err(format!("boundaries must increase; {mb} after a larger one"));
                }
            } else {
                for x in t.iter_mut().take(idx) {
                    *x = d;
                }
            }
            t[idx] = d;
            last = Some(idx);
        }
    } else {
        let d = parse_division(v)?;
        t = [d; ROUNDUP_INTERVALS];
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_string_is_default() {
        assert_eq!(AllocConf::parse("").unwrap(), AllocConf::default());
        assert_eq!(AllocConf::default().describe(), "default");
    }

    #[test]
    fn keys() {
        let c =
            AllocConf::parse("expandable_segments:True,max_split_size_mb:64,garbage_collection_threshold:0.6").unwrap();
        assert!(c.expandable_segments);
        assert_eq!(c.max_split_size_bytes, 64 << 20);
        assert_eq!(c.garbage_collection_threshold, 0.6);
    }

    #[test]
    fn bounds_are_refused() {
        assert!(AllocConf::parse("max_split_size_mb:10").is_err());
        assert!(AllocConf::parse("garbage_collection_threshold:1.5").is_err());
        assert!(AllocConf::parse("roundup_power2_divisions:3").is_err());
        assert!(AllocConf::parse("nonsense:1").unwrap_err().msg.contains("unknown key"));
        assert!(AllocConf::parse("backend:cudaMallocAsync").is_err());
    }

    #[test]
    fn roundup_single_and_intervals() {
        assert_eq!(AllocConf::parse("roundup_power2_divisions:4").unwrap().roundup_power2_divisions, [4; 16]);
        let t = AllocConf::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").unwrap().roundup_power2_divisions;
        let mut want = [8u64; 16];
        for x in want.iter_mut().take(9) {
            *x = 1;
        }
        want[9] = 2;
        want[10] = 4;
        assert_eq!(t, want);
    }
}
