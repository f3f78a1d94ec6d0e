//! Prints how long each phase of reading and analysing a snapshot takes (for profiling the bench).
use std::time::Instant;

fn main() {
    let path = std::env::args().nth(1).expect("usage: phase_times FILE");
    if std::env::var_os("SPLIT").is_some() {
        split(&path);
    }
    if std::env::var_os("FAST_ONLY").is_some() {
        let t = Instant::now();
        let f = std::fs::File::open(&path).expect("open");
        let fast = torchmem_snapshot::direct::read(f).is_ok();
        eprintln!("fast path {:>8.2} s ({})", t.elapsed().as_secs_f64(), if fast { "decoded" } else { "gave up" });
        return;
    }
    let t = Instant::now();
    let snap = torchmem_snapshot::read_path(std::path::Path::new(&path)).expect("read");
    eprintln!("read      {:>8.2} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    let s = torchmem_snapshot::summary::summarize(&snap);
    eprintln!("summarize {:>8.2} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    let top = torchmem_snapshot::sites::top_sites(&snap, &s.peaks(), 10, None);
    eprintln!("top       {:>8.2} s ({} devices)", t.elapsed().as_secs_f64(), top.len());
    let t = Instant::now();
    drop(snap);
    eprintln!("drop      {:>8.2} s", t.elapsed().as_secs_f64());
}

#[allow(dead_code)]
fn split(path: &str) {
    use torchmem_snapshot::{decode, pickle};
    let f = std::io::BufReader::new(std::fs::File::open(path).unwrap());
    let t = Instant::now();
    let mut c = decode::SnapshotCompactor::default();
    let doc = pickle::unpickle(f, &mut c).unwrap();
    eprintln!("  unpickle {:>8.2} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    let snap = decode::build(&doc.root, c).unwrap();
    eprintln!("  build    {:>8.2} s", t.elapsed().as_secs_f64());
    let t = Instant::now();
    drop(doc);
    eprintln!("  doc drop {:>8.2} s ({} traces)", t.elapsed().as_secs_f64(), snap.trace_entries());
}
