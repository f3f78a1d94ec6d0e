//! `torchmem report PROFILE [--format table|json|csv|markdown|mermaid]`: prints a profile's report on stdout
//! (peaks, per-phase, per-epoch and per-process tables, growth warnings, the journey, line profiles; or the
//! timeline as CSV, or the journey as a Mermaid diagram). Works on a profile whose run was killed.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use torchmem_core::analysis::Summary;
use torchmem_core::report::{self, Format};
use torchmem_core::store::Profile;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FormatArg {
    /// Aligned text tables (MiB/GiB).
    Table,
    /// Every number as data; bytes as integers (keys: docs/reports.md).
    Json,
    /// The timeline: one row per CPU sample, GPU values carried forward.
    Csv,
    /// The tables as Markdown, the journey as a Mermaid block.
    Markdown,
    /// The memory journey as a Mermaid `journey` diagram.
    Mermaid,
}

impl From<FormatArg> for Format {
    fn from(f: FormatArg) -> Format {
        match f {
            FormatArg::Table => Format::Table,
            FormatArg::Json => Format::Json,
            FormatArg::Csv => Format::Csv,
            FormatArg::Markdown => Format::Markdown,
            FormatArg::Mermaid => Format::Mermaid,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// The profile file written by `torchmem run -o PROFILE`.
    pub profile: PathBuf,
    /// Output format.
    #[arg(long, short = 'f', value_enum, default_value_t = FormatArg::Table)]
    pub format: FormatArg,
}

/// Opens a profile for a report; the core's errors already name the problem and the fix.
pub fn open_profile(path: &std::path::Path) -> anyhow::Result<Profile> {
    if path.is_dir() {
        anyhow::bail!(
            "{}: is a directory, not a profile file. Give the .sqlite file `torchmem run -o PROFILE` wrote",
            path.display()
        );
    }
    Ok(Profile::open(path)?)
}

pub fn run(args: ReportArgs) -> anyhow::Result<i32> {
    let profile = open_profile(&args.profile)?;
    let summary = Summary::from_profile(&profile);
    let text = report::render(&profile, &summary, args.format.into());
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(0),
        // `torchmem report p | head` closes the pipe early: not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(e).context("cannot write the report to stdout"),
    }
}
