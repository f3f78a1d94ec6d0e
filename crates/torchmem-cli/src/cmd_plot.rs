//! `torchmem plot PROFILE [-o report.html] [--svg]`: writes one self-contained HTML page that works offline
//! (memory timeline with epochs and phases, hover read-out, the report's tables, the line profile), or with
//! `--svg` the chart alone as a static SVG.

use std::path::{Path, PathBuf};

use anyhow::Context;
use torchmem_core::analysis::Summary;
use torchmem_core::report;

use crate::cmd_report::open_profile;

#[derive(Debug, clap::Args)]
pub struct PlotArgs {
    /// The profile file written by `torchmem run -o PROFILE`.
    pub profile: PathBuf,
    /// Where to write the page (default: the profile's name with .html, or .svg with --svg).
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Write the chart alone as a static SVG image instead of the HTML page.
    #[arg(long)]
    pub svg: bool,
}

/// The default output path: the profile's path with its extension replaced.
pub fn default_output(profile: &Path, svg: bool) -> PathBuf {
    profile.with_extension(if svg { "svg" } else { "html" })
}

pub fn run(args: PlotArgs) -> anyhow::Result<i32> {
    let profile = open_profile(&args.profile)?;
    let output = args.output.clone().unwrap_or_else(|| default_output(&args.profile, args.svg));
    if output == args.profile {
        anyhow::bail!("{}: the output would overwrite the profile. Choose another path with -o", output.display());
    }
    let text = if args.svg {
        report::render_svg(&profile)
    } else {
        report::render_html(&profile, &Summary::from_profile(&profile))
    };
    // Write next to the target, then rename: a failed write never leaves half a page behind.
    let tmp = output.with_file_name(format!(".{}.tmp", output.file_name().and_then(|n| n.to_str()).unwrap_or("plot")));
    std::fs::write(&tmp, text.as_bytes())
        .and_then(|_| std::fs::rename(&tmp, &output))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
        .with_context(|| {
            format!(
                "cannot write {}. Check that its directory exists and is writable, or choose another path with -o",
                output.display()
            )
        })?;
    eprintln!("torchmem: wrote {} ({})", output.display(), torchmem_core::units::format_bytes(text.len() as u64));
    Ok(0)
}
