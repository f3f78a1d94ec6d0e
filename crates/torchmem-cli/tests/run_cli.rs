//! End-to-end tests of `torchmem run` on real Python scripts: real child processes, real /proc, real
//! profile files, read back with `torchmem report --format json`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

const MIB: u64 = 1 << 20;

fn torchmem() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_torchmem"));
    c.env("TORCHMEM_PYTHON", python());
    c
}

/// The project's venv Python when there is one (it has torch and torchmem installed), else python3.
fn python() -> String {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    if venv.exists() {
        venv.display().to_string()
    } else {
        "python3".into()
    }
}

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

fn report_json(profile: &Path) -> serde_json::Value {
    let out = torchmem().args(["report", "--format", "json"]).arg(profile).output().unwrap();
    assert!(out.status.success(), "report failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("report JSON")
}

fn profile_table(profile: &Path, sql: &str) -> Vec<Vec<i64>> {
    // Read the profile with Python's own sqlite3 module: the file is plain SQLite.
    let code = format!(
        "import sqlite3,json; print(json.dumps(sqlite3.connect({:?}).execute({sql:?}).fetchall()))",
        profile.display().to_string()
    );
    let out = Command::new(python()).args(["-c", &code]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn allocating_n_mib_shows_n_mib_more_rss() {
    let dir = tempfile::tempdir().unwrap();
    let s =
        script(dir.path(), "alloc.py", "import time\ntime.sleep(0.3)\nx = b'\\x01' * (256 << 20)\ntime.sleep(0.3)\n");
    let prof = dir.path().join("p.sqlite");
    let out = torchmem().args(["run", "-q", "-o"]).arg(&prof).arg("--").arg(&s).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let rows = profile_table(&prof, "select min(rss_bytes), max(rss_bytes), count(*) from cpu_samples");
    let (min, max, n) = (rows[0][0] as u64, rows[0][1] as u64, rows[0][2]);
    assert!(max - min >= 256 * MIB, "rss grew only {} MiB", (max - min) / MIB);
    // 0.6 s at 10 ms: at least 30 samples even on a loaded machine.
    assert!(n >= 30, "only {n} samples");
    let j = report_json(&prof);
    assert_eq!(j["samples"].as_i64(), Some(n));
    assert!(j["peak"]["cpu_rss_bytes"].as_u64().unwrap() >= 256 * MIB);
}

#[test]
fn exit_code_is_the_programs() {
    let dir = tempfile::tempdir().unwrap();
    let s = script(dir.path(), "exit3.py", "import sys\nsys.exit(3)\n");
    let prof = dir.path().join("p.sqlite");
    let out = torchmem().args(["run", "-q", "-o"]).arg(&prof).arg(&s).output().unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(report_json(&prof)["meta"]["exit_code"].as_i64(), Some(3));
}

#[test]
fn non_python_commands_run_as_given() {
    let dir = tempfile::tempdir().unwrap();
    let prof = dir.path().join("p.sqlite");
    let out =
        torchmem().args(["run", "-q", "-o"]).arg(&prof).args(["--", "sh", "-c", "sleep 0.2; exit 5"]).output().unwrap();
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
    assert!(report_json(&prof)["samples"].as_i64().unwrap() >= 5);
}

#[test]
fn a_program_killed_with_sigkill_leaves_a_readable_profile() {
    let dir = tempfile::tempdir().unwrap();
    let s = script(
        dir.path(),
        "die.py",
        "import os, time\nx = b'\\x01' * (128 << 20)\ntime.sleep(0.5)\nos.kill(os.getpid(), 9)\n",
    );
    let prof = dir.path().join("p.sqlite");
    let out = torchmem().args(["run", "-q", "-o"]).arg(&prof).arg(&s).output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 9), "{}", stderr(&out));
    let j = report_json(&prof);
    assert!(j["peak"]["cpu_rss_bytes"].as_u64().unwrap() >= 128 * MIB);
    // The last sample is within 100 ms of the program's death (it lived ~0.5 s after the allocation).
    let rows = profile_table(&prof, "select max(t_ns) from cpu_samples");
    assert!(rows[0][0] as u64 >= 400_000_000, "last sample at {} ns", rows[0][0]);
}

#[test]
fn a_recorder_killed_with_sigkill_leaves_a_readable_profile() {
    let dir = tempfile::tempdir().unwrap();
    let s = script(dir.path(), "slow.py", "import time\nx = b'\\x01' * (64 << 20)\ntime.sleep(5)\n");
    let prof = dir.path().join("p.sqlite");
    let mut child = torchmem().args(["run", "-q", "-o"]).arg(&prof).arg(&s).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    child.kill().unwrap(); // SIGKILL to the recorder itself
    child.wait().unwrap();
    let rows = profile_table(&prof, "select count(*), max(t_ns) from cpu_samples");
    assert!(rows[0][0] >= 50, "only {} samples survived", rows[0][0]);
    // Everything up to ~100 ms before the kill is there (flushes happen every 50 ms).
    assert!(rows[0][1] as u64 >= 1_200_000_000, "last sample at {} ns", rows[0][1]);
    let j = report_json(&prof);
    assert!(j["meta"]["exit_code"].is_null());
}

#[test]
fn sigterm_is_passed_on_to_the_program() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("got-term");
    let s = script(
        dir.path(),
        "term.py",
        &format!(
            "import signal, sys, time\ndef h(sig, frame):\n    open({:?}, 'w').write('yes')\n    sys.exit(42)\nsignal.signal(signal.SIGTERM, h)\nprint('ready', flush=True)\ntime.sleep(30)\n",
            marker.display().to_string()
        ),
    );
    let prof = dir.path().join("p.sqlite");
    let mut child =
        torchmem().args(["run", "-q", "-o"]).arg(&prof).arg(&s).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(42));
    assert_eq!(std::fs::read_to_string(&marker).unwrap(), "yes");
}

#[test]
fn missing_script_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let prof = dir.path().join("p.sqlite");
    let out = torchmem().args(["run", "-o"]).arg(&prof).arg("no_such_script.py").output().unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("script not found: no_such_script.py"), "{}", stderr(&out));
    assert!(!prof.exists(), "no profile should be left behind");
}

#[test]
fn a_command_that_cannot_start_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let prof = dir.path().join("p.sqlite");
    let out = torchmem().args(["run", "-o"]).arg(&prof).args(["--", "definitely-not-a-program-xyz"]).output().unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("cannot start `definitely-not-a-program-xyz`"), "{}", stderr(&out));
    let not_exec = script(dir.path(), "data.txt", "not a program");
    let out = torchmem().args(["run", "-o"]).arg(&prof).arg("--").arg(&not_exec).output().unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("cannot start"), "{}", stderr(&out));
}

#[test]
fn a_corrupt_profile_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.sqlite");
    std::fs::write(&bad, b"SQLite format 3\0 but then garbage garbage garbage").unwrap();
    let out = torchmem().args(["report"]).arg(&bad).output().unwrap();
    assert!(!out.status.success());
    assert!(stderr(&out).contains("is not a torchmem profile"), "{}", stderr(&out));
}

/// `profile_table` on a profile that is still being written: None while the file or its tables are not there yet.
fn try_profile_table(profile: &Path, sql: &str) -> Option<Vec<Vec<i64>>> {
    let code = format!(
        "import sqlite3,json; print(json.dumps(sqlite3.connect({:?}).execute({sql:?}).fetchall()))",
        profile.display().to_string()
    );
    let out = Command::new(python()).args(["-c", &code]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

#[test]
fn worker_children_are_summed_without_double_counting() {
    // A parent touches 200 MiB, then forks 3 workers that only read it (shared pages) and each touch 50 MiB
    // of their own, say so with a file, then hold it until the test has seen two PSS reads of the tree after all
    // three were ready (a loaded machine stretches the PSS interval to seconds), or 120 s. RSS summed over the
    // tree counts the shared 200 MiB four times; PSS counts it once.
    let dir = tempfile::tempdir().unwrap();
    let stop = dir.path().join("stop");
    let body = format!(
        "import os, time\nshared = bytearray(b'\\x01' * (200 << 20))\npids = []\nfor i in range(3):\n    pid = os.fork()\n    if pid == 0:\n        s = 0\n        for off in range(0, len(shared), 4096):\n            s += shared[off]\n        own = b'\\x02' * (50 << 20)\n        open(os.path.join({dir:?}, f'ready{{i}}'), 'w').close()\n        t0 = time.monotonic()\n        while not os.path.exists({stop:?}) and time.monotonic() - t0 < 120:\n            time.sleep(0.05)\n        os._exit(0)\n    pids.append(pid)\nfor p in pids:\n    os.waitpid(p, 0)\n",
        dir = dir.path().display().to_string(),
        stop = stop.display().to_string()
    );
    let s = script(dir.path(), "workers.py", &body);
    let prof = dir.path().join("p.sqlite");
    let child = torchmem()
        .args(["run", "-q", "--pss-interval", "100", "-o"])
        .arg(&prof)
        .arg(&s)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let reads = "select count(*) from cpu_samples where pss_bytes is not null and process_count = 4";
    let count = || try_profile_table(&prof, reads).and_then(|r| r.first().map(|row| row[0])).unwrap_or(0);
    let started = std::time::Instant::now();
    let mut reads_when_ready = None;
    while started.elapsed() < Duration::from_secs(120) {
        match reads_when_ready {
            None if (0..3).all(|i| dir.path().join(format!("ready{i}")).exists()) => reads_when_ready = Some(count()),
            Some(n) if count() >= n + 2 => break,
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(300));
    }
    std::fs::write(&stop, b"").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(reads_when_ready.is_some(), "the workers never got ready");
    let rows = profile_table(&prof, "select rss_bytes, pss_bytes, process_count from cpu_samples where pss_bytes is not null and process_count = 4 order by t_ns desc limit 1");
    assert!(!rows.is_empty(), "no sample saw all four processes");
    let (rss, pss) = (rows[0][0] as u64, rows[0][1] as u64);
    assert!(rss >= (200 * 4 + 150) * MIB, "tree RSS {} MiB", rss / MIB);
    // PSS: shared 200 MiB once + 3 × 50 MiB + interpreters (a few MiB each): well under 500 MiB.
    assert!((350 * MIB..500 * MIB).contains(&pss), "tree PSS {} MiB", pss / MIB);
    let report = report_json(&prof);
    let procs = report["processes"].as_array().unwrap();
    assert_eq!(procs.len(), 4, "{procs:#?}");
}

#[test]
fn info_reports_host_torch_and_gpus_or_why_not() {
    let out = torchmem().args(["info", "--json"]).output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let total_kib: u64 = meminfo.lines().next().unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_eq!(j["host_total_bytes"].as_u64(), Some(total_kib * 1024));
    let gpus = j["gpus"].as_array().unwrap();
    if gpus.is_empty() {
        // Never a fake zero: an explicit reason instead.
        assert!(
            j["gpu_unavailable"].as_str().unwrap().contains("no CUDA device")
                || j["gpu_unavailable"].as_str().unwrap().contains("NVML")
        );
    } else {
        assert!(gpus.iter().all(|g| g["total_bytes"].as_u64().unwrap() > 0));
    }
    let torch_here = Command::new(python()).args(["-c", "import torch"]).status().unwrap().success();
    assert_eq!(j["torch"]["torch_version"].is_string(), torch_here);
    let table = torchmem().arg("info").output().unwrap();
    assert!(String::from_utf8_lossy(&table.stdout).contains("Host RAM"));
}

/// A program that logs each SIGINT/SIGTERM/SIGUSR1 it gets, lingers, and says "ready" on stdout.
const SIGNAL_LOGGER: &str = "import signal, sys, time\nlog = sys.argv[1]\ndef on(s, f):\n    open(log, 'a').write(signal.Signals(s).name + '\\n')\n    if s == signal.SIGTERM:\n        time.sleep(0.3)\n        sys.exit(115)\nfor s in (signal.SIGTERM, signal.SIGUSR1):\n    signal.signal(s, on)\ntry:\n    print('ready', flush=True)\n    time.sleep(1.5)\nexcept KeyboardInterrupt:\n    open(log, 'a').write('SIGINT\\n')\n    time.sleep(0.5)\n";

/// Starts `torchmem run` on the signal logger in a session (and process group) of its own.
fn start_logger(dir: &Path, log: &Path) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    let s = script(dir, "logger.py", SIGNAL_LOGGER);
    let mut cmd = torchmem();
    cmd.args(["run", "-q", "-o"]).arg(log.with_extension("sqlite")).arg(&s).arg(log);
    cmd.stdout(std::process::Stdio::piped());
    // SAFETY: setsid and signal are async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            // As from an interactive shell, whatever ran these tests: a harness that started them in the
            // background of a script (SIGINT ignored) would give the program no KeyboardInterrupt at all.
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            libc::signal(libc::SIGHUP, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert_eq!(line.trim(), "ready");
    child
}

#[test]
fn a_signal_to_the_whole_group_reaches_the_program_once() {
    let dir = tempfile::tempdir().unwrap();
    for (sig, code, name) in [(libc::SIGINT, 0, "SIGINT"), (libc::SIGTERM, 115, "SIGTERM")] {
        let log = dir.path().join(format!("{name}.log"));
        let mut child = start_logger(dir.path(), &log);
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: signalling the process group we created (setsid: its id is the child's pid).
        unsafe { libc::kill(-(child.id() as i32), sig) };
        assert_eq!(child.wait().unwrap().code(), Some(code), "{name}");
        assert_eq!(std::fs::read_to_string(&log).unwrap(), format!("{name}\n"), "delivered once, not twice");
    }
}

#[test]
fn sigusr1_is_passed_on_and_torchmem_survives_it() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("usr1.log");
    let mut child = start_logger(dir.path(), &log);
    // SAFETY: signalling our own child (torchmem alone, not its group).
    unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
    assert_eq!(child.wait().unwrap().code(), Some(0));
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "SIGUSR1\n");
}

#[test]
fn a_file_that_is_not_a_profile_is_never_replaced_and_a_profile_only_with_force() {
    let dir = tempfile::tempdir().unwrap();
    let s = script(dir.path(), "victim.py", "print('mine')\n");
    let out = torchmem().args(["run", "--force", "-o"]).arg(&s).arg(&s).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("is not a torchmem profile"), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&s).unwrap(), "print('mine')\n");
    let prof = dir.path().join("p.sqlite");
    assert!(torchmem().args(["run", "-q", "-o"]).arg(&prof).arg(&s).status().unwrap().success());
    let again = torchmem().args(["run", "-q", "-o"]).arg(&prof).arg(&s).output().unwrap();
    assert!(!again.status.success() && stderr(&again).contains("--force"), "{}", stderr(&again));
    assert!(torchmem().args(["run", "-q", "--force", "-o"]).arg(&prof).arg(&s).status().unwrap().success());
}

#[test]
fn a_finished_profile_is_one_file_in_rollback_journal_mode() {
    let dir = tempfile::tempdir().unwrap();
    let s = script(dir.path(), "ok.py", "x = bytearray(8 << 20)\n");
    let prof = dir.path().join("p.sqlite");
    assert!(torchmem().args(["run", "-q", "-o"]).arg(&prof).arg(&s).status().unwrap().success());
    assert_eq!(&std::fs::read(&prof).unwrap()[18..20], &[1, 1], "not WAL any more");
    let mut names: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["ok.py", "p.sqlite"]);
}
