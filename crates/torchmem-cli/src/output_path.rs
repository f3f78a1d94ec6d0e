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

/// A unique default profile name in the current directory: `torchmem-<program>-<date>-<time>-<pid>.sqlite`,
/// with `-2`, `-3`… added in the unlikely case that such a file exists already.
pub fn default_output(program: &str) -> PathBuf {
    let stem = Path::new(program)
        .file_stem()
        .and_then(|s| s.to_str())
        .filter(|s| !s.is_empty())
        .unwrap_or("run")
        .replace(|c: char| !c.is_ascii_alphanumeric() && c != '-' && c != '_', "_");
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

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// True when the file starts like a page torchmem wrote (`plot`, `snapshot --html`).
pub fn is_torchmem_html(path: &Path) -> bool {
    let mut head = vec![0u8; 4096];
    let n = std::fs::File::open(path).and_then(|mut f| f.read(&mut head)).unwrap_or(0);
    let head = String::from_utf8_lossy(&head[..n]);
    head.starts_with("<!DOCTYPE html>") && head.contains("<title>torchmem")
}

/// Checks an HTML output path (`snapshot --html OUT`): never one of the inputs, never a directory, and an
/// existing file only when it is a page torchmem wrote (or with `--force`).
pub fn check_html_output(out: &Path, inputs: &[&Path], force: bool, flag: &str) -> anyhow::Result<()> {
    check_dir(out, flag)?;
    if inputs.iter().any(|i| same_file(out, i)) {
        bail!("{}: the output would overwrite the file it reads. Choose another path with {flag}", out.display());
    }
    if let Ok(m) = std::fs::metadata(out) {
        if !m.is_file() {
            bail!("{} exists and is not a regular file. Choose another path with {flag}", out.display());
        }
        if m.len() > 0 && !force && !is_torchmem_html(out) {
            bail!(
                "{} exists and is not an HTML page written by torchmem; use --force to overwrite it, or choose another path with {flag}",
                out.display()
            );
        }
    }
    Ok(())
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
