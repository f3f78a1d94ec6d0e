//! `torchmem plot PROFILE [-o report.html] [--svg]`: writes one self-contained HTML page that works offline
//! (memory timeline with epochs and phases, hover read-out, the report's tables, the line profile), or with
//! `--svg` the chart alone as a static SVG. A profile holding ranks (torchrun, Slurm) gets the rank
//! sections and one step-aligned chart per rank; several profiles or a directory give one merged page.
//! An existing file is replaced only when torchmem wrote it (`output_path::check_output`), or with `--force`.

use std::path::{Path, PathBuf};

use torchmem_core::analysis::ranks::{is_distributed, RankReport};
use torchmem_core::analysis::Summary;
use torchmem_core::report;
use torchmem_core::units::escape_html;

use crate::cmd_report::load_inputs;
use torchmem_recorder::output_path::{self, OutputKind};

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// The profile file written by `torchmem run -o PROFILE`; several files, or a directory of them (one per
    /// node or `srun` task), give one merged page of every rank.
    #[arg(required = true, num_args = 1..)]
    pub profiles: Vec<PathBuf>,
    /// Where to write the page (default: the profile's name with .html, or .svg with --svg; a directory
    /// DIR gives DIR.html next to it).
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Write the chart alone as a static SVG image instead of the HTML page.
    #[arg(long)]
    pub svg: bool,
    /// Overwrite an existing file even when it is not a page (or chart) torchmem wrote; a page or chart
    /// torchmem wrote is replaced without it, any other file never (never a profile read).
    #[arg(long)]
    pub force: bool,
}

/// The default output path: the profile's path with its extension replaced.
pub fn default_output(profile: &Path, svg: bool) -> PathBuf {
    profile.with_extension(if svg { "svg" } else { "html" })
}

/// The rank sections of the HTML page: tables, per-rank charts.
fn rank_html(r: &RankReport) -> String {
    let mut out = String::from("<section id=\"ranks\">\n<h2>Distributed: every rank</h2>\n<ul class=\"meta\">\n");
    for (k, v) in report::ranks::header_lines(r) {
        out.push_str(&format!("<li><b>{}</b>: {}</li>\n", escape_html(&k), escape_html(&v)));
    }
    out.push_str("</ul>\n");
    let tables = report::ranks::tables(r);
    // The ranks and imbalance tables, the per-rank charts, then the rest (matrix first).
    for (i, t) in tables.iter().enumerate() {
        out.push_str(&report::html::render_table(t));
        if i == 1 {
            out.push_str(&report::ranks::html_charts(r));
        }
    }
    out.push_str("</section>\n");
    out
}

/// A page of several profiles' ranks (the single-profile page's style, the rank sections only).
fn merged_page(r: &RankReport) -> String {
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>torchmem: {} ranks</title>\n<style>body{{font-family:system-ui,sans-serif;margin:1.5em;}} table{{border-collapse:collapse;margin:.5em 0;}} th,td{{border:1px solid #ccc;padding:2px 8px;}} td.num,th.num{{text-align:right;}} .note{{color:#555;font-size:90%;}} .rank-charts{{display:flex;flex-wrap:wrap;gap:8px;}} figure{{margin:0;}}</style></head>\n<body>\n<h1>torchmem distributed report</h1>\n{}<p class=\"note\">Per-profile pages: <code>torchmem plot FILE</code>.</p>\n</body></html>\n",
        r.ranks.len(),
        rank_html(r)
    )
}

pub fn run(args: PlotArgs) -> anyhow::Result<i32> {
    let (inputs, profiles): (Vec<PathBuf>, Vec<_>) = load_inputs(&args.profiles)?.into_iter().unzip();
    let first = &args.profiles[0];
    let several = inputs.len() > 1 || first.is_dir();
    let output = match (&args.output, several) {
        (Some(o), _) => o.clone(),
        (None, false) => default_output(first, args.svg),
        (None, true) if first.is_dir() && args.profiles.len() == 1 => {
            let dir = first.components().collect::<PathBuf>();
            dir.with_extension(if args.svg { "svg" } else { "html" })
        }
        (None, true) => anyhow::bail!("several profiles make one page: say where with -o PAGE.html"),
    };
    let kind = if args.svg { OutputKind::Svg } else { OutputKind::Html };
    let input_refs: Vec<&Path> = inputs.iter().map(PathBuf::as_path).collect();
    output_path::check_output(&output, &input_refs, Some(args.force), "-o", kind)?;
    let text = if args.svg {
        if profiles.len() > 1 {
            anyhow::bail!("--svg draws one profile's chart: give one file (or drop --svg for the merged page)");
        }
        report::render_svg(&profiles[0])
    } else if profiles.len() == 1 {
        let mut page = report::render_html(&profiles[0], &Summary::from_profile(&profiles[0]));
        if is_distributed(&profiles) {
            let section = rank_html(&RankReport::build(&profiles));
            match page.rfind("</body>") {
                Some(i) => page.insert_str(i, &section),
                None => page.push_str(&section),
            }
        }
        page
    } else {
        if !is_distributed(&profiles) {
            anyhow::bail!(
                "these {} profiles hold no rank (not a torchrun or Slurm job), so there is nothing to merge: plot them one at a time",
                profiles.len()
            );
        }
        merged_page(&RankReport::build(&profiles))
    };
    output_path::write_atomically(&output, text.as_bytes())?;
    eprintln!("torchmem: wrote {} ({})", output.display(), torchmem_core::units::format_bytes(text.len() as u64));
    Ok(0)
}
