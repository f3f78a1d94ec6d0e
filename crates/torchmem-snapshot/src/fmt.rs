//! Byte and time formatting shared by the text reports (binary units, like PyTorch's messages).

/// Formats bytes as PyTorch does: B, KiB, MiB, GiB, TiB with two decimals.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

/// Signed bytes (for diffs).
pub fn signed_bytes(n: i64) -> String {
    if n < 0 {
        format!("-{}", bytes(n.unsigned_abs()))
    } else {
        format!("+{}", bytes(n as u64))
    }
}

/// Percent with one decimal; 0 when the whole is 0.
pub fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        (part as f64) * 100.0 / (whole as f64)
    }
}

/// A moment as time since the trace start (`start_us`): `+12.345 ms`, or `+12.345 s` from 10 s on.
pub fn since_start(time_us: i64, start_us: i64) -> String {
    let d_us = time_us - start_us;
    let sign = if d_us < 0 { "-" } else { "+" };
    let a = d_us.unsigned_abs() as f64;
    if a >= 10_000_000.0 {
        format!("{sign}{:.3} s", a / 1e6)
    } else {
        format!("{sign}{:.3} ms", a / 1e3)
    }
}

/// A duration in microseconds as ms (or s from 10 s on), three decimals.
pub fn duration_us(d_us: i64) -> String {
    since_start(d_us, 0).trim_start_matches('+').to_string()
}

/// Escapes text for HTML.
pub fn html_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_pytorch() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1024 * 1024), "1.00 MiB");
        assert_eq!(bytes(64424509440), "60.00 GiB");
        assert_eq!(signed_bytes(-2048), "-2.00 KiB");
        assert_eq!(since_start(1_000_012_345, 1_000_000_000), "+12.345 ms");
        assert_eq!(since_start(1_012_000_000, 1_000_000_000), "+12.000 s");
        assert_eq!(since_start(5, 10), "-0.005 ms");
        assert_eq!(duration_us(2500), "2.500 ms");
    }
}
