//! The profile as a sink: every batch goes into the SQLite `ProfileWriter` and is committed as one
//! transaction, exactly as the recorder wrote it before sinks existed (same records, same order, same
//! commit points).
//!
//! A write that fails (the disk filled up) is said once: the sink then frees the space the writer holds in
//! reserve, moves what was committed into the database file (`ProfileWriter::make_room`) and writes nothing
//! more, counting the samples it drops, so that the run ends with the program's exit code and a profile
//! that keeps what was written and says why it stops (`RunMeta::write_failure`).

use torchmem_core::model::{Profile, RunMeta, WriteFailure};
use torchmem_core::store::{self, ProfileWriter, Record};

use super::{RecordBatch, Sink};

pub struct SqliteSink {
    writer: ProfileWriter,
    /// Set by the first failed write: nothing is written after it but the run's end.
    failure: Option<WriteFailure>,
}

/// CPU samples in a batch, and the first one's time.
fn samples_in(records: &[Record]) -> (u64, Option<u64>) {
    let mut first = None;
    let mut n = 0;
    for r in records {
        if let Record::Cpu(s) = r {
            first.get_or_insert(s.t_ns);
            n += 1;
        }
    }
    (n, first)
}

impl SqliteSink {
    pub fn new(writer: ProfileWriter) -> Self {
        SqliteSink { writer, failure: None }
    }

    /// Why the profile stopped being written, and what was lost so far; None while all is written.
    pub fn failure(&self) -> Option<&WriteFailure> {
        self.failure.as_ref()
    }

    /// Stores the batch's records and commits them. The first failure is returned (once); from then on
    /// batches are counted and dropped.
    pub fn write(&mut self, batch: RecordBatch) -> torchmem_core::Result<()> {
        let (samples, first_t_ns) = samples_in(&batch.records);
        if let Some(f) = &mut self.failure {
            f.lost_samples += samples;
            return Ok(());
        }
        for r in batch.records {
            self.writer.push(r);
        }
        let Err(e) = self.writer.flush() else { return Ok(()) };
        let disk_full = store::is_disk_full(&e);
        // Best effort: with the reserve freed the committed pages move into the database file.
        let _ = self.writer.make_room();
        self.failure = Some(WriteFailure {
            t_ns: first_t_ns.unwrap_or(batch.t_ns),
            disk_full,
            error: e.to_string(),
            lost_samples: samples,
        });
        Err(e)
    }

    /// Commits what is left and writes the run's end (with the write failure, if any) into the profile's
    /// metadata.
    pub fn finish_with(self, end: impl FnOnce(&mut RunMeta), duration_ns: u64) -> torchmem_core::Result<Profile> {
        let failure = self.failure;
        self.writer.finish_with(
            move |m| {
                end(m);
                m.write_failure = failure;
            },
            duration_ns,
        )
    }
}

impl Sink for SqliteSink {
    fn consume(&mut self, batch: &RecordBatch) -> anyhow::Result<()> {
        let copy = RecordBatch { records: batch.records.clone(), t_ns: batch.t_ns, ..RecordBatch::default() };
        Ok(self.write(copy)?)
    }

    fn consume_owned(&mut self, batch: RecordBatch) -> anyhow::Result<()> {
        Ok(self.write(batch)?)
    }

    fn finish(&mut self, t_ns: u64) -> anyhow::Result<()> {
        Ok(self.write(RecordBatch { t_ns, ..RecordBatch::default() })?)
    }

    fn name(&self) -> &'static str {
        "profile"
    }
}
