//! Byte and time formatting shared by the snapshot views (binary units, like PyTorch's messages); the byte
//! formatter and the HTML escaper are `torchmem-units`'.

/// Bytes as PyTorch's allocator messages print them (`1.00 MiB`, `60.00 GiB`), signed bytes for diffs
/// (`+0 B`, `-2.00 KiB`) and the HTML escaper: the one copy in `torchmem-units`, under this crate's names.
pub use torchmem_units::{escape_html as html_escape, format_bytes_torch as bytes, format_delta_torch as signed_bytes};

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
