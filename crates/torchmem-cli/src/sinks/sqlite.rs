//! The profile as a sink: every batch goes into the SQLite `ProfileWriter` and is committed as one
//! transaction, exactly as the recorder wrote it before sinks existed (same records, same order, same
//! commit points).

use torchmem_core::model::{Profile, RunMeta};
use torchmem_core::store::{ProfileWriter, Record};

use super::{RecordBatch, Sink};

pub struct SqliteSink {
    writer: ProfileWriter,
}

impl SqliteSink {
    pub fn new(writer: ProfileWriter) -> Self {
        SqliteSink { writer }
    }

    /// Stores a record with the next commit.
    pub fn push(&mut self, record: Record) {
        self.writer.push(record);
    }

    /// Stores the batch's records and commits them.
    pub fn write(&mut self, batch: RecordBatch) -> torchmem_core::Result<()> {
        for r in batch.records {
            self.writer.push(r);
        }
        self.writer.flush()
    }

    /// Commits what is left and writes the run's end into the profile's metadata.
    pub fn finish_with(self, end: impl FnOnce(&mut RunMeta), duration_ns: u64) -> torchmem_core::Result<Profile> {
        self.writer.finish_with(end, duration_ns)
    }
}

impl Sink for SqliteSink {
    fn consume(&mut self, batch: &RecordBatch) -> anyhow::Result<()> {
        for r in &batch.records {
            self.writer.push(r.clone());
        }
        Ok(self.writer.flush()?)
    }

    fn consume_owned(&mut self, batch: RecordBatch) -> anyhow::Result<()> {
        Ok(self.write(batch)?)
    }

    fn finish(&mut self, _t_ns: u64) -> anyhow::Result<()> {
        Ok(self.writer.flush()?)
    }

    fn name(&self) -> &'static str {
        "profile"
    }
}
