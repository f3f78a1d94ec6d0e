//! What the recorder writes: one enum of typed records, so one channel carries every kind. The store
//! (`crate::store::ProfileWriter`) persists them; sinks (`torchmem-recorder`) fold or export them.

use crate::model::*;

/// Everything the recorder writes, in one enum so one channel carries it.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Cpu(CpuSample),
    Process(ProcessSample),
    ProcessSeen(ProcessInfo),
    Gpu(GpuSample),
    Torch(TorchSample),
    Marker(Marker),
    /// A folded-spans row with its totals so far: replaces the previous row of the same key.
    Aggregate(SpanAggregate),
    /// A folded-breakdowns row with its totals so far: replaces the previous rows of the same key.
    BreakdownAggregate(BreakdownAggregate),
    LineProfile {
        t_ns: u64,
        origin: Origin,
        data: serde_json::Value,
    },
    Blob {
        t_ns: u64,
        name: String,
        data: serde_json::Value,
    },
}
