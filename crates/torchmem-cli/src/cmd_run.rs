//! `torchmem run` (placeholder)

#[derive(Debug, clap::Args)]
pub struct RunArgs {}

pub fn run(_args: RunArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not built yet")
}
