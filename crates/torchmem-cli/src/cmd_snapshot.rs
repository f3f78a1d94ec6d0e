//! `torchmem snapshot` and `torchmem explain-oom` (placeholder: the snapshot reader lands in torchmem-snapshot).

use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    /// Snapshot file (`_dump_snapshot` pickle or its JSON form), or `diff A B`.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct ExplainOomArgs {
    /// The out-of-memory message, as printed by PyTorch.
    pub message: String,
}

pub fn run(_args: SnapshotArgs) -> anyhow::Result<i32> {
    anyhow::bail!("torchmem snapshot is not built yet")
}

pub fn explain_oom(_args: ExplainOomArgs) -> anyhow::Result<i32> {
    anyhow::bail!("torchmem explain-oom is not built yet")
}
