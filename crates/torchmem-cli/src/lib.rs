//! The `torchmem` command line. `run(argv)` is the whole program; `main.rs` and the Python entry point
//! (`torchmem._native.cli_main`) both call it, so the wheel and `cargo install` behave the same.
//!
//! One file per subcommand: `cmd_info`, `cmd_run` (its arguments; the recording engine is the
//! `torchmem-recorder` crate), `cmd_report`, `cmd_plot`, `cmd_snapshot` (snapshot + explain-oom), `cmd_simulate` (the
//! allocator simulator's what-ifs), `cmd_estimate` (the estimator: the program under the emulated device,
//! its trace replayed by the simulator), `cmd_top` (the live view, drawn by `tui`), `cmd_view` (the interactive
//! viewer: the `torchmem-viewer` crate).

use std::ffi::OsString;
use std::path::Path;

use clap::{Parser, Subcommand};

pub mod cmd_estimate;
pub mod cmd_info;
pub mod cmd_plot;
pub mod cmd_report;
pub mod cmd_run;
pub mod cmd_simulate;
pub mod cmd_snapshot;
pub mod cmd_top;
pub mod cmd_view;
pub mod status_bar;
pub mod tui;

#[derive(Debug, Parser)]
#[command(name = "torchmem", version, about = "Where does my PyTorch memory go, and will it fit?", long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Devices (total, free, used by other processes), driver/CUDA/torch versions, host RAM.
    Info(cmd_info::InfoArgs),
    /// Run a program and record its memory (CPU tree, GPU via NVML, PyTorch's allocator) into a profile.
    Run(cmd_run::RunArgs),
    /// Print a profile's peaks, phases, epochs and processes.
    Report(cmd_report::ReportArgs),
    /// Write a self-contained, offline HTML (or SVG) chart of a profile.
    Plot(cmd_plot::PlotArgs),
    /// Read a PyTorch allocator snapshot (pickle or JSON): summary, top sites, HTML, diff.
    Snapshot(cmd_snapshot::SnapshotArgs),
    /// Diagnose a PyTorch out-of-memory message pasted from a log.
    ExplainOom(cmd_snapshot::ExplainOomArgs),
    /// Replay a snapshot's trace through a model of the caching allocator: check it, or ask what-ifs
    /// (other PYTORCH_CUDA_ALLOC_CONF, a memory cap, a smaller GPU, the minimum memory).
    Simulate(cmd_simulate::SimulateArgs),
    /// Predict a training program's GPU peak (allocated, reserved, NVML) on a GPU this machine may not have.
    Estimate(cmd_estimate::EstimateArgs),
    /// Live full-screen view of everything running under `torchmem run` (or of one profile): GPUs, host
    /// RAM, processes with RSS/PSS, PyTorch's allocated/reserved, phase, step and epoch, with history.
    Top(cmd_top::TopArgs),
    /// Interactive memory viewer in the browser (snapshot, estimate or simulation trace, run profile; two
    /// files side by side), served from 127.0.0.1, or one offline page with -o.
    View(cmd_view::ViewArgs),
}

/// Parses `argv` (program name first) and runs the subcommand; returns the process exit code.
pub fn run(argv: Vec<OsString>) -> i32 {
    let cli = match Cli::try_parse_from(argv) {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return code;
        }
    };
    let result = match cli.command {
        Command::Info(a) => cmd_info::run(a),
        Command::Run(a) => cmd_run::run(a),
        Command::Report(a) => cmd_report::run(a),
        Command::Plot(a) => cmd_plot::run(a),
        Command::Snapshot(a) => cmd_snapshot::run(a),
        Command::ExplainOom(a) => cmd_snapshot::explain_oom(a),
        Command::Simulate(a) => cmd_simulate::run(a),
        Command::Estimate(a) => cmd_estimate::run(a),
        Command::Top(a) => cmd_top::run(a),
        Command::View(a) => cmd_view::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("torchmem: error: {e:#}");
            1
        }
    }
}

/// A path argument that must name an existing file; used for clear "no such file" errors.
pub fn existing_file(path: &Path, what: &str) -> anyhow::Result<()> {
    if !path.exists() {
        anyhow::bail!("{}: no such {what}. Check the path", path.display());
    }
    Ok(())
}
