//! The plain-text report (`torchmem report --format table`, the summary `torchmem run` prints, and the
//! Python Monitor's `summary()`): aligned tables in readable units (MiB/GiB).

use crate::analysis::{EpochRow, Growth, PhaseRow, Summary};
use crate::journey;
use crate::lines;
use crate::model::Profile;
use crate::report::cells::{self, Table};

/// Draws one table as aligned text: a title line, a header, a rule, the rows, its notes, then a blank line
/// (so tables can be concatenated).
pub fn render_table(t: &Table) -> String {
    let mut out = render_table_body(t);
    out.push('\n');
    out
}

fn render_table_body(t: &Table) -> String {
    let mut out = format!("{}\n", t.title);
    if t.rows.is_empty() {
        out.push_str(&format!("  ({})\n", t.empty));
        for n in &t.notes {
            out.push_str(&format!("  {n}\n"));
        }
        return out;
    }
    let ncols = t.headers.len();
    let width = |s: &str| s.chars().count();
    let mut widths: Vec<usize> = t.headers.iter().map(|h| width(h)).collect();
    for row in &t.rows {
        for (i, cell) in row.iter().enumerate().take(ncols) {
            widths[i] = widths[i].max(width(cell));
        }
    }
    let line = |cells: &[String]| -> String {
        let mut s = String::from(" ");
        for (i, cell) in cells.iter().enumerate().take(ncols) {
            let pad = widths[i].saturating_sub(width(cell));
            let last = i + 1 == ncols;
            s.push(' ');
            if t.numeric.get(i).copied().unwrap_or(false) {
                s.push_str(&" ".repeat(pad));
                s.push_str(cell);
            } else {
                s.push_str(cell);
                if !last {
                    s.push_str(&" ".repeat(pad));
                }
            }
            if !last {
                s.push(' ');
            }
        }
        format!("{}\n", s.trim_end())
    };
    out.push_str(&line(&t.headers));
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    out.push_str(&line(&rule));
    for row in &t.rows {
        out.push_str(&line(row));
    }
    for n in &t.notes {
        out.push_str(&format!("  {n}\n"));
    }
    out
}

/// The per-epoch table (one row per epoch: time, allocated, reserved, peaks, CPU RSS, growth).
pub fn render_epochs(rows: &[EpochRow]) -> String {
    render_table(&cells::epochs_table(rows))
}

/// The per-phase table (forward, backward, optimizer …: count, time, mean Δ, max peak).
pub fn render_phases(rows: &[PhaseRow]) -> String {
    render_table(&cells::phases_table(rows))
}

/// Growth ("leak") warnings, one paragraph each; empty when none.
pub fn render_growth(warnings: &[Growth]) -> String {
    warnings.iter().map(|g| format!("WARNING: {}\n", super::findings::growth_message(g))).collect()
}

/// One `LEAK:` line per finding (the line, what it keeps, per step); empty when none.
pub fn render_leaks(leaks: &[crate::analysis::Leak]) -> String {
    leaks.iter().map(|l| format!("LEAK: {}\n", l.message)).collect()
}

/// The summary alone (no profile file): growth warnings, peaks, phases, epochs, processes, journey.
pub fn render(summary: &Summary) -> String {
    let mut out = render_growth(&summary.growth);
    out.push_str(&render_leaks(&summary.leaks));
    if !out.is_empty() {
        out.push('\n');
    }
    for t in cells::all_tables(summary) {
        out.push_str(&render_table(&t));
    }
    for t in crate::report::breakdown::tables(&summary.breakdown) {
        out.push_str(&render_table(&t));
    }
    out.push_str(&journey::render_text(&summary.journey));
    out
}

/// The whole text report of a profile: the run's facts, then `render(summary)`, then the line profiles.
pub fn render_report(profile: &Profile, summary: &Summary) -> String {
    let meta = cells::meta_lines(profile, summary);
    let key_width = meta.iter().map(|(k, _)| k.chars().count()).max().unwrap_or(0);
    let mut out = String::from("torchmem report\n");
    for (k, v) in &meta {
        out.push_str(&format!("  {k:<key_width$}  {v}\n"));
    }
    out.push('\n');
    let mut body = render_growth(&summary.growth);
    body.push_str(&render_leaks(&summary.leaks));
    if !body.is_empty() {
        body.push('\n');
    }
    for t in cells::all_tables_of(profile, summary) {
        body.push_str(&render_table(&t));
    }
    // "What the memory is": the composition at the peak, then the per-boundary table and the detail.
    for t in crate::report::breakdown::tables(&summary.breakdown) {
        body.push_str(&render_table(&t));
    }
    body.push_str(&journey::render_text(&summary.journey));
    out.push_str(&body);
    let line_text = lines::render_text(&profile.line_profiles);
    if !line_text.trim().is_empty() {
        out.push('\n');
        out.push_str(&line_text);
        if !line_text.ends_with('\n') {
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::{Growth, PhaseRow};

    const MIB: u64 = 1 << 20;

    fn phase(name: &str, alloc: Option<u64>) -> PhaseRow {
        PhaseRow {
            name: name.into(),
            count: 4,
            total_ns: 2_000_000_000,
            mean_delta_allocated_bytes: alloc.map(|a| a as i64),
            max_peak_allocated_bytes: alloc,
            max_peak_reserved_bytes: alloc.map(|a| a * 2),
            mean_delta_rss_bytes: Some(-(MIB as i64)),
            max_peak_rss_bytes: Some(300 * MIB),
        }
    }

    #[test]
    fn phase_table_is_aligned_with_units() {
        let text = render_phases(&[phase("forward", Some(64 * MIB)), phase("optimizer_step", Some(1 << 30))]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "Phases");
        assert!(lines[1].contains("phase") && lines[1].contains("max peak allocated"), "{text}");
        assert!(lines[2].trim_start().starts_with("---"), "{text}");
        assert!(
            lines[3].contains("forward") && lines[3].contains("+64.0 MiB") && lines[3].contains("0.500 s"),
            "{text}"
        );
        assert!(lines[4].contains("1.00 GiB") && lines[4].contains("2.00 GiB"), "{text}");
        // right-aligned numbers: every data line ends at the same column as the header
        let ends: Vec<usize> = lines[1..5].iter().map(|l| l.chars().count()).collect();
        assert!(ends.windows(2).all(|w| w[0] == w[1]), "{text}");
    }

    #[test]
    fn cpu_phase_table_says_no_cuda() {
        let text = render_phases(&[phase("forward", None)]);
        assert!(!text.contains("allocated"), "{text}");
        assert!(text.contains("no CUDA device"), "{text}");
        assert!(!text.contains(" 0 B"), "no fake zeros: {text}");
    }

    #[test]
    fn empty_tables_say_how_to_record() {
        assert!(render_epochs(&[]).contains("mon.epoch()"));
        assert!(render_phases(&[]).contains("torchmem.track"));
        assert_eq!(render_growth(&[]), "");
        let g = Growth {
            unit: crate::analysis::GrowthUnit::Epoch,
            what: crate::analysis::GrowthSeries::GpuAllocated,
            per_unit_bytes: 1,
            units: 3,
        };
        assert!(render_growth(&[g]).starts_with("WARNING: GPU allocated grew every epoch for 3 epochs"));
    }
}
