//! Where commands write their files, checked before anything is created or removed, so that no command
//! destroys a file it did not write: `run -o` (a profile), `snapshot --html` (a page), and `run`'s default
//! profile names (unique per run: date, time and pid, as memray does). Each problem gets one message naming
//! the cause ("directory X does not exist", "-o points to a directory"), not SQLite's text.

use std::ffi::CString;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::bail;
use torchmem_core::store;

/// What is at `-o`'s path now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Nothing: the profile is created there.
    Nothing,
    /// An empty regular file (say from `mktemp`), or an SQLite database without a single table (a run
    /// killed while it created its profile): nothing to lose, it is replaced.
    Empty,
    /// A torchmem profile that no recorder holds: replaced with `--force`.
    Profile,
}

/// The directory a path's file lives in (`.` for a bare name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Whether files can be created in `dir`; the OS's reason when not (read-only filesystem, permission).
fn writable_dir(dir: &Path) -> Result<(), std::io::Error> {
    let c = CString::new(dir.as_os_str().as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: access on a NUL-terminated path we own.
    match unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Checks the directory of an output path: it exists, is a directory, and we may create files in it.
pub fn check_dir(path: &Path, flag: &str) -> anyhow::Result<()> {
    if path.is_dir() || path.as_os_str().as_bytes().ends_with(b"/") {
        bail!(
            "{flag} points to a directory ({}). Give a file name, for example {}",
            path.display(),
            path.join(if flag == "-o" { "run.sqlite" } else { "report.html" }).display()
        );
    }
    let dir = parent_dir(path);
    match std::fs::metadata(&dir) {
        Err(_) => bail!(
            "cannot write {}: directory {} does not exist. Create it first, or choose another path with {flag}",
            path.display(),
            dir.display()
        ),
        Ok(m) if !m.is_dir() => bail!("cannot write {}: {} is not a directory", path.display(), dir.display()),
        Ok(_) => match writable_dir(&dir) {
            Ok(()) => Ok(()),
            Err(e) => bail!(
                "cannot write {}: cannot create files in directory {} ({}). Choose another path with {flag}",
                path.display(),
                dir.display(),
                e.to_string().split(" (os error").next().unwrap_or_default()
            ),
        },
    }
}

/// Checks `run -o PATH` before the run: never a directory, a missing directory, a file that is not a
/// torchmem profile, a profile that a live recorder holds, nor (without `--force`) any existing profile.
pub fn check_profile_output(path: &Path, force: bool) -> anyhow::Result<Existing> {
    check_dir(path, "-o")?;
    let meta = match std::fs::metadata(path) {
        Err(_) => return Ok(Existing::Nothing),
        Ok(m) => m,
    };
    if !meta.is_file() {
        bail!(
            "{} exists and is not a regular file; torchmem will not replace it. Choose another path with -o",
            path.display()
        );
    }
    if store::is_being_recorded(path) {
        bail!(
            "{} is being recorded by another `torchmem run` right now; two runs never share a profile. Choose another path with -o",
            path.display()
        );
    }
    if meta.len() == 0 || store::is_empty_database(path) {
        return Ok(Existing::Empty);
    }
    if let Err(why) = store::check_profile(path) {
        bail!(
            "{} exists and is not a torchmem profile ({why}); torchmem never overwrites such a file, even with --force. Choose another path with -o",
            path.display()
        );
    }
    if !force {
        bail!(
            "{} already exists (a torchmem profile of an earlier run). Use --force to replace it, or choose another path with -o",
            path.display()
        );
    }
    Ok(Existing::Profile)
}

/// Characters a POSIX shell treats specially somewhere in a word (quoting, expansion, globbing,
/// redirection, job control, comments, history).
const SHELL_SPECIAL: &str = "\\|&;<>()$`\"'*?[]#~=%!{}^";

/// Whether `c` may stand in a file name torchmem makes, and in a word the shell takes as it is: not a path
/// separator, whitespace, a control character or a shell-special one. Unicode letters and digits stay.
fn plain_char(c: char) -> bool {
    c != '/' && !c.is_whitespace() && !c.is_control() && !SHELL_SPECIAL.contains(c)
}

/// A path as the user can paste it into a shell: as it is when every character is plain (`plain_char`:
/// `профиль.sqlite`, `out/run-1.sqlite`), else in single quotes (`'my run.sqlite'`, a `'` as `'\''`). For
/// every hint that names a file.
pub fn shell_quoted(path: &Path) -> String {
    let s = path.to_string_lossy();
    if !s.is_empty() && !s.starts_with('-') && s.chars().all(|c| c == '/' || plain_char(c)) {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Checks, before anything is made, that the current directory takes the default profile (`run` without
/// `-o`): a read-only directory gets the fix (a path with `-o`), not just the OS's words.
pub fn check_default_output_dir(default: &Path) -> anyhow::Result<()> {
    let cwd = std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_else(|_| ".".into());
    if let Err(e) = writable_dir(Path::new(".")) {
        bail!(
            "cannot create the profile {} in the current directory {cwd} ({}). Choose a path with -o, e.g. -o \"$TMPDIR/run.sqlite\" or -o ~/run.sqlite",
            shell_quoted(default),
            e.to_string().split(" (os error").next().unwrap_or_default()
        );
    }
    Ok(())
}

/// A unique default profile name in the current directory: `torchmem-<program>-<date>-<time>-<pid>.sqlite`,
/// with `-2`, `-3`… added in the unlikely case that such a file exists already. The program's name keeps
/// its letters and digits, Unicode ones too (`скрипт_é`); only path separators, whitespace, control and
/// shell-special characters become `_`, so the name never needs quoting.
pub fn default_output(program: &str) -> PathBuf {
    let stem: String = Path::new(program)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "run".into())
        .chars()
        .map(|c| if plain_char(c) && c != '\u{fffd}' { c } else { '_' })
        .collect();
    // SAFETY: localtime_r fills the tm we own.
    let tm = unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        let now = libc::time(std::ptr::null_mut());
        libc::localtime_r(&now, &mut tm);
        tm
    };
    let base = format!(
        "torchmem-{stem}-{:04}{:02}{:02}-{:02}{:02}{:02}-{}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec,
        std::process::id()
    );
    let mut candidate = PathBuf::from(format!("{base}.sqlite"));
    let mut n = 2;
    while candidate.symlink_metadata().is_ok() {
        candidate = PathBuf::from(format!("{base}-{n}.sqlite"));
        n += 1;
    }
    candidate
}

/// Whether `run -o VALUE` names a directory: it ends in `/`, or is an existing directory. Then each
/// recorder writes its own file in it (`dir_output`), so the ranks or nodes of a job never clobber.
pub fn names_a_directory(path: &Path) -> bool {
    path.as_os_str().as_bytes().ends_with(b"/") || path.is_dir()
}

/// The local date and time as `YYYYmmdd-HHMMSS`.
fn local_timestamp() -> String {
    // SAFETY: localtime_r fills the tm we own.
    let tm = unsafe {
        let mut tm: libc::tm = std::mem::zeroed();
        let now = libc::time(std::ptr::null_mut());
        libc::localtime_r(&now, &mut tm);
        tm
    };
    format!(
        "{:04}{:02}{:02}-{:02}{:02}{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

/// A name for a file in a host name or the like: letters, digits, `-`, `_` and `.` kept, the rest `_`.
fn file_safe(s: &str) -> String {
    let s: String = s.chars().map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' }).collect();
    if s.is_empty() || s.starts_with('.') {
        format!("host{s}")
    } else {
        s
    }
}

/// `run -o DIR/`: this recorder's own profile in `DIR`, `<host>-<who>-<date>-<time>-<pid>.sqlite`, where
/// `who` is `rank<R>` (the recorder runs as a rank: `torchrun -m torchmem run`, `srun torchmem run`),
/// else `node<G>` (it wraps a launcher on a node that says its number), else `pid<PID>`; `-restart<N>`
/// follows a restarted attempt's rank. A missing `DIR` is created (its parent must exist: a typo is not
/// turned into a tree of directories); several ranks creating it at once is fine. The name is new: with
/// the pid in it no two live recorders share one, and `-2`, `-3`… is added should the file exist.
pub fn dir_output(dir: &Path, host: &str, place: Option<&torchmem_core::model::JobPlace>) -> anyhow::Result<PathBuf> {
    if !dir.is_dir() {
        let parent = parent_dir(dir.as_os_str().to_string_lossy().trim_end_matches('/').as_ref());
        if !parent.is_dir() {
            bail!(
                "-o {}: directory {} does not exist, so the profile directory cannot be made in it. Create it first, or choose another path with -o",
                dir.display(),
                parent.display()
            );
        }
        match std::fs::create_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => bail!("-o {}: cannot create the directory ({e}). Choose another path with -o", dir.display()),
        }
    }
    if let Err(e) = writable_dir(dir) {
        bail!(
            "-o {}: cannot create files in this directory ({}). Choose another path with -o",
            dir.display(),
            e.to_string().split(" (os error").next().unwrap_or_default()
        );
    }
    let pid = std::process::id();
    let who = match place {
        Some(p) if p.origin.rank.is_some() => {
            let restart = p.launch.restart_count.filter(|&n| n > 0).map(|n| format!("-restart{n}")).unwrap_or_default();
            format!("rank{}{restart}", p.origin.rank.unwrap_or_default())
        }
        Some(p) if p.launch.group_rank.is_some() => format!("node{}", p.launch.group_rank.unwrap_or_default()),
        _ => format!("pid{pid}"),
    };
    let base = format!("{}-{who}-{}-{pid}", file_safe(host), local_timestamp());
    let mut candidate = dir.join(format!("{base}.sqlite"));
    let mut n = 2;
    while candidate.symlink_metadata().is_ok() {
        candidate = dir.join(format!("{base}-{n}.sqlite"));
        n += 1;
    }
    Ok(candidate)
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// The kinds of file torchmem writes besides profiles (`check_profile_output` has the profile's rule). Each
/// is recognised from its first bytes, never from its name: that decides "written by torchmem".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// An HTML page (`plot`, `snapshot --html`): `<!DOCTYPE html>` and a `<title>torchmem…`.
    Html,
    /// The chart alone (`plot --svg`): an `<svg` element with torchmem's chart id `tm-chart`.
    Svg,
    /// An allocator trace (`estimate --keep-trace`): a pickle cannot be told from one PyTorch recorded, so an
    /// existing trace is never taken for ours.
    Trace,
    /// A Prometheus textfile (`run --metrics-textfile`): every sample line is a `torchmem_` series.
    PromTextfile,
}

/// The one "written by torchmem" rule: true when `path` holds a file of `kind` that torchmem wrote.
pub fn written_by_torchmem(path: &Path, kind: OutputKind) -> bool {
    let mut head = vec![0u8; 4096];
    let n = std::fs::File::open(path).and_then(|mut f| f.read(&mut head)).unwrap_or(0);
    let head = String::from_utf8_lossy(&head[..n]);
    match kind {
        OutputKind::Html => head.starts_with("<!DOCTYPE html>") && head.contains("<title>torchmem"),
        OutputKind::Svg => head.starts_with("<svg") && head.contains("id=\"tm-chart\""),
        OutputKind::Trace => false,
        OutputKind::PromTextfile => {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            text.contains("torchmem_")
                && text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')).all(|l| l.starts_with("torchmem_"))
        }
    }
}

/// True when the file starts like a page torchmem wrote (`plot`, `snapshot --html`).
pub fn is_torchmem_html(path: &Path) -> bool {
    written_by_torchmem(path, OutputKind::Html)
}

/// Whether an output may be written at `out` (`plot -o`, `plot --svg`, `snapshot --html`, `estimate
/// --keep-trace`, `run --metrics-textfile`): never one of the inputs, never a directory or a missing directory,
/// and an existing non-empty file only when torchmem wrote it (`written_by_torchmem`) or with `--force`.
/// `force: None` is a command without `--force` for this output: a foreign file is then never replaced.
pub fn check_output(
    out: &Path,
    inputs: &[&Path],
    force: Option<bool>,
    flag: &str,
    kind: OutputKind,
) -> anyhow::Result<()> {
    if out.is_dir() || out.as_os_str().as_bytes().ends_with(b"/") {
        let example = match kind {
            OutputKind::Html => "report.html",
            OutputKind::Svg => "chart.svg",
            OutputKind::Trace => "trace.pickle",
            OutputKind::PromTextfile => "torchmem.prom",
        };
        bail!(
            "{flag} points to a directory ({}). Give a file name, for example {}",
            out.display(),
            out.join(example).display()
        );
    }
    check_dir(out, flag)?;
    if inputs.iter().any(|i| same_file(out, i)) {
        bail!("{}: the output would overwrite the file it reads. Choose another path with {flag}", out.display());
    }
    if let Ok(m) = std::fs::metadata(out) {
        if !m.is_file() {
            bail!("{} exists and is not a regular file. Choose another path with {flag}", out.display());
        }
        if m.len() > 0 && force != Some(true) && !written_by_torchmem(out, kind) {
            let what = match kind {
                OutputKind::Html => "an HTML page written by torchmem",
                OutputKind::Svg => "an SVG chart written by torchmem",
                OutputKind::Trace => "known to be a trace torchmem wrote (a trace looks like any allocator snapshot)",
                OutputKind::PromTextfile => "a textfile of torchmem's metrics",
            };
            match force {
                Some(_) => bail!(
                    "{} exists and is not {what}; use --force to overwrite it, or choose another path with {flag}",
                    out.display()
                ),
                None => bail!(
                    "{} exists and is not {what}; torchmem never overwrites such a file. Choose another path with {flag}",
                    out.display()
                ),
            }
        }
    }
    Ok(())
}

/// Checks an HTML output path (`snapshot --html OUT`): `check_output`'s rule for a page.
pub fn check_html_output(out: &Path, inputs: &[&Path], force: bool, flag: &str) -> anyhow::Result<()> {
    check_output(out, inputs, Some(force), flag, OutputKind::Html)
}

/// Writes a page next to its target and renames it into place: a failed write leaves no half page.
pub fn write_atomically(out: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "out".into());
    let tmp = out.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, bytes).and_then(|_| std::fs::rename(&tmp, out)).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        anyhow::anyhow!("cannot write {}: {e}", out.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_names_carry_the_pid_and_never_name_an_existing_file() {
        let a = default_output("train.py");
        let s = a.display().to_string();
        assert!(s.starts_with("torchmem-train-") && s.ends_with(&format!("-{}.sqlite", std::process::id())), "{s}");
        assert_eq!(default_output("my prog!.py").display().to_string().split('-').nth(1), Some("my_prog_"));
    }

    #[test]
    fn output_paths_are_checked_before_anything_is_touched() {
        let dir = tempfile::tempdir().unwrap();
        let e = check_profile_output(dir.path(), false).unwrap_err().to_string();
        assert!(e.contains("-o points to a directory"), "{e}");
        let e = check_profile_output(&dir.path().join("nope/x.sqlite"), false).unwrap_err().to_string();
        assert!(e.contains("does not exist") && e.matches("nope").count() == 2, "{e}");
        let script = dir.path().join("train.py");
        std::fs::write(&script, "print('hi')\n").unwrap();
        let e = check_profile_output(&script, true).unwrap_err().to_string();
        assert!(e.contains("is not a torchmem profile") && e.contains("even with --force"), "{e}");
        assert_eq!(std::fs::read_to_string(&script).unwrap(), "print('hi')\n");
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "").unwrap();
        assert_eq!(check_profile_output(&empty, false).unwrap(), Existing::Empty);
        assert_eq!(check_profile_output(&dir.path().join("new.sqlite"), false).unwrap(), Existing::Nothing);
    }

    #[test]
    fn a_directory_output_gives_each_rank_or_node_its_own_new_file() {
        use torchmem_core::model::{JobPlace, Launch, Origin};
        let dir = tempfile::tempdir().unwrap();
        let prof = dir.path().join("prof");
        assert!(names_a_directory(Path::new("prof/")) && names_a_directory(dir.path()));
        assert!(!names_a_directory(&prof) && !names_a_directory(&dir.path().join("run.sqlite")));
        let pid = std::process::id();
        let rank = JobPlace {
            origin: Origin { rank: Some(3), ..Default::default() },
            launch: Launch { restart_count: Some(1), group_rank: Some(0) },
        };
        let a = dir_output(&prof, "node a", Some(&rank)).unwrap();
        assert!(prof.is_dir(), "a missing DIR/ is created");
        let name = a.file_name().unwrap().to_str().unwrap().to_string();
        assert!(name.starts_with("node_a-rank3-restart1-") && name.ends_with(&format!("-{pid}.sqlite")), "{name}");
        std::fs::write(&a, "").unwrap();
        let again = dir_output(&prof, "node a", Some(&rank)).unwrap();
        assert_ne!(again, a, "an existing file is never chosen");
        assert!(again.to_str().unwrap().ends_with(&format!("-{pid}-2.sqlite")), "{}", again.display());
        let node = JobPlace { launch: Launch { group_rank: Some(1), ..Default::default() }, ..Default::default() };
        let n = dir_output(&prof, "vm", Some(&node)).unwrap();
        assert!(n.file_name().unwrap().to_str().unwrap().starts_with("vm-node1-"), "{}", n.display());
        let first = JobPlace {
            origin: Origin { rank: Some(0), ..Default::default() },
            launch: Launch { restart_count: Some(0), ..Default::default() },
        };
        let f = dir_output(&prof, "vm", Some(&first)).unwrap();
        assert!(
            f.to_str().unwrap().contains("vm-rank0-") && !f.to_str().unwrap().contains("restart"),
            "{}",
            f.display()
        );
        let p = dir_output(&prof, "vm", None).unwrap();
        assert!(p.file_name().unwrap().to_str().unwrap().starts_with(&format!("vm-pid{pid}-")), "{}", p.display());
        let e = dir_output(&dir.path().join("no/such/"), "vm", None).unwrap_err().to_string();
        assert!(e.contains("does not exist") && e.contains("no"), "{e}");
        assert!(!dir.path().join("no").exists(), "nothing is created on the way");
    }

    #[test]
    fn html_output_never_replaces_its_input_or_a_foreign_file() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("s.pickle");
        std::fs::write(&input, b"\x80\x04data").unwrap();
        let e = check_html_output(&input, &[&input], true, "--html").unwrap_err().to_string();
        assert!(e.contains("would overwrite the file it reads"), "{e}");
        let notes = dir.path().join("notes.html");
        std::fs::write(&notes, "<html>mine</html>").unwrap();
        assert!(check_html_output(&notes, &[&input], false, "--html").unwrap_err().to_string().contains("--force"));
        assert!(check_html_output(&notes, &[&input], true, "--html").is_ok());
        let ours = dir.path().join("ours.html");
        std::fs::write(&ours, "<!DOCTYPE html>\n<html><head><title>torchmem snapshot: x</title>").unwrap();
        assert!(check_html_output(&ours, &[&input], false, "--html").is_ok());
    }
}
