//! `torchmem view FILE [FILE2] [-o PAGE.html] [--no-browser] [--port N]`: the interactive memory viewer.
//! Arguments only; the work is the `torchmem-viewer` crate (loading, level-of-detail index, server, page).
//! Two files give the diff view side by side. `-o` writes the offline page instead of serving (an existing
//! file is replaced only when torchmem wrote it, as `plot -o` does).

use std::io::Write;
use std::path::PathBuf;

use torchmem_recorder::output_path::{self, OutputKind};

#[derive(Debug, clap::Args)]
pub struct ViewArgs {
    /// An allocator snapshot (pickle or JSON, gzipped or not), an estimate's or simulation's trace, or a
    /// `torchmem run` profile (.sqlite). Two files: side by side (diff).
    #[arg(required = true, num_args = 1..=2)]
    pub files: Vec<PathBuf>,
    /// Write one self-contained offline page here instead of serving (detail bounded by --budget-mib).
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// With -o: MiB of allocation detail to embed; the allocations covering the most of the chart go first.
    #[arg(long, default_value_t = 20)]
    pub budget_mib: u64,
    /// Print the URL only; do not open a browser.
    #[arg(long)]
    pub no_browser: bool,
    /// Port on 127.0.0.1 (0: any free port).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// The device whose trace to show (default: the one with the most events).
    #[arg(long)]
    pub device: Option<usize>,
    /// With -o: overwrite an existing file even when torchmem did not write it.
    #[arg(long)]
    pub force: bool,
}

/// Opens `url` with `$BROWSER` (the first of its `:`-separated commands; `%s` stands for the URL, as the
/// convention has it) or `xdg-open`.
fn open_browser(url: &str) {
    let browser = std::env::var("BROWSER")
        .ok()
        .and_then(|b| b.split(':').map(str::trim).find(|c| !c.is_empty()).map(String::from));
    let cmd = browser.unwrap_or_else(|| "xdg-open".into());
    let mut words: Vec<String> = cmd.split_whitespace().map(String::from).collect();
    if words.iter().any(|w| w.contains("%s")) {
        words.iter_mut().for_each(|w| *w = w.replace("%s", url));
    } else {
        words.push(url.to_string());
    }
    let Some((program, args)) = words.split_first() else { return };
    match std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    {
        Ok(_) => {}
        Err(e) => eprintln!("torchmem: could not start {program} ({e}); open the URL above yourself"),
    }
}

pub fn run(args: ViewArgs) -> anyhow::Result<i32> {
    if let Some(out) = &args.output {
        let inputs: Vec<&std::path::Path> = args.files.iter().map(PathBuf::as_path).collect();
        output_path::check_output(out, &inputs, Some(args.force), "-o", OutputKind::Html)?;
    }
    let docs = torchmem_viewer::load_all(&args.files, args.device).map_err(|e| anyhow::anyhow!(e))?;
    if let Some(out) = &args.output {
        let page = torchmem_viewer::offline::render(&docs, (args.budget_mib as usize) << 20);
        output_path::write_atomically(out, page.as_bytes())?;
        eprintln!("torchmem: wrote {} ({})", out.display(), torchmem_core::units::format_bytes(page.len() as u64));
        return Ok(0);
    }
    let server = torchmem_viewer::server::Server::bind(docs, args.port)
        .map_err(|e| anyhow::anyhow!("cannot listen on 127.0.0.1:{}: {e}", args.port))?;
    let url = server.url();
    println!("{url}");
    let _ = std::io::stdout().flush();
    eprintln!("torchmem: serving the viewer on 127.0.0.1 only; Ctrl-C ends it");
    if !args.no_browser {
        open_browser(&url);
    }
    server.run()?;
    eprintln!("torchmem: viewer stopped");
    Ok(0)
}
