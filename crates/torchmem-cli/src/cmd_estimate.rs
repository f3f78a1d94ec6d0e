//! `torchmem estimate`: predicts a program's GPU peak on a machine without that GPU. The unchanged program runs
//! under the Python tracer (`torchmem.estimator._runner`, injected by a `sitecustomize.py` first on PYTHONPATH,
//! as `torchmem run` injects its part) on an emulated CUDA device for N optimizer steps (a training program) or
//! to its end (inference, evaluation, generation: no optimizer step; `--forward-calls N` bounds it); its
//! storage trace (an allocator snapshot) and summary go to the estimate use case (`torchmem_estimator`: the
//! replay through the allocator simulator, the GPU catalogue, the typed report and its text, the `--fit`
//! search), which `torchmem.estimate()` calls in-process too, so both report the same way. This module is
//! arguments → call → print: the program is resolved and started as `torchmem run` starts it
//! (`torchmem_recorder::launch`: the interpreter, PATH, a private folder with the injected sitecustomize first
//! on PYTHONPATH); what stays here is the tracer's part (its sitecustomize, its `TORCHMEM_ESTIMATE` config, the
//! program's stdout on stderr with --json, no real GPU) and reading its summary back.
//!
//! `--trace SNAPSHOT --summary JSON` reports on a trace written earlier; `--fit 'batch=1..4096'` searches
//! the largest value that fits by re-running the command with `{batch}` replaced.

use std::path::PathBuf;

use anyhow::{anyhow, bail};
use serde_json::json;
use torchmem_estimator::{
    estimate_trace, gpus, merge_rank_classes, EstimateReport, FitSpec, StopReason, Summary, Target,
};
use torchmem_sim::AllocConf;
use torchmem_units::format_bytes;

use torchmem_recorder::launch::{self, PrivateDir, Program};

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
    /// The rank to trace first (default 0). Ranks of symmetric FSDP2 / DDP / TP jobs behave alike: it stands for
    /// all; where ranks differ (pipeline stages, uneven shards), one rank of each other class is traced too.
    #[arg(long, value_name = "R")]
    pub rank: Option<u32>,
    /// Run a Python module, as `python -m MODULE [ARGS…]`.
    #[arg(short = 'm', value_name = "MODULE")]
    pub module: Option<String>,
    /// The training program: `train.py [ARGS…]` or `python train.py [ARGS…]`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Loads the tracer into the program (`launch::sitecustomize` appends the hand-over to the environment's own
/// sitecustomize).
const TRACER_SITECUSTOMIZE: &str = include_str!("sitecustomize_estimate.py");

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
    let report = estimate_world(&args, &target, &args.command)?;
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

/// Every rank of the world (issue 24): the asked rank is traced; when its trace finds ranks that behave
/// differently (pipeline stages, uneven shards), one rank of each other class is traced and simulated too, and
/// the report lists every class, worst first, the worst one's numbers at the top level.
fn estimate_world(args: &EstimateArgs, target: &Target, command: &[String]) -> anyhow::Result<EstimateReport> {
    let first = estimate_command(args, target, command, None)?;
    let others: Vec<(u64, String)> =
        first.ranks.iter().filter(|c| c.traced_rank != first.rank).map(|c| (c.traced_rank, c.what.clone())).collect();
    if others.is_empty() {
        return Ok(first);
    }
    let mut reports = Vec::with_capacity(others.len());
    for (rank, what) in others {
        if !args.json {
            eprintln!("torchmem estimate: ranks differ ({} classes): tracing rank {rank} ({what})", first.ranks.len());
        }
        reports.push(estimate_command(args, target, command, Some(rank))?);
    }
    Ok(merge_rank_classes(first, reports))
}

/// Runs the program under the tracer (as `rank` when given, else the asked rank) and reports; an error names
/// what stopped the estimate.
fn estimate_command(
    args: &EstimateArgs,
    target: &Target,
    command: &[String],
    rank: Option<u64>,
) -> anyhow::Result<EstimateReport> {
    let program = Program::resolve(args.module.as_deref(), command)?;
    let dir = PrivateDir::create(&launch::temp_base(), "estimate", &launch::sitecustomize(TRACER_SITECUSTOMIZE))?;
    let trace = match (&args.keep_trace, rank) {
        (Some(p), None) => p.clone(),
        _ => dir.path().join("trace.pickle"),
    };
    let mut distributed = world(args)?;
    if let (Some(d), Some(r)) = (distributed.as_mut(), rank) {
        d["rank"] = json!(r);
    }
    let summary_path = dir.path().join("summary.json");
    let startup_error_path = dir.path().join("startup-error.txt");
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
        "distributed": distributed,
    });
    let mut cmd = program.command();
    dir.inject_into(&mut cmd);
    if args.json {
        // stdout is the report's: the program's own output goes to stderr.
        cmd.stdout(std::process::Stdio::from(std::io::stderr()));
    }
    if let (None, Some(r)) = (&distributed, rank) {
        // The world came from the environment (WORLD_SIZE): this class's rank as RANK.
        cmd.env("RANK", r.to_string());
    }
    let status = cmd
        .env("TORCHMEM_ESTIMATE", cfg.to_string())
        // The trace never touches a real GPU, even on a machine that has one.
        .env("CUDA_VISIBLE_DEVICES", "")
        .status()
        .map_err(|e| anyhow!("cannot start `{}`: {e}. Check that it is an executable program", program.argv[0]))?;
    if let Ok(why) = std::fs::read_to_string(&startup_error_path) {
        // The sitecustomize could not load the tracer (no torch, no torchmem in that Python): its one message.
        bail!("{why}");
    }
    let text = std::fs::read_to_string(&summary_path).map_err(|_| {
        anyhow!(
            "`{}` exited ({status}) without starting the estimator: it must be a Python program whose Python can \
             import torchmem and torch (set TORCHMEM_PYTHON for a bare script)",
            program.shown()
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
            program.shown(),
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
        // Every class of ranks must fit: the merged report's `fits` is every class's.
        let r = estimate_world(args, target, &spec.substitute(&args.command, v))?;
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
