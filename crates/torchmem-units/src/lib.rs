//! The one place torchmem turns bytes, durations and text into what people read: binary byte units in the
//! two styles torchmem prints (its reports' `64.0 MiB`, and the allocator's `64.00 MiB` that snapshot views
//! share with PyTorch's own messages and `_memory_viz`), signed deltas, seconds, and the HTML/XML escaper of
//! every page; and the one parser of sizes people type (`parse_size`: `14g`, `24GB`, `512MiB`, a byte count),
//! which the CLI's flags, `torchmem.simulate()`, `torchmem.estimate()` and the pytest plugin's markers share
//! (through `_native.parse_size`), so a size means the same everywhere. Every crate uses these (core's `units` and the snapshot crate's `fmt` re-export them); no
//! crate keeps its own copy.

/// How many decimals each binary unit gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteStyle {
    /// torchmem's reports: `512 B`, `3.0 KiB`, `120.5 MiB`, `1.25 GiB` (GiB is the largest unit).
    Report,
    /// PyTorch's allocator messages: two decimals in every unit up to TiB (`20.00 MiB`, `60.00 GiB`).
    Torch,
}

const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];

/// Bytes in binary units, in `style`.
pub fn format_bytes_in(bytes: u64, style: ByteStyle) -> String {
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let largest = match style {
        ByteStyle::Report => 3,
        ByteStyle::Torch => UNITS.len() - 1,
    };
    // Dividing by 1024 is exact in binary floating point: v / 1024 / 1024 == v / 1024².
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < largest {
        v /= 1024.0;
        unit += 1;
    }
    let decimals = match (style, unit) {
        (ByteStyle::Report, 1 | 2) => 1,
        _ => 2,
    };
    format!("{v:.decimals$} {}", UNITS[unit])
}

/// Human-readable bytes as torchmem's reports print them: `512 B`, `3.0 KiB`, `120.5 MiB`, `1.25 GiB`.
pub fn format_bytes(bytes: u64) -> String {
    format_bytes_in(bytes, ByteStyle::Report)
}

/// Bytes as PyTorch's allocator messages print them: `512 B`, `1.00 MiB`, `60.00 GiB`, `1.50 TiB`.
pub fn format_bytes_torch(bytes: u64) -> String {
    format_bytes_in(bytes, ByteStyle::Torch)
}

/// Signed variant for deltas: `+64.0 MiB`, `-1.0 GiB`, `0 B`.
pub fn format_delta(delta: i64) -> String {
    if delta == 0 {
        return "0 B".to_string();
    }
    format_signed(delta, ByteStyle::Report)
}

/// Signed bytes in PyTorch's style, zero counted as growth (`+0 B`, `-2.00 KiB`): snapshot diffs.
pub fn format_delta_torch(delta: i64) -> String {
    format_signed(delta, ByteStyle::Torch)
}

fn format_signed(delta: i64, style: ByteStyle) -> String {
    let sign = if delta < 0 { "-" } else { "+" };
    format!("{sign}{}", format_bytes_in(delta.unsigned_abs(), style))
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

/// The smallest byte count accepted without a unit: `--memory-limit 12` is a forgotten `GiB`, not 12 bytes.
pub const MIN_BARE_SIZE_BYTES: u64 = 1 << 20;

/// Parses a size people type into bytes: `14g`, `14GiB`, `14.5 GiB` and `512MiB` are binary (1024-based);
/// `24GB`, `24 MB` are decimal (1000-based); `100 B` is bytes; a number without a unit (`8000000000`) is a
/// byte count and must be at least 1 MiB (`12` is refused, naming `12GiB`). Units are case-insensitive:
/// B, K/KiB, M/MiB, G/GiB, T/TiB, P/PiB, KB, MB, GB, TB, PB. Fractions are rounded to the nearest byte. The
/// error names the input and the accepted forms.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num
        .parse()
        .ok()
        .filter(|x: &f64| x.is_finite())
        .ok_or_else(|| format!("{s:?} is not a size (try 80GiB, 14g, 14.5GB or a byte count)"))?;
    const KI: f64 = 1024.0;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => KI,
        "kb" => 1e3,
        "m" | "mib" => KI * KI,
        "mb" => 1e6,
        "g" | "gib" => KI * KI * KI,
        "gb" => 1e9,
        "t" | "tib" => KI * KI * KI * KI,
        "tb" => 1e12,
        "p" | "pib" => KI * KI * KI * KI * KI,
        "pb" => 1e15,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (B, KiB, MiB, GiB, TiB, PiB or K, M, G, T, P: 1024-based; KB, MB, \
                 GB, TB, PB: 1000-based)"
            ))
        }
    };
    let bytes = x * mult;
    if bytes >= u64::MAX as f64 {
        return Err(format!("{s:?} is too large a size"));
    }
    let bytes = bytes.round() as u64;
    if unit.trim().is_empty() && bytes < MIN_BARE_SIZE_BYTES {
        return Err(format!(
            "{s:?} has no unit, so it would mean {bytes} bytes: give the unit, e.g. {num}GiB or {num}MB (a bare \
             number is a byte count of at least 1 MiB)"
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_people_type() {
        assert_eq!(parse_size("14g").unwrap(), 14 << 30);
        assert_eq!(parse_size("14G").unwrap(), 14 << 30);
        assert_eq!(parse_size("80GiB").unwrap(), 80 << 30);
        assert_eq!(parse_size("14.5 GiB").unwrap(), 29 << 29);
        assert_eq!(parse_size("24GB").unwrap(), 24_000_000_000);
        assert_eq!(parse_size("24 MB").unwrap(), 24_000_000);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("512m").unwrap(), 512 << 20);
        assert_eq!(parse_size("2 PiB").unwrap(), 2 << 50);
        assert_eq!(parse_size("100 B").unwrap(), 100);
        assert_eq!(parse_size("1024B").unwrap(), 1024);
        assert_eq!(parse_size(" 8000000000 ").unwrap(), 8_000_000_000);
        let e = parse_size("12").unwrap_err();
        assert!(e.contains("12GiB") && e.contains("12 bytes"), "{e}");
        for bad in ["lots", "", "-1 GiB", "two GiB", "1e9", "14 gigs", "1.2.3G", "99999999999999P"] {
            assert!(parse_size(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn durations_pick_their_unit() {
        assert_eq!(format_duration(84_200), "84.2 µs");
        assert_eq!(format_duration(12_345_678), "0.012 s");
        assert_eq!(format_duration(1_234_000_000), "1.234 s");
        assert_eq!(format_duration(0), "0.0 µs");
    }

    #[test]
    fn report_style() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(64 * 1024 * 1024), "64.0 MiB");
        assert_eq!(format_bytes(3 * 1024 * 1024 * 1024 / 2), "1.50 GiB");
        assert_eq!(format_bytes(3 << 40), "3072.00 GiB");
        assert_eq!(format_delta(-64 * 1024 * 1024), "-64.0 MiB");
        assert_eq!(format_delta(2048), "+2.0 KiB");
        assert_eq!(format_delta(0), "0 B");
        assert_eq!(format_opt_bytes(None), "-");
    }

    #[test]
    fn torch_style() {
        assert_eq!(format_bytes_torch(512), "512 B");
        assert_eq!(format_bytes_torch(1024 * 1024), "1.00 MiB");
        assert_eq!(format_bytes_torch(64424509440), "60.00 GiB");
        assert_eq!(format_bytes_torch(3 << 39), "1.50 TiB");
        assert_eq!(format_delta_torch(-2048), "-2.00 KiB");
        assert_eq!(format_delta_torch(0), "+0 B");
    }

    #[test]
    fn escapes_the_five_characters() {
        assert_eq!(escape_html(r#"<a href="x">'&'</a>"#), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
    }

    /// Every value near a unit's edge formats as the two copies this crate replaced did (core's direct
    /// division with fixed thresholds, and the snapshot crate's loop), so no pinned output moves.
    #[test]
    fn byte_identical_to_the_replaced_copies() {
        fn old_core(bytes: u64) -> String {
            let (kib, mib, gib) = (1024.0, 1024.0 * 1024.0, 1024.0 * 1024.0 * 1024.0);
            let b = bytes as f64;
            if b >= gib {
                format!("{:.2} GiB", b / gib)
            } else if b >= mib {
                format!("{:.1} MiB", b / mib)
            } else if b >= kib {
                format!("{:.1} KiB", b / kib)
            } else {
                format!("{bytes} B")
            }
        }
        fn old_snapshot(n: u64) -> String {
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
        let mut values = vec![0u64, 1, u64::MAX, u64::MAX - 1];
        for shift in 0..64 {
            let p = 1u64 << shift;
            for d in [0u64, 1, 2, 51, 52, 53] {
                values.extend([p.saturating_add(d), p.saturating_sub(d), p.saturating_mul(3) / 2 + d]);
            }
            values.push(p.saturating_mul(1023) / 1024 + 1);
            values.push(p.saturating_mul(9995) / 10000);
        }
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            values.push(x >> (x % 48));
        }
        for v in values {
            assert_eq!(format_bytes(v), old_core(v), "{v}");
            assert_eq!(format_bytes_torch(v), old_snapshot(v), "{v}");
        }
    }
}
