//! Fuzz target: the safe unpickler and the snapshot decoder must never panic, hang or overflow the
//! stack on any input; they either return a value or a clear error.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = torchmem_snapshot::pickle::unpickle_bytes(data);
    if let Ok(snap) = torchmem_snapshot::read_bytes(data, "fuzz") {
        let s = torchmem_snapshot::summary::summarize(&snap);
        let _ = torchmem_snapshot::sites::top_sites(&snap, &s.peaks(), 5, None);
    }
});
