//! torchmem-snapshot: a safe streaming reader for PyTorch allocator snapshots and their analysis.
