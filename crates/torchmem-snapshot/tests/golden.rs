//! Pins the crate's outputs (summary text, `--json` data, `--top` text at the peak and at a mid-trace moment,
//! diff data, and the HTML page's embedded data and cards) on every real fixture to the outputs captured
//! before the reader was rewritten, so a faster decoder cannot change a number. `UPDATE_GOLDEN=1` rewrites
//! the files (only for an intended output change; review the diff).

use std::path::PathBuf;

use torchmem_snapshot::{diff, html, sites, summary, Snapshot};

const FIXTURES: [&str; 5] = [
    "snapshot_gpt2_bs8_amp_cppstacks.pickle",
    "snapshot_mlp_adam_cppstacks.pickle",
    "snapshot_mlp_adam_pystacks.pickle",
    "snapshot_resnet50_bs64_amp_cppstacks.pickle",
    "snapshot_resnet50_bs64_fp32_cppstacks.pickle",
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/snapshots").join(name)
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn check(file: &str, got: &str) {
    let path = golden_dir().join(file);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with UPDATE_GOLDEN=1 to create it)", path.display()));
    if want != got {
        let at = want.bytes().zip(got.bytes()).position(|(a, b)| a != b).unwrap_or(want.len().min(got.len()));
        let line = want[..at].matches('\n').count() + 1;
        let around = |s: &str| {
            let (mut lo, mut hi) = (at.saturating_sub(120), (at + 120).min(s.len()));
            while !s.is_char_boundary(lo) {
                lo -= 1;
            }
            while !s.is_char_boundary(hi) {
                hi += 1;
            }
            s[lo..hi].to_string()
        };
        panic!(
            "{file} differs from the golden output at line {line}:\n want: …{}…\n  got: …{}…",
            around(&want),
            around(got)
        );
    }
}

fn load(name: &str) -> Snapshot {
    torchmem_snapshot::read_path(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The data the page embeds and its summary cards (the page's code and styling may change).
fn page_content(page: &str) -> String {
    let data_start = page.find("<script id=data type=\"application/json\">").expect("data element");
    let data = &page[data_start..];
    let data = &data[data.find('>').unwrap() + 1..data.find("</script>").unwrap()];
    let cards_start = page.find("<div class=cards>").expect("cards");
    let cards = &page[cards_start..];
    let cards = &cards[..cards.find("</div></div>").unwrap() + 12];
    let v: serde_json::Value = serde_json::from_str(data).expect("embedded JSON parses");
    format!("{}\n{}\n", serde_json::to_string(&v).unwrap(), cards)
}

#[test]
fn outputs_match_the_golden_files() {
    for name in FIXTURES {
        let snap = load(name);
        let sum = summary::summarize(&snap);
        check(&format!("{name}.summary.txt"), &summary::render_text(&sum, name));
        let tops = sites::top_sites(&snap, &sum.peaks(), 10, None);
        check(&format!("{name}.top.txt"), &sites::render_top_text(&tops));
        let v = serde_json::json!({ "file": name, "summary": sum, "top": tops });
        check(&format!("{name}.json"), &serde_json::to_string_pretty(&v).unwrap());
        // A moment in the middle of device 0's trace.
        let trace = &snap.device_traces[0];
        let mid_us = trace[trace.len() / 2].time_us;
        let tops_mid = sites::top_sites(&snap, &sum.peaks(), 5, Some(mid_us));
        check(&format!("{name}.top_mid.txt"), &sites::render_top_text(&tops_mid));
        check(&format!("{name}.page.txt"), &page_content(&html::render(&snap, &sum, name)));
    }
}

#[test]
fn diffs_match_the_golden_files() {
    for (a, b) in [(FIXTURES[2], FIXTURES[1]), (FIXTURES[4], FIXTURES[3]), (FIXTURES[0], FIXTURES[3])] {
        let d = diff::diff(&load(a), &load(b));
        check(&format!("diff_{a}_{b}.json"), &serde_json::to_string_pretty(&d).unwrap());
    }
}
