//! Byte, time and HTML-text formatting shared by every report.

const KIB: f64 = 1024.0;
const MIB: f64 = 1024.0 * 1024.0;
const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Human-readable bytes in binary units: `512 B`, `3.0 KiB`, `120.5 MiB`, `1.25 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else if b >= MIB {
        format!("{:.1} MiB", b / MIB)
    } else if b >= KIB {
        format!("{:.1} KiB", b / KIB)
    } else {
        format!("{bytes} B")
    }
}

/// Signed variant for deltas: `+64.0 MiB`, `-1.0 GiB`, `0 B`.
pub fn format_delta(delta: i64) -> String {
    if delta == 0 {
        return "0 B".to_string();
    }
    let sign = if delta > 0 { "+" } else { "-" };
    format!("{sign}{}", format_bytes(delta.unsigned_abs()))
}

/// Optional bytes: `-` when the value does not exist (no GPU, not measured).
pub fn format_opt_bytes(bytes: Option<u64>) -> String {
    bytes.map(format_bytes).unwrap_or_else(|| "-".to_string())
}

/// Escapes text for HTML/XML content and attribute values.
pub fn escape_html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            _ => out.push(c),
        }
    }
    out
}

/// Seconds from nanoseconds with millisecond precision.
pub fn format_secs(ns: u64) -> String {
    format!("{:.3} s", ns as f64 / 1e9)
}

/// A duration as `format_secs` writes it (`0.012 s`), or in microseconds below a millisecond (`84.2 µs`): a
/// phase of a fast step takes microseconds, which `format_secs` would show as `0.000 s`.
pub fn format_duration(ns: u64) -> String {
    if ns >= 1_000_000 {
        format_secs(ns)
    } else {
        format!("{:.1} µs", ns as f64 / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_pick_their_unit() {
        assert_eq!(format_duration(84_200), "84.2 µs");
        assert_eq!(format_duration(12_345_678), "0.012 s");
        assert_eq!(format_duration(1_234_000_000), "1.234 s");
        assert_eq!(format_duration(0), "0.0 µs");
    }

    #[test]
    fn formats_binary_units() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(64 * 1024 * 1024), "64.0 MiB");
        assert_eq!(format_bytes(3 * 1024 * 1024 * 1024 / 2), "1.50 GiB");
        assert_eq!(format_delta(-64 * 1024 * 1024), "-64.0 MiB");
        assert_eq!(format_delta(2048), "+2.0 KiB");
        assert_eq!(format_opt_bytes(None), "-");
    }
}
