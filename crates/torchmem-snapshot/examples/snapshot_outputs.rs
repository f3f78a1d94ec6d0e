//! Prints everything torchmem derives from a snapshot file — the decoded model (`Debug`), the summary
//! text, the top sites, the JSON of `torchmem snapshot --json` and the HTML page — for before/after
//! comparisons of the reader (`bench/snapshot/compare_outputs.sh` runs two builds over the fixtures and
//! compares the outputs byte for byte). `--fast-only` decodes with the fast decoder alone and says when
//! it gave up (so a comparison shows which path read the file).
use std::io::Write;

use torchmem_snapshot::{html, sites, summary};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: snapshot_outputs FILE [--fast-only]");
    if args.next().as_deref() == Some("--fast-only") {
        let f = std::fs::File::open(&path).expect("open");
        let fast = torchmem_snapshot::direct::read(f).is_ok();
        println!("fast path: {}", if fast { "decoded" } else { "gave up" });
        return;
    }
    let snap = match torchmem_snapshot::read_path(std::path::Path::new(&path)) {
        Ok(s) => s,
        Err(e) => {
            println!("error: {e}");
            return;
        }
    };
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::new(out.lock());
    writeln!(out, "== model\n{snap:#?}").expect("write");
    let sum = summary::summarize(&snap);
    writeln!(out, "== summary\n{}", summary::render_text(&sum, "FILE")).expect("write");
    let tops = sites::top_sites(&snap, &sum.peaks(), 10, None);
    writeln!(out, "== top\n{}", sites::render_top_text(&tops)).expect("write");
    let v = serde_json::json!({ "file": "FILE", "summary": sum, "top": tops });
    writeln!(out, "== json\n{}", serde_json::to_string_pretty(&v).expect("json")).expect("write");
    writeln!(out, "== html\n{}", html::render(&snap, &sum, "FILE")).expect("write");
}
