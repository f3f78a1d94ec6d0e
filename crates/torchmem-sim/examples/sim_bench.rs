//! Replay speed: loads a snapshot once, then times the trace replay alone (no pickle reading) and a
//! `--min-memory` bisection, printing trace entries per second.
//!
//!     cargo run --release -p torchmem-sim --example sim_bench -- SNAPSHOT [--reps N] [--alloc-conf CONF]

use std::time::Instant;

/// This thread's CPU time in seconds (Linux `/proc/thread-self/schedstat`), so that a machine shared with
/// other work still gives the replay's own cost; None elsewhere.
fn cpu_s() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    Some(s.split_whitespace().next()?.parse::<f64>().ok()? / 1e9)
}

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
            let mut best_cpu = f64::INFINITY;
            let mut r = None;
            for _ in 0..reps {
                let t = Instant::now();
                let c = cpu_s();
                r = Some(p.run(&opts));
                best = best.min(t.elapsed().as_secs_f64());
                if let (Some(c0), Some(c1)) = (c, cpu_s()) {
                    best_cpu = best_cpu.min(c1 - c0);
                }
            }
            let r = r.expect("reps >= 1");
            println!(
                "device {d}: {n} entries, detailed={detailed}: best of {reps} {:.4} s wall = {:.1} M entries/s; \
                 {:.4} s CPU = {:.1} M entries/s (peak reserved {} B)",
                best,
                n as f64 / best / 1e6,
                best_cpu,
                n as f64 / best_cpu / 1e6,
                r.peak_reserved_bytes
            );
        }
        let opts = SimOptions { conf: conf.clone(), ..Default::default() };
        let t = Instant::now();
        let c0 = cpu_s().unwrap_or(0.0);
        let m = search::min_memory(&p, &opts);
        let s = t.elapsed().as_secs_f64();
        let cpu = cpu_s().unwrap_or(0.0) - c0;
        println!(
            "device {d}: --min-memory {:?} B in {s:.3} s wall, {cpu:.3} s CPU ({} replays); read {read_s:.2} s, \
             prepare {prep_s:.3} s",
            m.min_memory_bytes, m.runs
        );
    }
}
