//! `torchmem report PROFILE… [--format table|json|csv|markdown|mermaid]`: prints a profile's report on stdout
//! (peaks, per-phase, per-epoch and per-process tables, growth warnings, the journey, line profiles; or the
//! timeline as CSV, or the journey as a Mermaid diagram). Works on a profile whose run was killed.
//!
//! Distributed runs (torchrun, Slurm): a profile holding ranks gets the rank sections too (per-rank peaks,
//! imbalance, the rank × GPU matrix, step-aligned peaks, the first rank to fail: `report::ranks`). Several
//! profiles, or a directory of them (one per node or per `srun` task), are merged into one rank report when
//! they hold ranks; profiles of separate runs (no rank) get one overview row each. In a directory, a
//! `*.sqlite` that is not a torchmem profile is skipped with a warning.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use torchmem_core::analysis::ranks::{is_distributed, RankReport};
use torchmem_core::analysis::Summary;
use torchmem_core::model::Profile;
use torchmem_core::report::{self, cells::Table, Format};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum FormatArg {
    /// Aligned text tables (MiB/GiB).
    Table,
    /// Every number as data; bytes as integers (keys: docs/reports.md).
    Json,
    /// The timeline: one row per CPU sample, GPU values carried forward.
    Csv,
    /// The tables as Markdown, the journey as a Mermaid block.
    Markdown,
    /// The memory journey as a Mermaid `journey` diagram.
    Mermaid,
}

impl From<FormatArg> for Format {
    fn from(f: FormatArg) -> Format {
        match f {
            FormatArg::Table => Format::Table,
            FormatArg::Json => Format::Json,
            FormatArg::Csv => Format::Csv,
            FormatArg::Markdown => Format::Markdown,
            FormatArg::Mermaid => Format::Mermaid,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct ReportArgs {
    /// The profile file written by `torchmem run -o PROFILE`; several files, or directories of them
    /// (`run -o DIR/`), are merged by rank when they hold ranks (torchrun, Slurm), else listed one row per run.
    #[arg(required = true, num_args = 1..)]
    pub profiles: Vec<PathBuf>,
    /// Output format.
    #[arg(long, short = 'f', value_enum, default_value_t = FormatArg::Table)]
    pub format: FormatArg,
    /// With `--format csv`: which table. `timeline` (one row per CPU sample) or `breakdown` (one row per kept
    /// step/phase boundary and device: bytes of parameters, gradients, optimizer state, activations, …).
    #[arg(long, value_enum, default_value_t = CsvTable::Timeline)]
    pub csv_table: CsvTable,
}

/// What `--format csv` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum CsvTable {
    Timeline,
    Breakdown,
}

/// Opens a profile for a report; the core's errors already name the problem and the fix.
pub fn open_profile(path: &std::path::Path) -> anyhow::Result<Profile> {
    if path.is_dir() {
        anyhow::bail!(
            "{}: is a directory, not a profile file. Give the .sqlite file `torchmem run -o PROFILE` wrote",
            path.display()
        );
    }
    Ok(Profile::open(path)?)
}

/// The profile files named: files as given, directories as the `*.sqlite` files in them (sorted).
pub fn expand_inputs(paths: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    Ok(load_inputs(paths)?.into_iter().map(|(p, _)| p).collect())
}

/// Opens the profiles named: a file named is opened or its error is the command's; in a directory, each
/// `*.sqlite` that is not a torchmem profile (another tool's database, a damaged file) is skipped with one
/// warning line naming it and why, so one stray file does not stop the report of the others.
pub fn load_inputs(paths: &[PathBuf]) -> anyhow::Result<Vec<(PathBuf, Profile)>> {
    let mut out = Vec::new();
    for p in paths {
        if !p.is_dir() {
            out.push((p.clone(), open_profile(p)?));
            continue;
        }
        let mut found: Vec<PathBuf> = std::fs::read_dir(p)
            .with_context(|| format!("{}: cannot list this directory", p.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|f| f.extension().is_some_and(|x| x == "sqlite") && f.is_file())
            .collect();
        found.sort();
        let mut kept = 0;
        for f in found {
            match Profile::open(&f) {
                Ok(profile) => {
                    out.push((f, profile));
                    kept += 1;
                }
                Err(e) => match torchmem_core::store::check_profile(&f) {
                    Err(why) => {
                        eprintln!("torchmem: warning: skipping {}: not a torchmem profile ({why})", f.display())
                    }
                    Ok(()) => eprintln!("torchmem: warning: skipping {}: cannot read it ({e})", f.display()),
                },
            }
        }
        if kept == 0 {
            anyhow::bail!(
                "{}: no torchmem profile (*.sqlite) in this directory. Give the profile files, or the directory `torchmem run -o DIR/` wrote them to",
                p.display()
            );
        }
    }
    Ok(out)
}

fn render_tables(tables: &[Table], format: Format) -> String {
    tables
        .iter()
        .map(|t| match format {
            Format::Markdown => report::markdown::render_table(t) + "\n",
            _ => report::table::render_table(t),
        })
        .collect()
}

/// The rank sections of a distributed profile set in one format (table, markdown, json).
fn rank_sections(r: &RankReport, format: Format) -> String {
    let head: String = report::ranks::header_lines(r)
        .into_iter()
        .map(|(k, v)| match format {
            Format::Markdown => format!("- **{k}**: {v}\n"),
            _ => format!("  {k:<13} {v}\n"),
        })
        .collect();
    let title = match format {
        Format::Markdown => "## torchmem distributed report\n\n".to_string(),
        _ => "torchmem distributed report\n".to_string(),
    };
    format!("{title}{head}\n{}", render_tables(&report::ranks::tables(r), format))
}

/// The merged report of several profiles.
pub fn render_merged(profiles: &[Profile], format: Format) -> anyhow::Result<String> {
    if matches!(format, Format::Csv | Format::Mermaid) {
        anyhow::bail!(
            "--format {} shows one profile: give one file (it is per run, not per job), or use --format table|json|markdown for the merged report",
            format.as_str()
        );
    }
    if !is_distributed(profiles) {
        anyhow::bail!(
            "these {} profiles hold no rank (RANK/SLURM_PROCID was not set: not a torchrun or Slurm job), so there is nothing to merge by rank. Report them one at a time: `torchmem report FILE`",
            profiles.len()
        );
    }
    let r = RankReport::build(profiles);
    Ok(match format {
        Format::Json => {
            let (ranks, dist) = report::ranks::json_sections(&r);
            let v = serde_json::json!({
                "format": "torchmem-report",
                "version": 1,
                "profiles": r.profiles,
                "ranks": ranks,
                "distributed": dist,
            });
            serde_json::to_string_pretty(&v)? + "\n"
        }
        Format::Table | Format::Markdown => {
            let mut text = rank_sections(&r, format);
            text.push_str(
                "Per-profile details (phases, epochs, processes, journey): `torchmem report FILE` for one of them.\n",
            );
            text
        }
        Format::Csv | Format::Mermaid => unreachable!("refused above"),
    })
}

/// Several profiles that hold no rank (ordinary runs, say every run `torchmem run -o prof/` wrote): one row
/// per profile (command, duration, exit, peaks), then where each one's full report is; as JSON every
/// profile's whole report, in the same order.
pub fn render_overview(paths: &[PathBuf], profiles: &[Profile], format: Format) -> anyhow::Result<String> {
    if matches!(format, Format::Csv | Format::Mermaid) {
        anyhow::bail!(
            "--format {} shows one profile: give one file, or use --format table|json|markdown for the {} profiles",
            format.as_str(),
            profiles.len()
        );
    }
    if format == Format::Json {
        let mut reports = Vec::new();
        for (path, profile) in paths.iter().zip(profiles) {
            let mut v: serde_json::Value = serde_json::from_str(&render_one(profile, Format::Json)?)?;
            v["file"] = serde_json::json!(path.display().to_string());
            reports.push(v);
        }
        let v = serde_json::json!({ "format": "torchmem-reports", "version": 1, "reports": reports });
        return Ok(serde_json::to_string_pretty(&v)? + "\n");
    }
    let mut t = Table {
        title: format!("{} profiles (no rank: separate runs)", profiles.len()),
        headers: ["profile", "command", "duration", "exit", "peak CPU RSS", "peak GPU allocated", "peak GPU reserved"]
            .map(String::from)
            .to_vec(),
        numeric: vec![false, false, true, true, true, true, true],
        rows: Vec::new(),
        notes: Vec::new(),
        empty: String::new(),
    };
    let max_of = |v: Vec<Option<u64>>| v.into_iter().flatten().max();
    let mut any_gpu = false;
    for (path, profile) in paths.iter().zip(profiles) {
        let s = Summary::from_profile(profile);
        let command = s.command.join(" ");
        let command = if command.chars().count() > 40 {
            format!("{}…", command.chars().take(39).collect::<String>())
        } else {
            command
        };
        let allocated = max_of(s.peak.gpus.iter().map(|g| g.allocated_bytes).collect());
        let reserved = max_of(s.peak.gpus.iter().map(|g| g.reserved_bytes).collect());
        any_gpu |= !s.peak.gpus.is_empty();
        let gpu = |b: Option<u64>| match (b, s.peak.gpus.is_empty()) {
            (Some(b), _) => torchmem_core::units::format_bytes(b),
            (None, true) => "no GPU".into(),
            (None, false) => "-".into(),
        };
        t.rows.push(vec![
            path.display().to_string(),
            command,
            s.duration_ns.map(torchmem_core::units::format_secs).unwrap_or_else(|| "unfinished".into()),
            s.exit_code.map(|c| c.to_string()).unwrap_or_else(|| "-".into()),
            torchmem_core::units::format_opt_bytes(s.peak.cpu_rss_bytes),
            gpu(allocated),
            gpu(reserved),
        ]);
    }
    if !any_gpu {
        for col in [6, 5] {
            t.headers.remove(col);
            t.numeric.remove(col);
            t.rows.iter_mut().for_each(|r| {
                r.remove(col);
            });
        }
        t.notes.push("GPU: no CUDA device in these runs, so there are no GPU columns (not zeros).".into());
    }
    t.notes.push("Each profile's full report: `torchmem report FILE` (or --format json for all of them).".into());
    let title = match format {
        Format::Markdown => "## torchmem report of several runs\n\n",
        _ => "torchmem report of several runs\n",
    };
    Ok(format!("{title}{}", render_tables(&[t], format)))
}

/// One profile's report, with the rank sections when it holds ranks.
fn render_one(profile: &Profile, format: Format) -> anyhow::Result<String> {
    let summary = Summary::from_profile(profile);
    let mut text = report::render(profile, &summary, format);
    let ranks = std::slice::from_ref(profile);
    if !is_distributed(ranks) {
        return Ok(text);
    }
    let r = RankReport::build(ranks);
    match format {
        Format::Json => {
            let mut v: serde_json::Value = serde_json::from_str(&text)?;
            let (ranks, dist) = report::ranks::json_sections(&r);
            v["ranks"] = ranks;
            v["distributed"] = dist;
            text = serde_json::to_string_pretty(&v)? + "\n";
        }
        Format::Table | Format::Markdown => {
            text.push('\n');
            text.push_str(&rank_sections(&r, format));
        }
        Format::Csv | Format::Mermaid => {}
    }
    Ok(text)
}

pub fn run(args: ReportArgs) -> anyhow::Result<i32> {
    if args.csv_table == CsvTable::Breakdown && args.format != FormatArg::Csv {
        anyhow::bail!("--csv-table breakdown goes with --format csv (the other formats hold the breakdown already)");
    }
    let inputs = load_inputs(&args.profiles)?;
    let text = if args.csv_table == CsvTable::Breakdown {
        if inputs.len() != 1 {
            anyhow::bail!("--format csv shows one profile: give one file (it is per run, not per job)");
        }
        report::breakdown::render_csv(&Summary::from_profile(&inputs[0].1).breakdown)
    } else if inputs.len() == 1 {
        render_one(&inputs[0].1, args.format.into())?
    } else {
        let (paths, profiles): (Vec<PathBuf>, Vec<Profile>) = inputs.into_iter().unzip();
        if is_distributed(&profiles) {
            render_merged(&profiles, args.format.into())?
        } else {
            render_overview(&paths, &profiles, args.format.into())?
        }
    };
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
        Ok(()) => Ok(0),
        // `torchmem report p | head` closes the pipe early: not an error.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(e).context("cannot write the report to stdout"),
    }
}
