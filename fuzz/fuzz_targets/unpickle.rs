//! Fuzz target: the safe unpickler and both snapshot decoders must never panic, hang or overflow the
//! stack on any input; they either return a value or a clear error. Differential: whenever the fast
//! decoder (`direct`) accepts an input, the generic decoder must accept it too and build the same snapshot.
#![no_main]

use libfuzzer_sys::fuzz_target;
use torchmem_snapshot::{direct, html, read_pickle_generic, sites, summary};

fuzz_target!(|data: &[u8]| {
    let _ = torchmem_snapshot::pickle::unpickle_bytes(data);
    if let Ok(fast) = direct::read(data) {
        match read_pickle_generic(data, "fuzz") {
            Ok(generic) => assert!(fast == generic, "the fast and generic decoders disagree"),
            Err(e) => panic!("the fast decoder accepted what the generic one refuses: {e}"),
        }
    }
    if let Ok(snap) = torchmem_snapshot::read_bytes(data, "fuzz") {
        let s = summary::summarize(&snap);
        let _ = sites::top_sites(&snap, &s.peaks(), 5, None);
        let _ = html::render(&snap, &s, "fuzz");
    }
});
