//! The Markdown report (`torchmem report --format markdown`): the text report's tables as Markdown tables,
//! the journey as a Mermaid block (GitHub and most Markdown viewers draw it), line profiles in a code block.

use crate::analysis::Summary;
use crate::journey;
use crate::lines;
use crate::model::Profile;
use crate::report::cells::{self, Table};
use crate::report::mermaid;

/// Escapes text for a Markdown table cell.
fn cell(s: &str) -> String {
    s.replace('\\', "\\\\").replace('|', "\\|").replace('\n', " ")
}

/// One table as Markdown: a `###` title, the table (numbers right-aligned), its notes in italics.
pub fn render_table(t: &Table) -> String {
    let mut out = format!("### {}\n\n", t.title);
    if t.rows.is_empty() {
        out.push_str(&format!("_{}_\n", cell(&t.empty)));
    } else {
        let header: Vec<String> = t.headers.iter().map(|h| if h.is_empty() { " ".into() } else { cell(h) }).collect();
        out.push_str(&format!("| {} |\n", header.join(" | ")));
        let align: Vec<&str> = t.numeric.iter().map(|n| if *n { "---:" } else { "---" }).collect();
        out.push_str(&format!("| {} |\n", align.join(" | ")));
        for row in &t.rows {
            let cells: Vec<String> = row.iter().map(|c| cell(c)).collect();
            out.push_str(&format!("| {} |\n", cells.join(" | ")));
        }
    }
    if !t.notes.is_empty() {
        out.push('\n');
        for n in &t.notes {
            out.push_str(&format!("_{}_  \n", cell(n)));
        }
    }
    out
}

/// The whole report as Markdown.
pub fn render(profile: &Profile, summary: &Summary) -> String {
    let mut out = String::from("## torchmem report\n\n");
    for (k, v) in cells::meta_lines(profile, summary) {
        out.push_str(&format!("- **{k}**: {}\n", cell(&v).replace('`', "'")));
    }
    out.push('\n');
    for g in &summary.growth {
        out.push_str(&format!("> **Warning**: {}\n\n", cell(&super::findings::growth_message(g))));
    }
    for l in &summary.leaks {
        out.push_str(&format!("> **Leak**: {}\n\n", cell(&l.message)));
    }
    for t in cells::all_tables(summary) {
        out.push_str(&render_table(&t));
        out.push('\n');
    }
    out.push_str(&format!("## {}\n\n", crate::report::breakdown::SECTION_TITLE));
    for t in crate::report::breakdown::tables(&summary.breakdown) {
        out.push_str(&render_table(&t));
        out.push('\n');
    }
    out.push_str(&render_table(&cells::journey_table(&summary.journey)));
    if !summary.journey.is_empty() {
        out.push_str(&format!(
            "\n```mermaid\n{}```\n",
            journey::render_mermaid(&summary.journey, &mermaid::title(profile))
        ));
    }
    let line_text = lines::render_text(&profile.line_profiles);
    if !line_text.trim().is_empty() {
        out.push_str(&format!("\n### Line profile\n\n```text\n{}\n```\n", line_text.trim_end()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_are_valid_markdown() {
        let t = Table {
            title: "Phases".into(),
            headers: vec!["phase".into(), "count".into()],
            numeric: vec![false, true],
            rows: vec![vec!["a|b".into(), "3".into()]],
            notes: vec!["note".into()],
            empty: String::new(),
        };
        assert_eq!(render_table(&t), "### Phases\n\n| phase | count |\n| --- | ---: |\n| a\\|b | 3 |\n\n_note_  \n");
    }
}
