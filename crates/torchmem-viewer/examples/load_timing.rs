//! Loads a file as `torchmem view` does and prints where the time went and the peak RSS (VmHWM), for
//! profiling the load path: `cargo run --release -p torchmem-viewer --example load_timing -- FILE`
//! (`TORCHMEM_VIEW_TIMING=1` is set for the phases' timings).

fn vm_hwm_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(|l| l[6..].trim().trim_end_matches(" kB").trim().to_string())
        })
        .and_then(|v| v.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

fn main() {
    std::env::set_var("TORCHMEM_VIEW_TIMING", "1");
    let path = std::env::args().nth(1).expect("a file");
    let t = std::time::Instant::now();
    let doc = torchmem_viewer::load(std::path::Path::new(&path), None).expect("load");
    let q = std::time::Instant::now();
    let _ = torchmem_viewer::api::meta(std::slice::from_ref(&doc));
    if let torchmem_viewer::Doc::Memory { trace, index, .. } = &doc {
        let w = torchmem_viewer::lod::Window {
            t0: 0.0,
            t1: trace.events as f64,
            y0: 0.0,
            y1: trace.layout_bytes as f64,
            cols: 1200,
            rows: 400,
        };
        let r = index.query(trace, w, &|_| false);
        eprintln!("first LOD answer: {} bands, {:?}", r.bands.len(), q.elapsed());
    }
    let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0) as f64 / (1 << 20) as f64;
    eprintln!(
        "load {:?}; VmHWM {:.0} MiB; file {:.0} MiB; ratio {:.2}",
        t.elapsed(),
        vm_hwm_mib(),
        size,
        vm_hwm_mib() / size
    );
}
