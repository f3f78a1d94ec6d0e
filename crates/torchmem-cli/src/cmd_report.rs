//! `torchmem report` (placeholder)

#[derive(Debug, clap::Args)]
pub struct ReportArgs {}

pub fn run(_args: ReportArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not built yet")
}
