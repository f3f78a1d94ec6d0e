//! Reports: one file per output format, all rendered from a loaded `Profile` and its `analysis::Summary`.
//!
//! `torchmem report` formats: `table` (text, `table.rs`), `json`, `csv` (the timeline), `markdown`,
//! `mermaid` (the journey diagram). `torchmem plot` writes `html.rs` (one offline page: chart, hover
//! read-out, tables) or `svg.rs` (the chart alone). `cells.rs` builds the tables every format shares;
//! `timeline.rs` downsamples the timeline for the chart. `monitor.rs` renders the in-process Monitor's
//! summary, journey and epoch line from its markers alone. What each format holds: `docs/reports.md`.

pub mod breakdown;
pub mod cells;
pub mod csv;
pub mod findings;
pub mod html;
pub mod json;
pub mod markdown;
pub mod mermaid;
pub mod monitor;
pub mod ranks;
pub mod svg;
pub mod table;
pub mod timeline;

use crate::analysis::Summary;
use crate::model::Profile;

/// The formats of `torchmem report`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Table,
    Json,
    Csv,
    Markdown,
    Mermaid,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Table => "table",
            Format::Json => "json",
            Format::Csv => "csv",
            Format::Markdown => "markdown",
            Format::Mermaid => "mermaid",
        }
    }
}

/// Renders a profile's report in one format.
pub fn render(profile: &Profile, summary: &Summary, format: Format) -> String {
    match format {
        Format::Table => table::render_report(profile, summary),
        Format::Json => json::render(profile, summary),
        Format::Csv => csv::render(profile),
        Format::Markdown => markdown::render(profile, summary),
        Format::Mermaid => mermaid::render(profile, summary),
    }
}

/// The standalone SVG chart of a profile (`torchmem plot --svg`).
pub fn render_svg(profile: &Profile) -> String {
    let lay = svg::Layout::standard();
    let tl = timeline::Timeline::build(profile, lay.buckets());
    svg::render_chart(profile, &tl, &lay, false)
}

/// The self-contained HTML page of a profile (`torchmem plot`).
pub fn render_html(profile: &Profile, summary: &Summary) -> String {
    html::render(profile, summary)
}
