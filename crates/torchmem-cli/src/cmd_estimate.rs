//! `torchmem estimate`: predicts a program's GPU peak on a machine without that GPU. The unchanged program runs
//! under the Python tracer (`torchmem.estimator._runner`, injected by a `sitecustomize.py` first on PYTHONPATH,
//! as `torchmem run` injects its part) on an emulated CUDA device for N optimizer steps (a training program) or
//! to its end (inference, evaluation, generation: no optimizer step; `--forward-calls N` bounds it); its
//! storage trace (an allocator snapshot) and summary go to the estimate use case (`torchmem_estimator`: the
//! replay through the allocator simulator, the GPU catalogue, the typed report and its text, the `--fit`
//! search), which `torchmem.estimate()` calls in-process too, so both report the same way. This module is
//! arguments → call → print, plus the launch of the program under the tracer (the sitecustomize, the
//! environment, a private temp dir), which stays here.
//!
//! `--trace SNAPSHOT --summary JSON` reports on a trace written earlier; `--fit 'batch=1..4096'` searches
//! the largest value that fits by re-running the command with `{batch}` replaced.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail};
use serde_json::json;
use torchmem_estimator::{estimate_trace, gpus, EstimateReport, FitSpec, StopReason, Summary, Target};
use torchmem_sim::AllocConf;
use torchmem_units::format_bytes;

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
    /// Nodes of the distributed job (torchrun's flag): the program runs as one rank of an emulated world of
    /// --nnodes x --nproc-per-node ranks (torch's fake process group: collectives allocate their outputs,
    /// nothing waits). Without these flags: WORLD_SIZE from the environment, else 1.
    #[arg(long, value_name = "N")]
    pub nnodes: Option<u32>,
    /// Processes (GPUs) per node (torchrun's flag); with --nnodes the world's size.
    #[arg(long = "nproc-per-node", value_name = "P")]
    pub nproc_per_node: Option<u32>,
    /// The rank to trace (default 0). Ranks of symmetric FSDP2 / DDP / TP jobs behave alike: rank 0 stands for all.
    #[arg(long, value_name = "R")]
    pub rank: Option<u32>,
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

/// The device an estimate is for: `--gpu`, with `--device-memory` instead of its memory when given.
fn target(args: &EstimateArgs) -> anyhow::Result<Target> {
    let device_memory_bytes = match &args.device_memory {
        Some(s) => Some(torchmem_units::parse_size(s).map_err(|e| anyhow!("--device-memory: {e}"))?),
        None => None,
    };
    Target::new(&args.gpu, device_memory_bytes).map_err(|e| match e {
        torchmem_estimator::EstimateError::UnknownGpu { name, known } => {
            anyhow!("unknown GPU {name:?}. Known: {known} (or give --device-memory)")
        }
        e => e.into(),
    })
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
    world(&args)?;
    let target = target(&args)?;
    if let Some(trace) = &args.trace {
        let summary =
            args.summary.as_ref().ok_or_else(|| anyhow!("--trace needs --summary (the JSON written with it)"))?;
        crate::existing_file(trace, "trace")?;
        crate::existing_file(summary, "summary")?;
        let summary = Summary::read(summary)?;
        let report = estimate_trace(trace, &summary, &target, args.alloc_conf.as_deref())?;
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
        return fit_search(&args, &target, &FitSpec::parse(fit)?);
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
    print!("{}", gpus::catalogue_text());
    Ok(0)
}

/// The emulated world `--nnodes`, `--nproc-per-node` and `--rank` ask for (the tracer's `distributed`
/// config), or None: the tracer then reads WORLD_SIZE / RANK from the environment, else runs one rank.
fn world(args: &EstimateArgs) -> anyhow::Result<Option<serde_json::Value>> {
    if args.nnodes.is_none() && args.nproc_per_node.is_none() && args.rank.is_none() {
        return Ok(None);
    }
    let nnodes = args.nnodes.unwrap_or(1);
    let per_node = args.nproc_per_node.unwrap_or(1);
    if nnodes == 0 || per_node == 0 {
        bail!("--nnodes and --nproc-per-node must be at least 1 (a world of --nnodes x --nproc-per-node ranks)");
    }
    let world_size = u64::from(nnodes) * u64::from(per_node);
    let rank = u64::from(args.rank.unwrap_or(0));
    if rank >= world_size {
        bail!(
            "--rank {rank} is not in a world of {world_size} ranks (--nnodes {nnodes} x --nproc-per-node {per_node}): \
             give a rank from 0 to {}",
            world_size - 1
        );
    }
    Ok(Some(json!({"world_size": world_size, "rank": rank, "nproc_per_node": per_node})))
}

/// Runs the program under the tracer and reports; an error names what stopped the estimate.
fn estimate_command(args: &EstimateArgs, target: &Target, command: &[String]) -> anyhow::Result<EstimateReport> {
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
        "distributed": world(args)?,
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
    let summary: Summary = serde_json::from_str(&text)
        .map_err(|e| anyhow!("the tracer's summary {} cannot be read: {e}", summary_path.display()))?;
    if summary.reason == Some(StopReason::Error) {
        bail!(
            "the estimate stopped after {}: {}",
            summary.progress(),
            summary.error.as_deref().unwrap_or("unknown error")
        );
    }
    if summary.requests == Some(0) {
        bail!(
            "`{}` ended without putting anything on the GPU ({}, no CUDA tensor): nothing to estimate. Check that \
             it moves its model and data to \"cuda\" (`model.to(\"cuda\")`)",
            argv.join(" "),
            summary.progress()
        );
    }
    Ok(estimate_trace(&trace, &summary, target, args.alloc_conf.as_deref())?)
}

fn print_report(r: &EstimateReport, json_out: bool) -> anyhow::Result<i32> {
    if json_out {
        println!("{}", serde_json::to_string_pretty(r)?);
    } else {
        print!("{}", r.text());
    }
    Ok(r.exit_code())
}

/// `--fit NAME=LO..HI`: the estimator's search, each value an estimate of the command with `{NAME}` replaced.
fn fit_search(args: &EstimateArgs, target: &Target, spec: &FitSpec) -> anyhow::Result<i32> {
    spec.check_command(&args.command)?;
    let out = spec.search(target, &args.command, |v| -> anyhow::Result<EstimateReport> {
        let r = estimate_command(args, target, &spec.substitute(&args.command, v))?;
        if !args.json {
            let yes = |b: bool| if b { "yes" } else { "no" };
            eprintln!(
                "torchmem estimate --fit: {}={v}: {} reserved ({} upper bound), fits: {} (point estimate: {})",
                spec.name,
                format_bytes(r.peak_reserved_bytes),
                format_bytes(r.peak_reserved_upper_bytes),
                yes(r.fits),
                yes(r.fits_point)
            );
        }
        Ok(r)
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", out.text(spec.lo));
    }
    Ok(out.exit_code())
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
