//! `torchmem info` (placeholder)

#[derive(Debug, clap::Args)]
pub struct InfoArgs {}

pub fn run(_args: InfoArgs) -> anyhow::Result<i32> {
    anyhow::bail!("not built yet")
}
