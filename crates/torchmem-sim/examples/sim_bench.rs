//! Replay speed: loads a snapshot once, then times the trace replay alone (no pickle reading) and a
//! `--min-memory` bisection, printing trace entries per second.
//!
//!     cargo run --release -p torchmem-sim --example sim_bench -- SNAPSHOT [--reps N] [--alloc-conf CONF]

use std::time::Instant;

use torchmem_sim::{read_snapshot, replay, search, AllocConf, Prepared, SimOptions};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args.first().expect("usage: sim_bench SNAPSHOT [--reps N] [--alloc-conf CONF]");
    let mut reps = 20usize;
    let mut conf = None;
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--reps" => reps = args[i + 1].parse().expect("--reps N"),
            "--alloc-conf" => conf = Some(AllocConf::parse(&args[i + 1]).expect("a valid alloc conf")),
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    let t0 = Instant::now();
    let snap = read_snapshot(std::path::Path::new(path)).expect("a readable snapshot");
    let read_s = t0.elapsed().as_secs_f64();
    for d in replay::devices(&snap) {
        let t1 = Instant::now();
        let p = Prepared::new(&snap, d).expect("a simulable device");
        let prep_s = t1.elapsed().as_secs_f64();
        let n = p.entries.len();
        for detailed in [false, true] {
            let opts = SimOptions { conf: conf.clone(), detailed, ..Default::default() };
            let mut best = f64::INFINITY;
            let mut r = None;
            for _ in 0..reps {
                let t = Instant::now();
                r = Some(p.run(&opts));
                best = best.min(t.elapsed().as_secs_f64());
            }
            let r = r.expect("reps >= 1");
            println!(
                "device {d}: {n} entries, detailed={detailed}: best of {reps} {:.4} s = {:.1} M entries/s \
                 (peak reserved {} B)",
                best,
                n as f64 / best / 1e6,
                r.peak_reserved_bytes
            );
        }
        let opts = SimOptions { conf: conf.clone(), ..Default::default() };
        let t = Instant::now();
        let m = search::min_memory(&p, &opts);
        let s = t.elapsed().as_secs_f64();
        println!(
            "device {d}: --min-memory {:?} B in {s:.3} s ({} replays, {:.1} M entries/s); read {read_s:.2} s, \
             prepare {prep_s:.3} s",
            m.min_memory_bytes,
            m.runs,
            (n * m.runs) as f64 / s / 1e6
        );
    }
}
