//! The JSON report (`torchmem report --format json`): every fact of the text report as data, with stable
//! keys documented in `docs/reports.md`. Bytes are integers (`*_bytes`), times nanoseconds (`*_ns`); a value
//! that was not measured (no GPU, not recorded) is `null`, never 0.

use serde_json::{json, Value};

use crate::analysis::Summary;
use crate::lines;
use crate::model::Profile;

/// Bumped when a key changes meaning or disappears (adding keys does not bump it).
pub const REPORT_VERSION: u64 = 1;

fn value<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// The report as a JSON value.
pub fn to_value(profile: &Profile, summary: &Summary) -> Value {
    let m = &profile.meta;
    json!({
        "format": "torchmem-report",
        "version": REPORT_VERSION,
        "profile": profile.path.display().to_string(),
        "meta": {
            "command": m.command,
            "exit_code": m.exit_code,
            "finished": m.duration_ns.is_some(),
            "recording": m.recording,
            "signal": m.signal,
            "signal_name": m.signal.map(crate::model::signal_name),
            "oom": value(&m.oom),
            "oom_killed": m.signal.zip(m.oom.as_ref()).and_then(|(s, o)| o.killed_program(s)),
            "duration_ns": summary.duration_ns,
            "interval_ms": m.interval_ms,
            "started_unix_s": m.started_unix_s,
            "hostname": m.hostname,
            "host_total_bytes": m.host_total_bytes,
            "gpu_names": m.gpu_names,
            "gpu_total_bytes": m.gpu_total_bytes,
            "torchmem_version": m.torchmem_version,
            "launch": m.launch,
            "write_failure": value(&m.write_failure),
        },
        "samples": summary.samples,
        "torch_samples": summary.torch_samples,
        "gpu_samples": summary.gpu_samples,
        "cuda": !summary.peak.gpus.is_empty(),
        "peak": value(&summary.peak),
        "phases": value(&summary.phases),
        "epochs": value(&summary.epochs),
        "steps": summary.steps,
        "epoch_totals": value(&summary.epoch_totals),
        "processes": value(&summary.processes),
        "growth": summary.growth.iter().map(super::findings::growth_json).collect::<Vec<_>>(),
        "leaks": value(&summary.leaks),
        "breakdown": value(&summary.breakdown),
        "journey": value(&summary.journey),
        "lines": lines::to_json(&profile.line_profiles),
    })
}

/// The report as pretty-printed JSON text.
pub fn render(profile: &Profile, summary: &Summary) -> String {
    let mut s = serde_json::to_string_pretty(&to_value(profile, summary)).unwrap_or_else(|_| "{}".into());
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::*;

    const MIB: u64 = 1 << 20;

    fn profile(gpu: bool) -> Profile {
        let mut p = Profile {
            meta: RunMeta {
                command: vec!["python".into(), "t.py".into()],
                interval_ms: 10.0,
                exit_code: Some(0),
                duration_ns: Some(3_000_000_000),
                ..Default::default()
            },
            ..Default::default()
        };
        for i in 0..3u64 {
            p.cpu.push(CpuSample {
                t_ns: i * 1_000_000_000,
                rss_bytes: (100 + i) * MIB,
                pss_bytes: Some(90 * MIB),
                uss_bytes: None,
                process_count: 1,
            });
        }
        if gpu {
            p.torch.push(TorchSample {
                t_ns: 1,
                device: 0,
                allocated_bytes: 5 * MIB,
                reserved_bytes: 8 * MIB,
                peak_allocated_bytes: 7 * MIB,
                peak_reserved_bytes: 8 * MIB,
                active_bytes: 5 * MIB,
                inactive_split_bytes: 0,
                origin: Default::default(),
            });
            p.gpu.push(GpuSample {
                t_ns: 1,
                device: 0,
                used_bytes: 900 * MIB,
                total_bytes: 1000 * MIB,
                process_bytes: Some(600 * MIB),
            });
        }
        p
    }

    #[test]
    fn keys_are_stable_and_bytes_are_integers() {
        let p = profile(true);
        let v = to_value(&p, &Summary::from_profile(&p));
        for key in [
            "format",
            "version",
            "meta",
            "samples",
            "peak",
            "phases",
            "epochs",
            "processes",
            "growth",
            "journey",
            "lines",
            "cuda",
        ] {
            assert!(v.get(key).is_some(), "missing {key}: {v}");
        }
        assert_eq!(v["samples"], 3);
        assert_eq!(v["peak"]["cpu_rss_bytes"], 102 * MIB);
        assert_eq!(v["peak"]["cpu_rss_t_ns"], 2_000_000_000u64);
        let g = &v["peak"]["gpus"][0];
        assert_eq!(g["device"], 0);
        assert_eq!(g["allocated_bytes"], 7 * MIB);
        assert_eq!(g["reserved_bytes"], 8 * MIB);
        assert_eq!(g["nvml_process_bytes"], 600 * MIB);
        assert_eq!(g["nvml_used_bytes"], 900 * MIB);
        assert_eq!(v["meta"]["command"][1], "t.py");
        assert_eq!(v["meta"]["exit_code"], 0);
        assert_eq!(v["meta"]["interval_ms"], 10.0);
        assert_eq!(v["cuda"], true);
        // round trip through text
        let back: Value = serde_json::from_str(&render(&p, &Summary::from_profile(&p))).unwrap();
        assert_eq!(back, v);
    }

    #[test]
    fn cpu_only_run_has_no_gpu_entries_and_null_not_zero() {
        let p = profile(false);
        let v = to_value(&p, &Summary::from_profile(&p));
        assert_eq!(v["cuda"], false);
        assert_eq!(v["peak"]["gpus"].as_array().unwrap().len(), 0);
        assert!(v["peak"]["cpu_uss_bytes"].is_null());
    }
}
