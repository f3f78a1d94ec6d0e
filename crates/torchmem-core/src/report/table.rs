//! Plain-text tables (placeholder; the report owner fills it in).

use crate::analysis::{EpochRow, Growth, PhaseRow, Summary};

/// The per-epoch table (one row per epoch: time, allocated, reserved, peaks, CPU RSS, growth).
pub fn render_epochs(rows: &[EpochRow]) -> String {
    format!("{} epochs\n", rows.len())
}

/// The per-phase table (forward, backward, optimizer …: count, time, mean Δ, max peak).
pub fn render_phases(rows: &[PhaseRow]) -> String {
    format!("{} phases\n", rows.len())
}

/// Growth ("leak") warnings, one paragraph each; empty when none.
pub fn render_growth(warnings: &[Growth]) -> String {
    warnings.iter().map(|g| format!("WARNING: {}\n", g.message)).collect()
}

/// The whole text report.
pub fn render(summary: &Summary) -> String {
    format!("{}{}{}", render_epochs(&summary.epochs), render_phases(&summary.phases), render_growth(&summary.growth))
}
