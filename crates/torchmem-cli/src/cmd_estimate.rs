//! `torchmem estimate`: predicts a program's GPU peak on a machine without that GPU. The unchanged program runs
//! under the Python tracer (`torchmem.estimator._runner`, injected by a `sitecustomize.py` first on PYTHONPATH,
//! as `torchmem run` injects its part) on an emulated CUDA device for N optimizer steps (a training program) or
//! to its end (inference, evaluation, generation: no optimizer step; `--forward-calls N` bounds it); its
//! storage trace (an allocator snapshot) is replayed by the allocator simulator (`torchmem_sim`) for the peak
//! allocated and reserved; the GPU catalogue (`torchmem_core::gpus`) adds the CUDA context NVML counts and
//! says whether it fits.
//!
//! `--trace SNAPSHOT --summary JSON` reports on a trace written earlier (the Python `torchmem.estimate()`
//! calls this, so both report the same way); `--fit 'batch=1..4096'` searches the largest value that fits
//! (doubling, then bisection) by re-running the command with `{batch}` replaced.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail};
use serde_json::{json, Value};
use torchmem_core::gpus::{self, Gpu};
use torchmem_core::units::format_bytes;
use torchmem_sim::{config, AllocConf, SimOptions};

use crate::cmd_run::resolve_command;

#[derive(Debug, clap::Args)]
pub struct EstimateArgs {
    /// The GPU to predict for (see --list-gpus), e.g. H200, H100-80GB, A100-40GB, L4, RTX-4090.
    #[arg(long, value_name = "NAME", default_value = "H200")]
    pub gpu: String,
    /// The memory CUDA can use instead of the GPU's (a card not in the catalogue), e.g. 24GiB or 24000000000.
    #[arg(long = "device-memory", value_name = "SIZE")]
    pub device_memory: Option<String>,
    /// Optimizer steps to trace before the program is stopped (the peak is usually in step 2).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub steps: u32,
    /// Stop after N top-level forward calls (a call of the outermost module) or Hugging Face `generate` calls,
    /// for a program without an optimizer (inference, evaluation, generation), which is otherwise traced to its
    /// end. On a training program --steps usually comes first.
    #[arg(long = "forward-calls", value_name = "N")]
    pub forward_calls: Option<u32>,
    /// A PYTORCH_CUDA_ALLOC_CONF to simulate, e.g. "expandable_segments:True".
    #[arg(long = "alloc-conf", value_name = "CONF")]
    pub alloc_conf: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// List the GPU catalogue and exit.
    #[arg(long = "list-gpus")]
    pub list_gpus: bool,
    /// Keep the trace (an allocator snapshot `torchmem simulate` and `torchmem snapshot` read) at this path.
    #[arg(long = "keep-trace", value_name = "PATH")]
    pub keep_trace: Option<PathBuf>,
    /// With --keep-trace: overwrite an existing file there (a trace cannot be told from a snapshot PyTorch
    /// recorded, so an existing non-empty file is never replaced without it).
    #[arg(long, requires = "keep_trace")]
    pub force: bool,
    /// Report on a trace written earlier (with --summary) instead of running a program.
    #[arg(long, value_name = "SNAPSHOT", conflicts_with = "command")]
    pub trace: Option<PathBuf>,
    /// The summary JSON written with --trace's snapshot.
    #[arg(long, value_name = "JSON", requires = "trace")]
    pub summary: Option<PathBuf>,
    /// Find the largest value that fits: `NAME=LO..HI[:STEP]` (multiples of STEP); the command's `{NAME}` is
    /// replaced by each value tried (doubling from LO, then bisection).
    #[arg(long, value_name = "NAME=LO..HI")]
    pub fit: Option<String>,
    /// Run a Python module, as `python -m MODULE [ARGS…]`.
    #[arg(short = 'm', value_name = "MODULE")]
    pub module: Option<String>,
    /// The training program: `train.py [ARGS…]` or `python train.py [ARGS…]`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Loads the tracer into the program, then hands over to any sitecustomize the environment already had.
const SITECUSTOMIZE: &str = r#"# Placed first on PYTHONPATH by `torchmem estimate`: runs the program on an emulated CUDA device and
# traces it (torchmem.estimator._runner), then chains to the next sitecustomize on sys.path.
import importlib.util as _tm_util
import os as _tm_os
import sys as _tm_sys

try:
    import torchmem.estimator._runner as _tm_runner
except ImportError as _tm_err:
    # One message for `torchmem estimate` to print, then a quiet exit: sys.exit here would make Python print
    # "Fatal Python error: init_import_site" and a traceback.
    _tm_name = (getattr(_tm_err, "name", None) or "").split(".")[0]
    _tm_what = "torch" if _tm_name == "torch" else "torchmem"
    _tm_msg = (
        f"this Python ({_tm_sys.executable}) cannot import {_tm_what} ({_tm_err}), and the estimate runs the "
        f"program with torchmem and torch. Install {_tm_what} into it (`{_tm_sys.executable} -m pip install "
        f"{_tm_what}`), or run the program with a Python that has both"
    )
    try:
        import json as _tm_json

        with open(_tm_json.loads(_tm_os.environ["TORCHMEM_ESTIMATE"])["startup_error"], "w") as _tm_f:
            _tm_f.write(_tm_msg)
    except Exception:
        _tm_sys.stderr.write(f"torchmem estimate: {_tm_msg}\n")
    _tm_sys.stderr.flush()
    _tm_os._exit(3)
_tm_runner.start_from_env()

_tm_here = _tm_os.path.dirname(_tm_os.path.abspath(__file__))
for _tm_dir in _tm_sys.path:
    if not _tm_dir or _tm_os.path.abspath(_tm_dir) == _tm_here:
        continue
    _tm_path = _tm_os.path.join(_tm_dir, "sitecustomize.py")
    if _tm_os.path.isfile(_tm_path):
        _tm_spec = _tm_util.spec_from_file_location("_torchmem_next_sitecustomize", _tm_path)
        if _tm_spec and _tm_spec.loader:
            _tm_spec.loader.exec_module(_tm_util.module_from_spec(_tm_spec))
        break
"#;

/// The device an estimate is for.
#[derive(Debug, Clone)]
struct Target {
    gpu: Gpu,
    /// What CUDA can use (the GPU's totalGlobalMem, or --device-memory).
    cuda_total_bytes: u64,
}

fn target(args: &EstimateArgs) -> anyhow::Result<Target> {
    let gpu = gpus::find(&args.gpu).ok_or_else(|| {
        anyhow!("unknown GPU {:?}. Known: {} (or give --device-memory)", args.gpu, gpus::keys().join(", "))
    })?;
    let cuda_total_bytes = match &args.device_memory {
        Some(s) => config::parse_size(s).map_err(|e| anyhow!("--device-memory: {e}"))?,
        None => gpu.cuda_total_bytes,
    };
    Ok(Target { gpu, cuda_total_bytes })
}

pub fn run(args: EstimateArgs) -> anyhow::Result<i32> {
    if args.list_gpus {
        return list_gpus(args.json);
    }
    if let Some(conf) = &args.alloc_conf {
        AllocConf::parse(conf).map_err(|e| anyhow!("--alloc-conf: {e}"))?;
    }
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if args.forward_calls == Some(0) {
        bail!("--forward-calls must be at least 1 (leave it out to trace the program to its end)");
    }
    let target = target(&args)?;
    if let Some(trace) = &args.trace {
        let summary =
            args.summary.as_ref().ok_or_else(|| anyhow!("--trace needs --summary (the JSON written with it)"))?;
        crate::existing_file(trace, "trace")?;
        crate::existing_file(summary, "summary")?;
        let text = std::fs::read_to_string(summary).map_err(|e| anyhow!("cannot read {}: {e}", summary.display()))?;
        let summary: Value = serde_json::from_str(&text).map_err(|e| {
            anyhow!(
                "{} is not the summary JSON written with the trace ({e}); pass the file torchmem wrote",
                summary.display()
            )
        })?;
        let report = report(trace, &summary, &target, args.alloc_conf.as_deref())?;
        return print_report(&report, args.json);
    }
    if args.command.is_empty() && args.module.is_none() {
        bail!("give the training program after --, e.g. `torchmem estimate --gpu A100-40GB -- python train.py`");
    }
    if let Some(keep) = &args.keep_trace {
        torchmem_recorder::output_path::check_output(
            keep,
            &[],
            Some(args.force),
            "--keep-trace",
            torchmem_recorder::output_path::OutputKind::Trace,
        )?;
    }
    if let Some(fit) = &args.fit {
        return fit_search(&args, &target, fit);
    }
    let report = estimate_command(&args, &target, &args.command)?;
    print_report(&report, args.json)
}

fn list_gpus(json_out: bool) -> anyhow::Result<i32> {
    let cat = gpus::catalogue();
    if json_out {
        println!("{}", serde_json::to_string_pretty(&cat)?);
        return Ok(0);
    }
    println!("{:<12} {:<28} {:>12} {:>12}  {:>4}  context", "key", "name", "nvidia-smi", "CUDA", "sm");
    for g in cat {
        let ctx = match g.context {
            Some(c) => format!("{}-{} (measured)", format_bytes(c.base_bytes), format_bytes(c.convolution_bytes)),
            None => "H200's assumed".into(),
        };
        println!(
            "{:<12} {:<28} {:>12} {:>12}  {:>2}.{}  {ctx}",
            g.key,
            g.name,
            format_bytes(g.nvml_total_bytes),
            format_bytes(g.cuda_total_bytes),
            g.major,
            g.minor
        );
    }
    Ok(0)
}

/// Runs the program under the tracer and reports; an error names what stopped the estimate.
fn estimate_command(args: &EstimateArgs, target: &Target, command: &[String]) -> anyhow::Result<Value> {
    let argv = resolve_command(args.module.as_deref(), command)?;
    let dir = TempDir::create()?;
    std::fs::write(dir.path.join("sitecustomize.py"), SITECUSTOMIZE)
        .map_err(|e| anyhow!("cannot write into {}: {e}", dir.path.display()))?;
    let trace = match &args.keep_trace {
        Some(p) => p.clone(),
        None => dir.path.join("trace.pickle"),
    };
    let summary_path = dir.path.join("summary.json");
    let startup_error_path = dir.path.join("startup-error.txt");
    let g = &target.gpu;
    let cfg = json!({
        "trace": trace,
        "summary": summary_path,
        "startup_error": startup_error_path,
        "steps": args.steps,
        "forward_calls": args.forward_calls,
        "alloc_conf": args.alloc_conf.clone().unwrap_or_default(),
        "gpu": {"name": g.name, "cuda_total_bytes": target.cuda_total_bytes, "major": g.major, "minor": g.minor,
                "sms": g.multi_processor_count},
    });
    let mut path = std::ffi::OsString::from(&dir.path);
    if let Some(old) = std::env::var_os("PYTHONPATH").filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    let mut cmd = Command::new(&argv[0]);
    if args.json {
        // stdout is the report's: the program's own output goes to stderr.
        cmd.stdout(std::process::Stdio::from(std::io::stderr()));
    }
    let status = cmd
        .args(&argv[1..])
        .env("PYTHONPATH", path)
        .env("TORCHMEM_ESTIMATE", cfg.to_string())
        // The trace never touches a real GPU, even on a machine that has one.
        .env("CUDA_VISIBLE_DEVICES", "")
        .status()
        .map_err(|e| anyhow!("cannot start `{}`: {e}. Check that it is an executable program", argv[0]))?;
    if let Ok(why) = std::fs::read_to_string(&startup_error_path) {
        // The sitecustomize could not load the tracer (no torch, no torchmem in that Python): its one message.
        bail!("{why}");
    }
    let text = std::fs::read_to_string(&summary_path).map_err(|_| {
        anyhow!(
            "`{}` exited ({status}) without starting the estimator: it must be a Python program whose Python can \
             import torchmem and torch (set TORCHMEM_PYTHON for a bare script)",
            argv.join(" ")
        )
    })?;
    let summary: Value = serde_json::from_str(&text)?;
    if summary["reason"] == "error" {
        bail!(
            "the estimate stopped after {}: {}",
            progress(&summary),
            summary["error"].as_str().unwrap_or("unknown error")
        );
    }
    if summary["requests"].as_u64() == Some(0) {
        bail!(
            "`{}` ended without putting anything on the GPU ({}, no CUDA tensor): nothing to estimate. Check that \
             it moves its model and data to \"cuda\" (`model.to(\"cuda\")`)",
            argv.join(" "),
            progress(&summary)
        );
    }
    report(&trace, &summary, target, args.alloc_conf.as_deref())
}

/// What the trace covered: "3 optimizer step(s)", or for a program without an optimizer step "12 forward
/// call(s), 1 generate call(s)".
fn progress(summary: &Value) -> String {
    let steps = summary["steps_traced"].as_u64().unwrap_or(0);
    if steps > 0 || summary.get("forward_calls").is_none() {
        return format!("{steps} optimizer step(s)");
    }
    let forwards = summary["forward_calls"].as_u64().unwrap_or(0);
    let generates = summary["generate_calls"].as_u64().unwrap_or(0);
    if generates > 0 {
        format!("{forwards} forward call(s), {generates} generate call(s)")
    } else {
        format!("{forwards} forward call(s)")
    }
}

/// Simulates the trace on the target and builds the report (the `--json` object).
fn report(trace: &Path, summary: &Value, target: &Target, alloc_conf: Option<&str>) -> anyhow::Result<Value> {
    let snap = torchmem_sim::read_snapshot(trace)?;
    let (ctx, measured) = target.gpu.context_or_assumed();
    let half = summary["uses_half_precision"].as_bool().unwrap_or(false);
    let conv = summary["uses_convolution"].as_bool().unwrap_or(false);
    let context_bytes = ctx.for_run(half, conv);
    let usable = target.cuda_total_bytes.saturating_sub(context_bytes);
    let opts = SimOptions {
        conf: alloc_conf.map(AllocConf::parse).transpose()?,
        device_memory_bytes: Some(usable),
        device_total_bytes: Some(target.cuda_total_bytes),
        detailed: true,
        frees_at_request: true,
        driver_addresses: true,
        ..SimOptions::default()
    };
    let result = torchmem_sim::simulate(&snap, &trace.display().to_string(), &opts);
    let d = result.devices.first().ok_or_else(|| anyhow!("the trace has no device to simulate"))?;
    let nvml_bytes = d.peak_reserved_bytes + context_bytes;
    let fits = d.oom.is_none() && nvml_bytes <= target.cuda_total_bytes;
    let margin = target.cuda_total_bytes as i64 - nvml_bytes as i64;
    let mut notes: Vec<Value> = summary["notes"].as_array().cloned().unwrap_or_default();
    match summary["kind"].as_str() {
        Some("inference") => notes.insert(
            0,
            json!(format!(
                "inference estimate: no optimizer step was seen (no backward either); the program was traced {} \
                 ({})",
                if summary["reason"] == "forward calls" { "to the --forward-calls bound" } else { "to its end" },
                progress(summary)
            )),
        ),
        Some("backward without optimizer step") => notes.insert(
            0,
            json!(format!(
                "no torch.optim optimizer step was seen, but {} backward pass(es) ran (a hand-written update?): \
                 the program was traced {} ({})",
                summary["backward_calls"].as_u64().unwrap_or(0),
                if summary["reason"] == "forward calls" { "to the --forward-calls bound" } else { "to its end" },
                progress(summary)
            )),
        ),
        _ => {}
    }
    if !measured {
        notes.push(json!(format!(
            "the CUDA context overhead of {} is not measured; the H200's ({}) is used",
            target.gpu.key,
            format_bytes(context_bytes)
        )));
    }
    notes.push(json!(
        "CUDA reduction kernels' temporary buffers outside convolutions are not modelled (transient: reserved \
         may be slightly low; see docs/estimator.md)"
    ));
    Ok(json!({
        "gpu": target.gpu.name,
        "gpu_key": target.gpu.key,
        "device_memory_bytes": target.cuda_total_bytes,
        "nvml_total_bytes": target.gpu.nvml_total_bytes,
        "peak_allocated_bytes": d.peak_allocated_bytes,
        "peak_reserved_bytes": d.peak_reserved_bytes,
        "peak_requested_bytes": d.peak_requested_bytes,
        "context_bytes": context_bytes,
        "context_measured": measured,
        "nvml_bytes": nvml_bytes,
        "fits": fits,
        "margin_bytes": margin,
        "num_alloc_retries": d.num_alloc_retries,
        "oom": d.oom.as_ref().map(|o| json!({"entry": o.entry, "frames": o.frames})),
        "kind": summary.get("kind").cloned().unwrap_or_else(|| json!("training")),
        "steps_traced": summary["steps_traced"],
        "forward_calls": summary["forward_calls"],
        "generate_calls": summary["generate_calls"],
        "traced": progress(summary),
        "phase_peak_bytes": summary["phase_peak_bytes"],
        "largest_at_peak": summary["largest_at_peak"],
        "trace_seconds": summary["trace_seconds"],
        "requests": summary["requests"],
        "convolution_workspaces": summary["convolution_workspaces"],
        "alloc_conf": alloc_conf.unwrap_or(""),
        "simulator_rules": result.rules,
        "notes": notes,
    }))
}

fn print_report(r: &Value, json_out: bool) -> anyhow::Result<i32> {
    if json_out {
        println!("{}", serde_json::to_string_pretty(r)?);
    } else {
        print!("{}", report_text(r));
    }
    Ok(if r["fits"].as_bool() == Some(true) { 0 } else { 1 })
}

fn b(v: &Value) -> String {
    format_bytes(v.as_u64().unwrap_or(0))
}

pub fn report_text(r: &Value) -> String {
    let mut s = String::new();
    let total = r["device_memory_bytes"].as_u64().unwrap_or(0);
    let traced = match r["traced"].as_str() {
        Some(t) => t.to_string(),
        None => format!("{} optimizer step(s)", r["steps_traced"]),
    };
    let kind = match r["kind"].as_str() {
        Some("inference") => "inference (no optimizer step), ",
        Some("backward without optimizer step") => "no optimizer step, ",
        _ => "",
    };
    s += &format!(
        "torchmem estimate: {} ({} usable by CUDA), {kind}{traced} traced in {:.1} s, {} requests\n",
        r["gpu"].as_str().unwrap_or("?"),
        b(&r["device_memory_bytes"]),
        r["trace_seconds"].as_f64().unwrap_or(0.0),
        r["requests"]
    );
    s += &format!("  peak allocated   {:>12}\n", b(&r["peak_allocated_bytes"]));
    s += &format!(
        "  peak reserved    {:>12}   (caching allocator simulated, {})\n",
        b(&r["peak_reserved_bytes"]),
        r["simulator_rules"].as_str().unwrap_or("")
    );
    s += &format!(
        "  process (NVML)   {:>12}   (reserved + {} CUDA context and libraries{})\n",
        b(&r["nvml_bytes"]),
        b(&r["context_bytes"]),
        if r["context_measured"].as_bool() == Some(true) { ", measured" } else { ", assumed" }
    );
    let margin = r["margin_bytes"].as_i64().unwrap_or(0);
    if r["fits"].as_bool() == Some(true) {
        let pct = if total > 0 { 100.0 * margin as f64 / total as f64 } else { 0.0 };
        s += &format!("  fits: yes, {} to spare ({pct:.0} % of the device)\n", format_bytes(margin as u64));
        let retries = r["num_alloc_retries"].as_u64().unwrap_or(0);
        if retries > 0 {
            s += &format!(
                "  warning: it fits only by flushing: the caching allocator ran out of memory {retries} time(s), \
                 freed its cache and retried (num_alloc_retries {retries}). Each retry synchronizes the GPU and \
                 slows the step; a little more memory (a larger batch, another GPU) will not fit\n"
            );
        }
    } else if r["oom"].is_object() {
        s += &format!(
            "  fits: NO, the allocator runs out of memory ({} short at the peak)\n",
            format_bytes(margin.unsigned_abs())
        );
    } else {
        s += &format!("  fits: NO, {} over\n", format_bytes(margin.unsigned_abs()));
    }
    if let Some(ph) = r["phase_peak_bytes"].as_object() {
        let parts: Vec<String> = ["forward", "backward", "optimizer"]
            .iter()
            .filter_map(|k| ph.get(*k).map(|v| format!("{k} {}", b(v))))
            .collect();
        if !parts.is_empty() {
            s += &format!("  peak per phase (live tensors): {}\n", parts.join(", "));
        }
    }
    if let Some(top) = r["largest_at_peak"].as_array().filter(|t| !t.is_empty()) {
        s += "  largest tensors live at the peak:\n";
        for t in top.iter().take(8) {
            let site = t["site"]
                .as_str()
                .filter(|x| !x.is_empty())
                .unwrap_or("(no frame: kept for requests of 1 MiB or more)");
            s += &format!(
                "    {:>10}  {:<9} {:<40} {}\n",
                b(&t["size_bytes"]),
                t["phase"].as_str().unwrap_or(""),
                t["what"].as_str().unwrap_or(""),
                site
            );
        }
    }
    if let Some(notes) = r["notes"].as_array() {
        for n in notes {
            s += &format!("  note: {}\n", n.as_str().unwrap_or(""));
        }
    }
    s
}

/// `--fit NAME=LO..HI`: doubling from LO until it does not fit (or HI), then bisection.
fn fit_search(args: &EstimateArgs, target: &Target, spec: &str) -> anyhow::Result<i32> {
    let usage = || anyhow!("--fit wants NAME=LO..HI or NAME=LO..HI:STEP, e.g. batch=1..4096 or batch=8..512:8");
    let (name, range) = spec.split_once('=').ok_or_else(usage)?;
    let (range, step) = match range.split_once(':') {
        Some((r, st)) => {
            (r, st.trim().parse::<u64>().map_err(|_| anyhow!("--fit: step {st:?} is not a whole number"))?)
        }
        None => (range, 1),
    };
    let (lo, hi) = range.split_once("..").ok_or_else(usage)?;
    let lo: u64 = lo.trim().parse().map_err(|_| anyhow!("--fit: {lo:?} is not a whole number"))?;
    let hi: u64 = hi.trim().parse().map_err(|_| anyhow!("--fit: {hi:?} is not a whole number"))?;
    if lo == 0 || lo > hi || step == 0 || lo % step != 0 {
        bail!("--fit: the range must be 1 <= LO <= HI, with LO a multiple of STEP");
    }
    // The search runs over multiples of STEP: units lo/step ..= hi/step.
    let (lo, hi) = (lo / step, hi / step);
    let placeholder = format!("{{{name}}}");
    if !args.command.iter().any(|a| a.contains(&placeholder)) {
        bail!("--fit {name}=...: the command has no {placeholder} to replace");
    }
    let mut tried: Vec<Value> = Vec::new();
    // The estimate at each value tried, for the peaks at the answer and at the first value that does not fit.
    let mut reports: std::collections::BTreeMap<u64, Value> = std::collections::BTreeMap::new();
    let mut attempt = |unit: u64| -> anyhow::Result<bool> {
        let v = unit * step;
        let cmd: Vec<String> = args.command.iter().map(|a| a.replace(&placeholder, &v.to_string())).collect();
        let r = estimate_command(args, target, &cmd)?;
        let fits = r["fits"].as_bool() == Some(true);
        if !args.json {
            eprintln!(
                "torchmem estimate --fit: {name}={v}: {} reserved, fits: {}",
                b(&r["peak_reserved_bytes"]),
                if fits { "yes" } else { "no" }
            );
        }
        tried.push(json!({"value": v, "fits": fits, "peak_reserved_bytes": r["peak_reserved_bytes"], "nvml_bytes": r["nvml_bytes"]}));
        reports.insert(v, r);
        Ok(fits)
    };
    let (mut good, mut bad) = (None::<u64>, None::<u64>);
    let mut v = lo;
    loop {
        if attempt(v)? {
            good = Some(v);
            if v >= hi {
                break;
            }
            v = (v * 2).min(hi);
        } else {
            bad = Some(v);
            break;
        }
    }
    if let (Some(mut g), Some(mut x)) = (good, bad) {
        while x - g > 1 {
            let mid = g + (x - g) / 2;
            if attempt(mid)? {
                g = mid;
            } else {
                x = mid;
            }
        }
        good = Some(g);
    }
    let good = good.map(|u| u * step);
    let first_bad = match (good, bad) {
        (Some(g), Some(_)) => reports.keys().copied().find(|&v| v > g),
        (Some(_), None) => None,
        (None, _) => Some(lo * step),
    };
    let lo = lo * step;
    let peaks = |v: Option<u64>| -> Value {
        match v.and_then(|v| reports.get(&v)) {
            Some(r) => json!({
                "peak_allocated_bytes": r["peak_allocated_bytes"],
                "peak_reserved_bytes": r["peak_reserved_bytes"],
                "nvml_bytes": r["nvml_bytes"],
                "margin_bytes": r["margin_bytes"],
                "oom": r["oom"],
            }),
            None => Value::Null,
        }
    };
    let fit = json!({
        "parameter": name,
        "largest_fitting": good,
        "first_not_fitting": first_bad,
        "at_largest_fitting": peaks(good),
        "at_first_not_fitting": peaks(first_bad),
    });
    let out = json!({
        "fit": fit,
        "gpu": target.gpu.name,
        "device_memory_bytes": target.cuda_total_bytes,
        "command": args.command,
        "tried": tried,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        let nvml = |v: Option<u64>| peaks(v)["nvml_bytes"].as_u64().map(format_bytes).unwrap_or_else(|| "?".into());
        match good {
            Some(g) => {
                println!(
                    "torchmem estimate --fit: largest {name} that fits on {}: {g} (NVML {} of {})",
                    target.gpu.name,
                    nvml(good),
                    format_bytes(target.cuda_total_bytes)
                );
                if let Some(x) = first_bad {
                    println!("  {name}={x} does not fit: NVML {}", nvml(first_bad));
                }
            }
            None => println!("torchmem estimate --fit: even {name}={lo} does not fit on {}", target.gpu.name),
        }
    }
    Ok(if good.is_some() { 0 } else { 1 })
}

/// A private folder for the sitecustomize and the trace, removed when dropped.
struct TempDir {
    path: PathBuf,
}

impl TempDir {
    fn create() -> anyhow::Result<TempDir> {
        let base = std::env::var_os("TMPDIR").filter(|t| !t.is_empty() && Path::new(t).is_dir()).map(PathBuf::from);
        let base = base.unwrap_or_else(|| PathBuf::from("/tmp"));
        let path =
            base.join(format!("torchmem-estimate-{}-{}", std::process::id(), torchmem_core::clock::monotonic_ns()));
        std::fs::create_dir(&path)
            .map_err(|e| anyhow!("cannot create {}: {e}. Set TMPDIR to a writable directory", path.display()))?;
        Ok(TempDir { path })
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fit_that_needs_alloc_retries_says_it_only_fits_by_flushing() {
        let mut r = json!({
            "gpu": "NVIDIA L4", "device_memory_bytes": 23_580_639_232u64, "steps_traced": 3, "trace_seconds": 1.0,
            "requests": 10, "peak_allocated_bytes": 20u64 << 30, "peak_reserved_bytes": 21u64 << 30,
            "nvml_bytes": 22u64 << 30, "context_bytes": 1u64 << 28, "context_measured": true, "fits": true,
            "margin_bytes": 86_900_000, "num_alloc_retries": 7, "simulator_rules": "torch 2.11",
        });
        let text = report_text(&r);
        assert!(text.contains("fits: yes, 82.9 MiB to spare"), "{text}");
        assert!(text.contains("warning: it fits only by flushing") && text.contains("7 time(s)"), "{text}");
        r["num_alloc_retries"] = json!(0);
        assert!(!report_text(&r).contains("warning"), "no retry, no warning");
    }

    #[test]
    fn a_program_without_an_optimizer_step_is_reported_as_inference() {
        let summary = json!({"kind": "inference", "steps_traced": 0, "forward_calls": 0, "generate_calls": 2});
        assert_eq!(progress(&summary), "0 forward call(s), 2 generate call(s)");
        let training = json!({"kind": "training", "steps_traced": 3, "forward_calls": 3, "generate_calls": 0});
        assert_eq!(progress(&training), "3 optimizer step(s)");
        let r = json!({
            "gpu": "NVIDIA H200", "device_memory_bytes": 150_109_880_320u64, "kind": "inference",
            "traced": progress(&summary), "steps_traced": 0, "trace_seconds": 2.0, "requests": 10,
            "peak_allocated_bytes": 1u64 << 30, "peak_reserved_bytes": 1u64 << 30, "nvml_bytes": 2u64 << 30,
            "context_bytes": 1u64 << 30, "context_measured": true, "fits": true, "margin_bytes": 1u64 << 36,
            "num_alloc_retries": 0, "simulator_rules": "torch 2.11",
        });
        let text = report_text(&r);
        assert!(
            text.starts_with(
                "torchmem estimate: NVIDIA H200 (139.80 GiB usable by CUDA), inference (no optimizer step), 0 \
                 forward call(s), 2 generate call(s) traced in 2.0 s"
            ),
            "{text}"
        );
    }
}
