//! `torchmem snapshot` (summary, `--top`, `--at`, `--json`, `--html`, and `snapshot diff A B`) and
//! `torchmem explain-oom "MESSAGE"`. All the work is in the torchmem-snapshot crate; the page's what-if panel
//! (the trace under other allocator settings) is computed by torchmem-sim and handed to the page as rows.

use std::path::{Path, PathBuf};

use anyhow::Context;
use torchmem_snapshot::{diff, fmt::bytes, fmt::signed_bytes, html, oom, sites, summary};

#[derive(Debug, clap::Args)]
pub struct SnapshotArgs {
    /// Snapshot file (`_dump_snapshot` pickle or its JSON form), or `diff A B`.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Show the N allocation sites holding the most memory (at the traced peak unless --at).
    #[arg(long, value_name = "N")]
    pub top: Option<usize>,
    /// With --top: the moment to look at, as time since the trace start: ms (12.5), or 250us, 12.5ms, 1.5s.
    #[arg(long, value_name = "TIME")]
    pub at: Option<String>,
    /// Print everything as JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Write a self-contained offline HTML report to this path.
    #[arg(long, value_name = "OUT.html")]
    pub html: Option<PathBuf>,
    /// With --html: overwrite an existing file even when it is not a page torchmem wrote (never the input).
    #[arg(long)]
    pub force: bool,
    /// With --html: the per-process memory cap the run had (set_per_process_memory_fraction), e.g. 14GiB;
    /// a snapshot does not record it. The what-if panel replays an OOM snapshot under it.
    #[arg(long, value_name = "SIZE")]
    pub memory_limit: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct ExplainOomArgs {
    /// The out-of-memory message as printed by PyTorch, a log file's path, or - to read stdin.
    /// Every OOM message in the input is explained (e.g. one per DDP rank).
    pub message: std::ffi::OsString,
    /// Print the parsed numbers and the diagnosis as JSON: one object for one message, a list of
    /// objects (with message_index, line, rank) when the input holds several.
    #[arg(long)]
    pub json: bool,
}

fn load(path: &Path) -> anyhow::Result<torchmem_snapshot::Snapshot> {
    crate::existing_file(path, "snapshot file")?;
    Ok(torchmem_snapshot::read_path(path)?)
}

pub fn run(args: SnapshotArgs) -> anyhow::Result<i32> {
    let first_is_diff = args.files.first().is_some_and(|f| f.as_os_str() == "diff")
        && !(args.files.len() == 1 && args.files[0].exists());
    if first_is_diff {
        if args.files.len() != 3 {
            return usage_error(format!(
                "usage: torchmem snapshot diff BEFORE AFTER (got {} file(s))",
                args.files.len() - 1
            ));
        }
        return run_diff(&args.files[1], &args.files[2], args.json, args.top.unwrap_or(20));
    }
    if args.files.len() != 1 {
        return usage_error(format!("give one snapshot file (or `diff BEFORE AFTER`); got {} paths", args.files.len()));
    }
    if args.at.is_some() && args.top.is_none() && !args.json {
        return usage_error("--at needs --top N (the sites alive at that moment)".into());
    }
    let path = &args.files[0];
    if args.memory_limit.is_some() && args.html.is_none() {
        return usage_error("--memory-limit is for the --html page's what-if panel: add --html OUT.html".into());
    }
    let memory_limit_bytes = args
        .memory_limit
        .as_deref()
        .map(torchmem_units::parse_size)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--memory-limit: {e}"))?;
    if let Some(out) = &args.html {
        torchmem_recorder::output_path::check_html_output(out, &[path], args.force, "--html")?;
    }
    let snap = load(path)?;
    let sum = summary::summarize(&snap);
    let name = path.display().to_string();
    let top_n = args.top.unwrap_or(10);
    let at_us = args.at.as_deref().map(|t| sites::resolve_at(&snap, t)).transpose().map_err(anyhow::Error::msg)?;
    // The sites replay the whole trace again: only when they are shown.
    let tops =
        if args.top.is_some() || args.json { sites::top_sites(&snap, &sum.peaks(), top_n, at_us) } else { Vec::new() };
    if let Some(out) = &args.html {
        let opts = torchmem_sim::whatif::WhatIfOptions { memory_limit_bytes, ..Default::default() };
        let whatif = torchmem_sim::whatif::whatif(&snap, &opts);
        let page = html::render_with_whatif(&snap, &sum, &name, Some(&whatif));
        torchmem_recorder::output_path::write_atomically(out, page.as_bytes())?;
        if !args.json {
            eprintln!("torchmem: wrote {} ({})", out.display(), bytes(page.len() as u64));
        }
    }
    if args.json {
        let v = serde_json::json!({ "file": name, "summary": sum, "top": tops });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(0);
    }
    if args.html.is_some() && args.top.is_none() {
        return Ok(0);
    }
    if args.top.is_some() {
        print!("{}", sites::render_top_text(&tops));
    } else {
        print!("{}", summary::render_text(&sum, &name));
    }
    Ok(0)
}

/// A wrong combination of arguments: said on stderr like clap's own usage errors, exit status 2.
fn usage_error(msg: String) -> anyhow::Result<i32> {
    eprintln!("torchmem: error: {msg}");
    Ok(2)
}

fn run_diff(a: &Path, b: &Path, json: bool, n: usize) -> anyhow::Result<i32> {
    let sa = load(a)?;
    let sb = load(b)?;
    let d = diff::diff(&sa, &sb);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "before": a.display().to_string(), "after": b.display().to_string(), "diff": d })
            )?
        );
        return Ok(0);
    }
    println!("Snapshot diff: {} -> {}", a.display(), b.display());
    println!(
        "  reserved  {} -> {} ({})",
        bytes(d.reserved_before_bytes),
        bytes(d.reserved_after_bytes),
        signed_bytes(d.reserved_after_bytes as i64 - d.reserved_before_bytes as i64)
    );
    println!(
        "  allocated {} -> {} ({})",
        bytes(d.allocated_before_bytes),
        bytes(d.allocated_after_bytes),
        signed_bytes(d.allocated_after_bytes as i64 - d.allocated_before_bytes as i64)
    );
    println!(
        "\n  {:>12} {:>12} {:>12} {:>8}  site (live blocks at each snapshot)",
        "change", "before", "after", "blocks"
    );
    for r in d.rows.iter().take(n) {
        println!(
            "  {:>12} {:>12} {:>12} {:>8}  {}",
            signed_bytes(r.delta_bytes),
            bytes(r.before_bytes),
            bytes(r.after_bytes),
            format!("{}->{}", r.before_count, r.after_count),
            r.site
        );
    }
    if d.rows.is_empty() {
        println!("  (no site changed)");
    }
    Ok(0)
}

/// Reads the explain-oom input as bytes: stdin for `-`, the file when the argument names one, else the
/// argument itself. Decoded lossily: a stray Latin-1 byte in a log must not hide the message.
fn read_oom_input(arg: &std::ffi::OsStr) -> anyhow::Result<String> {
    use std::os::unix::ffi::OsStrExt;
    let raw: Vec<u8> = if arg == "-" {
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut v).context("cannot read stdin")?;
        v
    } else {
        let path = Path::new(arg);
        if path.is_file() {
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?
        } else if path.is_dir() {
            anyhow::bail!(
                "{} is a directory. Give a log file, `-` for stdin, or the message in quotes",
                path.display()
            );
        } else {
            let b = arg.as_bytes();
            let looks_like_path = !b.iter().any(|c| c.is_ascii_whitespace())
                && (b.contains(&b'/') || [".log", ".txt", ".out", ".err"].iter().any(|e| b.ends_with(e.as_bytes())));
            if looks_like_path {
                anyhow::bail!(
                    "{}: no such file. Give an existing log file, `-` to read stdin, or the message itself in quotes",
                    path.display()
                );
            }
            b.to_vec()
        }
    };
    Ok(String::from_utf8_lossy(&raw).into_owned())
}

/// What explain-oom cannot answer from a message, in one line.
pub const WHATIF_NEEDS_A_TRACE: &str =
    "What if (would expandable segments or another setting have avoided it, and the \
smallest memory that runs it): a message has no allocation trace to replay; run under torchmem.on_oom(dir): its \
report and its snapshot's page (torchmem snapshot SNAPSHOT --html OUT.html) answer it.";

pub fn explain_oom(args: ExplainOomArgs) -> anyhow::Result<i32> {
    let text = read_oom_input(&args.message)?;
    let all = oom::explain_all(&text);
    if all.is_empty() {
        anyhow::bail!("{}", oom::not_found_error(&text));
    }
    let readable = all.iter().filter(|e| matches!(e.result, oom::ExplainedResult::Diagnosis(_))).count();
    if args.json {
        let v = if let [one] = all.as_slice() {
            match &one.result {
                oom::ExplainedResult::Diagnosis(d) => serde_json::to_value(d)?,
                oom::ExplainedResult::Error { error } => anyhow::bail!("{error}"),
            }
        } else {
            serde_json::to_value(&all)?
        };
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        if let [one] = all.as_slice() {
            if let oom::ExplainedResult::Error { error } = &one.result {
                anyhow::bail!("{error}");
            }
        }
        print!("{}", oom::render_all_text(&all));
        if all.iter().any(|e| {
            matches!(&e.result, oom::ExplainedResult::Diagnosis(d) if matches!(d.numbers.backend, oom::Backend::Cuda | oom::Backend::Hip))
        }) {
            println!("{WHATIF_NEEDS_A_TRACE}");
        }
    }
    if readable == 0 {
        eprintln!("torchmem: error: none of the {} out-of-memory messages could be read", all.len());
        return Ok(1);
    }
    Ok(0)
}
