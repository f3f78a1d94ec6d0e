//! The timeline as CSV (`torchmem report --format csv`): one row per CPU sample, in time order, with the
//! latest GPU values (PyTorch allocator and NVML, which are sampled on their own ticks) carried forward.
//!
//! Columns: `t_s, cpu_rss_bytes, cpu_pss_bytes, cpu_uss_bytes, processes`, then for every GPU device `D`
//! seen in the run: `gpuD_allocated_bytes, gpuD_reserved_bytes, gpuD_nvml_process_bytes,
//! gpuD_nvml_used_bytes`. An empty cell means "not measured": PSS/USS on ticks where they were not read (they
//! are read at a slower rate), a GPU value before its first sample. A CPU-only run has no GPU columns.

use crate::model::Profile;

/// The GPU device indices in the run (PyTorch's and NVML's), sorted.
pub fn devices(profile: &Profile) -> Vec<u32> {
    let mut d: Vec<u32> = profile.torch.iter().map(|s| s.device).chain(profile.gpu.iter().map(|s| s.device)).collect();
    d.sort_unstable();
    d.dedup();
    d
}

fn cell(v: Option<u64>) -> String {
    v.map(|b| b.to_string()).unwrap_or_default()
}

/// The header line (without newline).
pub fn header(devices: &[u32]) -> String {
    let mut cols: Vec<String> =
        ["t_s", "cpu_rss_bytes", "cpu_pss_bytes", "cpu_uss_bytes", "processes"].map(String::from).to_vec();
    for d in devices {
        for what in ["allocated", "reserved", "nvml_process", "nvml_used"] {
            cols.push(format!("gpu{d}_{what}_bytes"));
        }
    }
    cols.join(",")
}

/// The whole timeline as CSV text.
pub fn render(profile: &Profile) -> String {
    let devs = devices(profile);
    let mut out = String::with_capacity(64 * (profile.cpu.len() + 1));
    out.push_str(&header(&devs));
    out.push('\n');
    // Latest values per device: (allocated, reserved, nvml process, nvml used).
    let mut latest: Vec<[Option<u64>; 4]> = vec![[None; 4]; devs.len()];
    let slot = |d: u32| devs.binary_search(&d).ok();
    let (mut ti, mut gi) = (0usize, 0usize);
    for s in &profile.cpu {
        while ti < profile.torch.len() && profile.torch[ti].t_ns <= s.t_ns {
            let t = &profile.torch[ti];
            if let Some(k) = slot(t.device) {
                latest[k][0] = Some(t.allocated_bytes);
                latest[k][1] = Some(t.reserved_bytes);
            }
            ti += 1;
        }
        while gi < profile.gpu.len() && profile.gpu[gi].t_ns <= s.t_ns {
            let g = &profile.gpu[gi];
            if let Some(k) = slot(g.device) {
                latest[k][2] = g.process_bytes;
                latest[k][3] = Some(g.used_bytes);
            }
            gi += 1;
        }
        out.push_str(&format!(
            "{:.6},{},{},{},{}",
            s.t_ns as f64 / 1e9,
            s.rss_bytes,
            cell(s.pss_bytes),
            cell(s.uss_bytes),
            s.process_count
        ));
        for vals in &latest {
            for v in vals {
                out.push(',');
                out.push_str(&cell(*v));
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    #[test]
    fn one_row_per_cpu_sample_with_gpu_carried_forward() {
        let mut p = Profile::default();
        for i in 0..4u64 {
            p.cpu.push(CpuSample {
                t_ns: i * 10_000_000,
                rss_bytes: 1000 + i,
                pss_bytes: (i == 2).then_some(900),
                uss_bytes: None,
                process_count: 2,
            });
        }
        p.torch.push(TorchSample {
            t_ns: 15_000_000,
            device: 0,
            allocated_bytes: 50,
            reserved_bytes: 64,
            peak_allocated_bytes: 50,
            peak_reserved_bytes: 64,
            active_bytes: 50,
            inactive_split_bytes: 0,
            origin: Default::default(),
        });
        p.gpu.push(GpuSample {
            t_ns: 5_000_000,
            device: 0,
            used_bytes: 7000,
            total_bytes: 9000,
            process_bytes: Some(3000),
        });
        let text = render(&p);
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(rows[0], "t_s,cpu_rss_bytes,cpu_pss_bytes,cpu_uss_bytes,processes,gpu0_allocated_bytes,gpu0_reserved_bytes,gpu0_nvml_process_bytes,gpu0_nvml_used_bytes");
        assert_eq!(rows.len(), 5);
        assert_eq!(rows[1], "0.000000,1000,,,2,,,,");
        assert_eq!(rows[2], "0.010000,1001,,,2,,,3000,7000");
        assert_eq!(rows[3], "0.020000,1002,900,,2,50,64,3000,7000");
        assert_eq!(rows[4], "0.030000,1003,,,2,50,64,3000,7000");
    }

    #[test]
    fn cpu_only_run_has_no_gpu_columns() {
        let mut p = Profile::default();
        p.cpu.push(CpuSample { t_ns: 0, rss_bytes: 1, pss_bytes: None, uss_bytes: None, process_count: 1 });
        assert_eq!(render(&p), "t_s,cpu_rss_bytes,cpu_pss_bytes,cpu_uss_bytes,processes\n0.000000,1,,,1\n");
    }
}
