//! `torchmem simulate SNAPSHOT`: replays an allocator snapshot's trace through the caching-allocator model
//! (torch 2.11 rules). With the recorded settings it checks itself against the recording; with
//! `--alloc-conf`, `--memory-limit` or `--device-memory` it answers what-ifs; `--min-memory` bisects for the
//! smallest memory limit that runs without OOM; `--compare` puts the common settings side by side. All the
//! work is in the torchmem-sim crate.

use std::path::PathBuf;

use serde_json::json;
use torchmem_sim::{render, replay, search, AllocConf, Prepared, SimOptions};

#[derive(Debug, clap::Args)]
pub struct SimulateArgs {
    /// Snapshot file (`_dump_snapshot` pickle, its JSON form, or either gzipped).
    pub snapshot: PathBuf,
    /// A PYTORCH_CUDA_ALLOC_CONF string to simulate instead of the recorded settings, e.g.
    /// "expandable_segments:True" or "max_split_size_mb:64,roundup_power2_divisions:[256:1,512:2,>:8]".
    #[arg(long, value_name = "CONF")]
    pub alloc_conf: Option<String>,
    /// A per-process cap (what set_per_process_memory_fraction does), e.g. 14GiB or 15000000000.
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
    /// The memory the allocator can get from the device (a smaller card), e.g. 80GB; `recorded`: what it
    /// could have had at the recording's out-of-memory error (held + free then).
    #[arg(long, value_name = "SIZE")]
    pub device_memory: Option<String>,
    /// The smallest memory limit under which the trace runs without OOM, with these settings and with
    /// expandable segments.
    #[arg(long)]
    pub min_memory: bool,
    /// A table of the common settings side by side (with each one's minimum memory).
    #[arg(long)]
    pub compare: bool,
    /// Only this device.
    #[arg(long, value_name = "N")]
    pub device: Option<i64>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

fn size_arg(flag: &str, v: &Option<String>) -> anyhow::Result<Option<u64>> {
    match v {
        None => Ok(None),
        Some(s) => torchmem_units::parse_size(s).map(Some).map_err(|e| anyhow::anyhow!("{flag}: {e}")),
    }
}

pub fn run(args: SimulateArgs) -> anyhow::Result<i32> {
    crate::existing_file(&args.snapshot, "snapshot file")?;
    let conf = match &args.alloc_conf {
        Some(s) => Some(AllocConf::parse(s)?),
        None => None,
    };
    let opts = SimOptions {
        conf,
        memory_limit_bytes: size_arg("--memory-limit", &args.memory_limit)?,
        device_memory_bytes: match args.device_memory.as_deref() {
            Some("recorded") => None,
            _ => size_arg("--device-memory", &args.device_memory)?,
        },
        device_memory_from_oom: args.device_memory.as_deref() == Some("recorded"),
        detailed: true,
        ..Default::default()
    };
    let snap = torchmem_sim::read_snapshot(&args.snapshot)?;
    let name = args.snapshot.display().to_string();
    let mut result = torchmem_sim::simulate(&snap, &name, &opts);
    if let Some(d) = args.device {
        if !result.devices.iter().any(|x| x.device == d) && !result.refused.iter().any(|x| x.device == d) {
            anyhow::bail!("{name}: no device {d} in the snapshot (devices: {:?})", replay::devices(&snap));
        }
        result.devices.retain(|x| x.device == d);
        result.refused.retain(|x| x.device == d);
    }
    let mut min_rows = Vec::new();
    let mut compare_rows = Vec::new();
    if args.min_memory || args.compare {
        for d in result.devices.iter().map(|d| d.device) {
            let p = Prepared::new(&snap, d).map_err(|e| anyhow::anyhow!(e))?;
            if args.min_memory {
                min_rows.push((d, search::min_memory_settings(&p, &opts)));
            }
            if args.compare {
                compare_rows.push((d, search::compare(&p, &opts, true)));
            }
        }
    }
    if args.json {
        let mut v = render::json(&result);
        if args.min_memory {
            v["min_memory"] =
                json!(min_rows.iter().map(|(d, rows)| json!({ "device": d, "settings": rows })).collect::<Vec<_>>());
        }
        if args.compare {
            v["compare"] = json!(compare_rows
                .iter()
                .map(|(d, rows)| json!({
                    "device": d,
                    "rows": rows.iter().map(|r| json!({
                        "settings": r.settings,
                        "min_memory_bytes": r.min_memory_bytes,
                        "result": render::device_json(&r.result),
                    })).collect::<Vec<_>>(),
                }))
                .collect::<Vec<_>>());
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    print!("{}", render::text(&result));
    for (d, rows) in &min_rows {
        print!("{}", render::min_memory_text(*d, rows));
    }
    for (d, rows) in &compare_rows {
        print!("{}", render::compare_text(*d, rows));
    }
    Ok(0)
}
