//! `torchmem plot` (placeholder)

#[derive(Debug, clap::Args)]
pub struct PlotArgs {}

pub fn run(_args: PlotArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not built yet")
}
