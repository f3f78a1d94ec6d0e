//! Launching the user's program, shared by `torchmem run` (under the recorder's session) and `torchmem
//! estimate` (under the tracer): how a `-m MODULE`, a script or a command is turned into a command line
//! ([`resolve_command`], [`Program`]), which Python runs a bare script ([`python_interpreter`]: the
//! `TORCHMEM_PYTHON` the entry point sets, else `python3` from PATH), where the program is found
//! ([`find_program`]: a path as given, a bare name on PATH even when a folder of that name is in the current
//! directory), the private folder with the injected `sitecustomize.py` ([`PrivateDir`], [`sitecustomize`]:
//! mode 0700, locked while the run lives, swept after a SIGKILL by the next run) and the `PYTHONPATH` that
//! puts it first ([`pythonpath_with`]), and how an ended program's wait status becomes an exit code
//! ([`exit_code`]: the code, else 128 + the signal, as a shell says it).
//!
//! What each command does once the program runs stays with it: `session` records it (signals forwarded
//! through `signals::Supervisor`), the estimate waits for its trace.

use std::ffi::{OsStr, OsString};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use anyhow::{anyhow, bail};

/// The Python interpreter for bare scripts and `-m`: `TORCHMEM_PYTHON` (`python -m torchmem` sets it to the
/// interpreter that runs it), else the `python3` beside this binary (the `torchmem` of a venv's `bin/`, where pip
/// put it, runs that venv's Python), else `python3` from PATH.
pub fn python_interpreter() -> String {
    let beside = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join("python3")));
    interpreter_from(std::env::var("TORCHMEM_PYTHON").ok(), beside.as_deref())
}

/// [`python_interpreter`]'s rule on a given `TORCHMEM_PYTHON` and the path of a `python3` beside the binary:
/// the variable unless unset or empty, then that `python3` when it is an executable file, then `python3`.
fn interpreter_from(torchmem_python: Option<String>, beside: Option<&Path>) -> String {
    if let Some(p) = torchmem_python.filter(|s| !s.is_empty()) {
        return p;
    }
    match beside {
        Some(p) if executable(p) => p.display().to_string(),
        _ => "python3".into(),
    }
}

fn executable(p: &Path) -> bool {
    let Ok(c) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(p.as_os_str())) else {
        return false;
    };
    // SAFETY: access on a NUL-terminated path we own.
    p.is_file() && unsafe { libc::access(c.as_ptr(), libc::X_OK) } == 0
}

/// The file to execute for `program`: a path as given, else the first executable match on PATH. Each way
/// it can fail gets its own message.
pub fn find_program(program: &str) -> anyhow::Result<PathBuf> {
    find_program_on(program, std::env::var_os("PATH").as_deref())
}

/// [`find_program`] with a given PATH.
fn find_program_on(program: &str, path_var: Option<&OsStr>) -> anyhow::Result<PathBuf> {
    if program.contains('/') {
        let p = PathBuf::from(program);
        if p.is_dir() {
            bail!("cannot start `{program}`: it is a directory (a directory runs only when it has a __main__.py)");
        }
        if !p.exists() {
            bail!("cannot start `{program}`: no such file. Check the path");
        }
        if !executable(&p) {
            bail!(
                "cannot start `{program}`: it is not executable. Make it so (`chmod +x {program}`), or name its interpreter (`torchmem run -- sh {program}`)"
            );
        }
        return Ok(p);
    }
    path_var
        .and_then(|paths| std::env::split_paths(paths).map(|d| d.join(program)).find(|p| executable(p)))
        .ok_or_else(|| anyhow!("cannot start `{program}`: no such program on PATH. Check the command, or give a path"))
}

/// Works out what to execute: `-m MODULE` and a bare `*.py`, `*.pyz` or a directory with `__main__.py` run
/// under [`python_interpreter`]; anything else runs as given. Paths are resolved from the current directory.
pub fn resolve_command(module: Option<&str>, command: &[String]) -> anyhow::Result<Vec<String>> {
    resolve_with(module, command, &python_interpreter(), std::env::var_os("PATH").as_deref())
}

/// [`resolve_command`] with a given interpreter and PATH.
fn resolve_with(
    module: Option<&str>,
    command: &[String],
    interpreter: &str,
    path_var: Option<&OsStr>,
) -> anyhow::Result<Vec<String>> {
    if let Some(m) = module {
        let mut argv = vec![interpreter.to_string(), "-m".into(), m.to_string()];
        argv.extend(command.iter().cloned());
        return Ok(argv);
    }
    let Some(first) = command.first() else {
        bail!("no program given: name it after --, e.g. `-- python train.py`");
    };
    let path = Path::new(first);
    let cwd = || std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default();
    let python = |argv0: &str| {
        let mut argv = vec![interpreter.to_string(), argv0.to_string()];
        argv.extend(command[1..].iter().cloned());
        argv
    };
    if path.is_dir() {
        if path.join("__main__.py").is_file() {
            return Ok(python(first));
        }
        // A bare name (no `/`) is a program on PATH, as exec finds it: `-- python train.py` run from a
        // checkout with a `python/` folder runs Python, not the folder.
        if !first.contains('/') && find_program_on(first, path_var).is_ok() {
            return Ok(command.to_vec());
        }
        bail!(
            "{first} is a directory, not a program or a script (a directory runs only when it has a __main__.py; resolved from {})",
            cwd()
        );
    }
    if first.ends_with(".py") || first.ends_with(".pyz") {
        if !path.is_file() {
            bail!("script not found: {first}. Check the path (it is resolved from the current directory {})", cwd());
        }
        return Ok(python(first));
    }
    Ok(command.to_vec())
}

/// The program's name for a default output name: the module (dots as `_`), the first `*.py` argument, a
/// directory's own name, or the command.
pub fn program_name(module: Option<&str>, command: &[String]) -> String {
    if let Some(m) = module {
        return m.replace('.', "_");
    }
    let Some(program) = command.iter().find(|a| a.ends_with(".py")).or(command.first()) else {
        return "run".into();
    };
    let p = Path::new(program);
    if p.is_dir() {
        // `torchmem run -- ./pkgdir`: the directory's name.
        return std::fs::canonicalize(p)
            .ok()
            .and_then(|c| c.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "run".into());
    }
    program.clone()
}

/// A program ready to start: its command line as the user means it (`argv[0]` as typed or the interpreter)
/// and the file that executes it.
#[derive(Debug, Clone)]
pub struct Program {
    pub argv: Vec<String>,
    pub path: PathBuf,
}

impl Program {
    /// [`resolve_command`] then [`find_program`]: every way the command cannot start is said before anything
    /// is created.
    pub fn resolve(module: Option<&str>, command: &[String]) -> anyhow::Result<Program> {
        let argv = resolve_command(module, command)?;
        let path = find_program(&argv[0])?;
        Ok(Program { argv, path })
    }

    /// The command that starts it: the found file, with `argv[0]` as typed (as a shell would run it).
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.path);
        cmd.arg0(&self.argv[0]).args(&self.argv[1..]);
        cmd
    }

    /// The command line, for messages.
    pub fn shown(&self) -> String {
        self.argv.join(" ")
    }
}

/// The directory for torchmem's private files: `TMPDIR` when it is an existing directory, else /tmp (with
/// a warning: a missing `TMPDIR` is never created).
pub fn temp_base() -> PathBuf {
    match std::env::var_os("TMPDIR").filter(|t| !t.is_empty()) {
        None => PathBuf::from("/tmp"),
        Some(t) if Path::new(&t).is_dir() => PathBuf::from(t),
        Some(t) => {
            eprintln!(
                "torchmem: warning: TMPDIR={} is not an existing directory; using /tmp for torchmem's files",
                Path::new(&t).display()
            );
            PathBuf::from("/tmp")
        }
    }
}

/// The prefixes of torchmem's private folders in the temp base, each `<prefix><owner pid>-<ns>`.
const PRIVATE_PREFIXES: [&str; 3] = ["torchmem-inject-", "torchmem-events-", "torchmem-estimate-"];

/// The owner pid in a private folder's name, or None when the name is not one of ours.
fn owner_pid(name: &str) -> Option<i32> {
    let rest = PRIVATE_PREFIXES.iter().find_map(|p| name.strip_prefix(p))?;
    rest.split('-').next().and_then(|p| p.parse::<i32>().ok()).filter(|p| *p > 0)
}

/// Removes the private folders (`torchmem-inject-*`, `torchmem-events-*`, `torchmem-estimate-*`) of runs
/// that were killed (SIGKILL gives no chance to clean up): only ours (same uid), only when the owner pid in
/// the name is gone, and only when no live run holds the folder's lock.
pub fn sweep_dead_runs(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else { return };
    // SAFETY: geteuid is always safe.
    let uid = unsafe { libc::geteuid() };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = owner_pid(&name) else { continue };
        let path = e.path();
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() && m.uid() == uid => {}
            _ => continue,
        }
        // SAFETY: signal 0 only checks whether the pid exists.
        let alive =
            unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if alive {
            continue;
        }
        let Ok(dir) = std::fs::File::open(&path) else { continue };
        // SAFETY: flock on a directory descriptor we own.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// The end of every injected `sitecustomize.py`: hands over to the next `sitecustomize` on `sys.path` (the
/// environment's own), which ours shadows by coming first on `PYTHONPATH`.
const CHAIN: &str = include_str!("sitecustomize_chain.py");

/// A `sitecustomize.py`: `head` (what the command loads into the program), then [`CHAIN`].
pub fn sitecustomize(head: &str) -> String {
    format!("{head}\n{CHAIN}")
}

/// A private folder `torchmem-<kind>-<pid>-<ns>` in the temp base (mode 0700) holding a `sitecustomize.py`,
/// locked while it lives (so a later run's sweep knows it is live) and removed when dropped (on every way
/// out; a SIGKILLed command's is swept by the next `torchmem run`).
pub struct PrivateDir {
    path: PathBuf,
    _lock: std::fs::File,
}

impl PrivateDir {
    pub fn create(base: &Path, kind: &str, sitecustomize: &str) -> anyhow::Result<Self> {
        let dir = base.join(format!("torchmem-{kind}-{}-{}", std::process::id(), torchmem_core::clock::monotonic_ns()));
        std::fs::DirBuilder::new().mode(0o700).create(&dir).map_err(|e| {
            anyhow!("cannot create torchmem's directory {}: {e}. Set TMPDIR to a writable directory", dir.display())
        })?;
        let made = std::fs::write(dir.join("sitecustomize.py"), sitecustomize).and_then(|_| std::fs::File::open(&dir));
        match made {
            Ok(lock) => {
                // SAFETY: flock on a directory descriptor we own (released when it closes).
                unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
                Ok(PrivateDir { path: dir, _lock: lock })
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                bail!("cannot write torchmem's sitecustomize.py into {}: {e}", dir.display())
            }
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Puts this folder first on the program's `PYTHONPATH` (before the one torchmem got), so Python runs our
    /// `sitecustomize.py`.
    pub fn inject_into(&self, cmd: &mut Command) {
        let old = std::env::var_os("PYTHONPATH");
        cmd.env("PYTHONPATH", pythonpath_with(&self.path, old.as_deref()));
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// `dir` first, then the `PYTHONPATH` there was (an empty one counts as none).
pub fn pythonpath_with(dir: &Path, old: Option<&OsStr>) -> OsString {
    let mut path = OsString::from(dir);
    if let Some(old) = old.filter(|p| !p.is_empty()) {
        path.push(":");
        path.push(old);
    }
    path
}

/// The exit code of an ended program, as a shell gives it: its code, or 128 + the signal that killed it.
pub fn exit_code(status: ExitStatus) -> i32 {
    status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1)
}

/// A pidfd of the program (`pidfd_open`), readable once it has ended: a wait loop wakes on it. None where
/// the kernel lacks pidfds (Linux < 5.3).
pub fn program_pidfd(pid: libc::pid_t) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open takes a pid and flags; a non-negative result is a new descriptor we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    // SAFETY: fd is a fresh descriptor returned to us.
    (fd >= 0).then(|| unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn interpreter_is_torchmem_python_else_the_venvs_else_python3() {
        let d = tempfile::tempdir().unwrap();
        let beside = d.path().join("python3");
        assert_eq!(interpreter_from(Some("/venv/bin/python".into()), None), "/venv/bin/python");
        assert_eq!(interpreter_from(Some(String::new()), None), "python3");
        assert_eq!(interpreter_from(None, None), "python3");
        // No python3 beside the binary (cargo's target/release): PATH's.
        assert_eq!(interpreter_from(None, Some(&beside)), "python3");
        std::fs::write(&beside, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&beside, std::fs::Permissions::from_mode(0o755)).unwrap();
        // The binary in a venv's bin/: that venv's Python, unless TORCHMEM_PYTHON says otherwise.
        assert_eq!(interpreter_from(None, Some(&beside)), beside.display().to_string());
        assert_eq!(interpreter_from(Some("/other/python".into()), Some(&beside)), "/other/python");
    }

    #[test]
    fn module_runs_under_the_interpreter_with_its_arguments() {
        let argv = resolve_with(Some("pkg.train"), &strings(&["--lr", "1"]), "/py", None).unwrap();
        assert_eq!(argv, strings(&["/py", "-m", "pkg.train", "--lr", "1"]));
    }

    #[test]
    fn scripts_and_main_dirs_run_under_the_interpreter_others_as_given() {
        let d = tempfile::tempdir().unwrap();
        let script = d.path().join("train.py");
        std::fs::write(&script, "").unwrap();
        let pkg = d.path().join("pkg");
        std::fs::create_dir(&pkg).unwrap();
        std::fs::write(pkg.join("__main__.py"), "").unwrap();
        let s = script.display().to_string();
        assert_eq!(
            resolve_with(None, &[s.clone(), "3".into()], "/py", None).unwrap(),
            vec!["/py".into(), s, "3".into()]
        );
        let p = pkg.display().to_string();
        assert_eq!(resolve_with(None, std::slice::from_ref(&p), "/py", None).unwrap(), vec!["/py".to_string(), p]);
        let cmd = strings(&["sh", "-c", "true"]);
        assert_eq!(resolve_with(None, &cmd, "/py", None).unwrap(), cmd);
    }

    #[test]
    fn a_missing_script_or_a_plain_dir_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let missing = d.path().join("nope.py").display().to_string();
        let e = resolve_with(None, &[missing], "/py", None).unwrap_err().to_string();
        assert!(e.starts_with("script not found:"), "{e}");
        let plain = d.path().join("data");
        std::fs::create_dir(&plain).unwrap();
        let e = resolve_with(None, &[plain.display().to_string()], "/py", None).unwrap_err().to_string();
        assert!(e.contains("is a directory, not a program or a script"), "{e}");
        assert!(resolve_with(None, &[], "/py", None).is_err());
    }

    #[test]
    fn a_bare_name_is_found_on_path_even_beside_a_folder_of_that_name() {
        // The folder `python/` in the current directory must not hide `python` on PATH.
        let d = tempfile::tempdir().unwrap();
        let bin = d.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let tool = bin.join("tmtool-xyz");
        std::fs::write(&tool, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(find_program_on("tmtool-xyz", Some(bin.as_os_str())).unwrap(), tool);
        let e = find_program_on("tmtool-xyz", Some(d.path().as_os_str())).unwrap_err().to_string();
        assert!(e.contains("no such program on PATH"), "{e}");
        // A relative bare name that is a folder here (cwd-independent: the folder is `src`, which this
        // crate's tests run beside) resolves to PATH's program when there is one.
        let here = std::env::current_dir().unwrap();
        if here.join("src").is_dir() {
            let src_bin = d.path().join("src-bin");
            std::fs::create_dir(&src_bin).unwrap();
            let src = src_bin.join("src");
            std::fs::write(&src, "#!/bin/sh\n").unwrap();
            std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o755)).unwrap();
            let argv = resolve_with(None, &strings(&["src", "x"]), "/py", Some(src_bin.as_os_str())).unwrap();
            assert_eq!(argv, strings(&["src", "x"]));
            let e = resolve_with(None, &strings(&["src"]), "/py", Some(d.path().as_os_str())).unwrap_err();
            assert!(e.to_string().contains("is a directory"), "{e}");
        }
    }

    #[test]
    fn paths_name_their_problem() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("plain.sh");
        std::fs::write(&f, "").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = find_program(&f.display().to_string()).unwrap_err().to_string();
        assert!(e.contains("it is not executable"), "{e}");
        let e = find_program(&d.path().join("none").display().to_string()).unwrap_err().to_string();
        assert!(e.contains("no such file"), "{e}");
        let e = find_program(&format!("{}/", d.path().display())).unwrap_err().to_string();
        assert!(e.contains("it is a directory"), "{e}");
    }

    #[test]
    fn program_names() {
        assert_eq!(program_name(Some("pkg.train"), &[]), "pkg_train");
        assert_eq!(program_name(None, &strings(&["python", "train.py", "x"])), "train.py");
        assert_eq!(program_name(None, &strings(&["sleep", "1"])), "sleep");
        let d = tempfile::tempdir().unwrap();
        let pkg = d.path().join("mypkg");
        std::fs::create_dir(&pkg).unwrap();
        assert_eq!(program_name(None, &[pkg.display().to_string()]), "mypkg");
    }

    #[test]
    fn pythonpath_puts_ours_first() {
        let d = Path::new("/tmp/torchmem-inject-1-2");
        assert_eq!(pythonpath_with(d, None), OsString::from("/tmp/torchmem-inject-1-2"));
        assert_eq!(pythonpath_with(d, Some(OsStr::new(""))), OsString::from("/tmp/torchmem-inject-1-2"));
        assert_eq!(pythonpath_with(d, Some(OsStr::new("/a:/b"))), OsString::from("/tmp/torchmem-inject-1-2:/a:/b"));
    }

    #[test]
    fn exit_codes_as_a_shell_says_them() {
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGTERM)), 143);
    }

    #[test]
    fn owner_pids_only_from_our_names() {
        assert_eq!(owner_pid("torchmem-inject-123-456"), Some(123));
        assert_eq!(owner_pid("torchmem-events-9-1"), Some(9));
        assert_eq!(owner_pid("torchmem-estimate-77-1"), Some(77));
        assert_eq!(owner_pid("torchmem-inject-0-1"), None);
        assert_eq!(owner_pid("torchmem-inject-x-1"), None);
        assert_eq!(owner_pid("other-123-4"), None);
    }

    #[test]
    fn private_dir_is_0700_holds_the_sitecustomize_and_goes_on_drop() {
        let base = tempfile::tempdir().unwrap();
        let text = sitecustomize("import os");
        assert!(text.starts_with("import os\n") && text.contains("_torchmem_next_sitecustomize"));
        let dir = PrivateDir::create(base.path(), "inject", &text).unwrap();
        let path = dir.path().to_path_buf();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o700);
        assert_eq!(std::fs::read_to_string(path.join("sitecustomize.py")).unwrap(), text);
        // Ours and alive: the sweep keeps it.
        sweep_dead_runs(base.path());
        assert!(path.is_dir());
        let mut cmd = Command::new("true");
        dir.inject_into(&mut cmd);
        let set = cmd.get_envs().find(|(k, _)| *k == "PYTHONPATH").and_then(|(_, v)| v).unwrap();
        assert!(set.to_string_lossy().starts_with(&path.display().to_string()));
        drop(dir);
        assert!(!path.exists());
    }

    #[test]
    fn the_sweep_removes_a_dead_owners_folder() {
        let base = tempfile::tempdir().unwrap();
        // A pid that cannot be alive: above the kernel's pid_max limit (4194304).
        let dead = base.path().join("torchmem-estimate-2147483646-1");
        std::fs::create_dir(&dead).unwrap();
        let other = base.path().join("someone-else-2147483646-1");
        std::fs::create_dir(&other).unwrap();
        sweep_dead_runs(base.path());
        assert!(!dead.exists());
        assert!(other.exists());
    }
}
