//! Real H200 recordings (torch 2.11, tests/fixtures/snapshots): replayed under their recorded settings, the
//! model must reproduce every recorded segment event (kind, size, address, triggering entry) and the
//! recorded peak reserved.

use std::path::PathBuf;

use torchmem_sim::{read_snapshot, render, simulate, SimOptions};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/snapshots").join(name)
}

const FIXTURES: [&str; 5] = [
    "snapshot_mlp_adam_cppstacks.pickle",
    "snapshot_mlp_adam_pystacks.pickle",
    "snapshot_resnet50_bs64_fp32_cppstacks.pickle",
    "snapshot_resnet50_bs64_amp_cppstacks.pickle",
    "snapshot_gpt2_bs8_amp_cppstacks.pickle",
];

#[test]
fn default_replay_matches_every_recording() {
    let mut failures = Vec::new();
    for name in FIXTURES {
        let snap = read_snapshot(&fixture(name)).unwrap();
        let opts = SimOptions { detailed: true, ..Default::default() };
        let r = simulate(&snap, name, &opts);
        assert_eq!(r.devices.len(), 1, "{name}");
        let d = &r.devices[0];
        let c = d.comparison.as_ref().expect("same settings: compared");
        eprintln!("{name}: {}", render::verdict(d));
        assert!(c.recorded_segment_events > 0, "{name}: the recording has segment events");
        if !c.matches {
            failures.push(format!("{name}: {}", render::verdict(d)));
        }
        assert_eq!(d.peak_reserved_bytes, c.recorded_peak_reserved_bytes, "{name}");
        assert!(d.oom.is_none());
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
